"""Any Llama-family checkpoint in a local folder: config.json + *.safetensors + tokenizer.json.

The `safetensors` package is not a dependency: the format is an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then raw little-endian bytes.
HF checkpoints keep q/k in the half-split RoPE layout; they are permuted to the interleaved
(GGUF) layout the model uses, as llama.cpp's converter does.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from model_runtime.llm.model import ModelArgs
from model_runtime.loading.tokenizer import Tokenizer

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        if not 0 <= start <= end <= len(data) - base:
            raise ValueError(f"{path}: tensor {name} lies outside the file")
        raw = np.frombuffer(data, dtype=np.uint8, count=end - start, offset=base + start)
        t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(meta["shape"])
        out[name] = t.float()
    return out


def _interleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def read_llama_folder(folder: str | Path):
    """-> (ModelArgs, GGUF-named float32 tensors, Tokenizer, name)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{folder}: no config.json")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if cfg.get("model_type", "llama") not in ("llama", "mistral") or "Llama" not in archs[0]:
        raise ValueError(f"{folder}: model_type {cfg.get('model_type')!r} is not Llama-family")
    n_heads = int(cfg["num_attention_heads"])
    args = ModelArgs(
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
        hidden_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
    )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(read_safetensors(f))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = t
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings", False):
                tensors["output.weight"] = t
        elif name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            key = _HF_TO_GGUF.get(rest.removesuffix(".weight"))
            if key is None:
                continue  # e.g. rotary inv_freq buffers
            if key == "attn_q":
                t = _interleave(t, args.n_heads)
            elif key == "attn_k":
                t = _interleave(t, args.n_kv_heads)
            tensors[f"blk.{i}.{key}.weight"] = t
    missing = [f"blk.{i}.attn_q.weight" for i in range(args.n_layers)]
    missing = [m for m in [*missing, "token_embd.weight"] if m not in tensors]
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {missing[:3]}")
    tok_path = folder / "tokenizer.json"
    if not tok_path.exists():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    eos = None
    gen_cfg = folder / "tokenizer_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
    tok = Tokenizer.from_file(tok_path, eos_token=eos)
    return args, tensors, tok, cfg.get("_name_or_path") or folder.name
