"""Decode attention in one native call per layer (kernels/step.c `native_attention`), for models
whose decode step otherwise runs in torch ops: a bf16 model on a CPU with the native kernels.

The same attention as the int4 model's native step (torch's CPU flash kernel's arithmetic: fp32
scores, probabilities rounded to bf16 before they weigh V; its exp and dot-product order are not
torch's, so an output may differ from SDPA's in the last bit). torch's SDPA over the gathered
cache took ~31 % of a bf16 batch-8 decode step here. Off with MESHLM_NATIVE_STEP=0, like the step.
"""

from __future__ import annotations

import ctypes

import torch

from model_runtime import kernels, native_step


def why_not(model: torch.nn.Module) -> str | None:
    """None when native attention applies to `model`'s decode steps, else why not."""
    off = native_step.switched_off(model)
    if off is not None:
        return off
    if model.dtype != torch.bfloat16:
        return f"its activations are {model.dtype}, not bf16"
    a = model.args
    if a.head_dim % 16 or a.head_dim > 128 or a.n_heads % a.n_kv_heads:
        return f"head_dim {a.head_dim} with {a.n_heads} / {a.n_kv_heads} heads is not supported"
    return native_step.unbuilt(kernels.isa())


class NativeAttention:
    """Called by each layer's Attention on a decode step (T = 1) once the new K/V are in the
    cache. Holds no tensors: a copy of the model shares it."""

    def __init__(self, model: torch.nn.Module):
        a = model.args
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        self.isa = kernels.isa()
        self.lib = native_step.library(self.isa)

    def __deepcopy__(self, memo) -> NativeAttention:
        return self

    def __call__(self, qkv: torch.Tensor, kv: torch.Tensor, layer: int, lay) -> torch.Tensor | None:
        """qkv [B, 1, n_heads + 2 n_kv, hd] bf16 (q after RoPE), kv the whole cache -> the
        attention output [B, 1, n_heads * hd] bf16, or None where it does not apply."""
        B = qkv.shape[0]
        if kv.dtype != torch.bfloat16 or not (kv.is_contiguous() and qkv.is_contiguous()):
            return None
        attended = native_step.attended_slots(lay, B)
        if attended is None:
            return None
        gather, mask = attended
        out = torch.empty(B, self.n_heads * self.hd, dtype=torch.float32)
        a = native_step.AttnArgs(
            B, gather.shape[1], self.n_heads, self.n_kv, self.hd, layer, qkv.data_ptr(),
            gather.data_ptr(), 0 if mask is None else mask.data_ptr(), kv.data_ptr(),
            kv.shape[1], out.data_ptr(),
        )  # fmt: skip
        rc = self.lib.native_attention(ctypes.byref(a), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("native attention: out of memory")
        return out.to(torch.bfloat16).view(B, 1, -1) if rc == 0 else None


def attach(model: torch.nn.Module) -> NativeAttention | None:
    return NativeAttention(model) if why_not(model) is None else None


def use(model: torch.nn.Module, on: bool) -> None:
    """Turn native decode attention on (where it applies) or off for `model`."""
    model.native_attention = attach(model) if on else None
