"""Attention over the paged cache in one native call per layer (kernels/step.c
`native_attention`): for a decode step that otherwise runs in torch ops (a bf16 model on a CPU
with the native kernels), and for every prefill chunk.

The same attention as the int4 model's native step (torch's CPU flash kernel's arithmetic: fp32
scores, probabilities rounded to bf16 before they weigh V; its exp and dot-product order are not
torch's, so an output may differ from SDPA's in the last bit). torch's SDPA over the gathered
cache is a large share of a bf16 decode step on a CPU. Off with MESHLM_NATIVE_STEP=0, like the
step. The loader attaches it (llm/accelerators.py): model.py does not import it.

Prefill: each row's output depends on its own query and keys alone, never on which rows share its
chunk, so a prompt prefilled in part from a prefix-cache hit gets the same bits as one prefilled
whole and a greedy stream does not depend on what the replica served before (torch's SDPA does
not promise that, and at a near-tie the stream would take another token).
"""

from __future__ import annotations

import ctypes

import torch

from model_runtime.kernels import isas
from model_runtime.llm import native_step


def why_not(model: torch.nn.Module) -> str | None:
    """Why native attention (decode steps, prefill chunks) does not apply to `model`, or None."""
    off = native_step.switched_off(model)
    if off is not None:
        return off
    if model.dtype != torch.bfloat16:
        return f"its activations are {model.dtype}, not bf16"
    a = model.args
    if a.head_dim % 16 or a.head_dim > 128 or a.n_heads % a.n_kv_heads:
        return f"head_dim {a.head_dim} with {a.n_heads} / {a.n_kv_heads} heads is not supported"
    return native_step.unbuilt(isas.isa())


class NativeAttention:
    """Called by each layer's Attention on a decode step or a prefill chunk once the new K/V are
    in the cache. Holds no tensors: a copy of the model shares it."""

    def __init__(self, model: torch.nn.Module):
        a = model.args
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        self.isa = isas.isa()
        self.lib = native_step.library(self.isa)

    def __deepcopy__(self, memo) -> NativeAttention:
        return self

    def __call__(self, qkv: torch.Tensor, kv: torch.Tensor, layer: int, lay) -> torch.Tensor | None:
        """qkv [B, T, n_heads + 2 n_kv, hd] bf16 (q after RoPE) of a decode step (T = 1) or of
        one sequence's prefill chunk (B = 1, `lay` from kvcache.layout_prefill), kv the whole
        cache -> the attention output [B, T, n_heads * hd] bf16, or None where it does not apply."""
        B, T = qkv.shape[:2]
        if kv.dtype != torch.bfloat16 or not (kv.is_contiguous() and qkv.is_contiguous()):
            return None
        if T == 1:
            attended = native_step.attended_slots(lay, B)
            if attended is None:
                return None
            (gather, mask), keys0 = attended, 0
        elif B == 1 and lay.gather_slots.shape[0] == 1:
            # row t attends slots [0, start + t]: the layout's slots end with the chunk's
            # (layout_prefill), so start = L - T
            gather, mask = lay.gather_slots.contiguous(), None
            keys0 = gather.shape[1] - T + 1
            if keys0 < 1 or int(lay.input_pos[0, 0]) != keys0 - 1:
                return None
        else:
            return None
        out = torch.empty(B * T, self.n_heads * self.hd, dtype=torch.float32)
        a = native_step.AttnArgs(
            B * T, gather.shape[1], self.n_heads, self.n_kv, self.hd, layer, qkv.data_ptr(),
            gather.data_ptr(), 0 if mask is None else mask.data_ptr(), kv.data_ptr(),
            kv.shape[1], out.data_ptr(), keys0,
        )  # fmt: skip
        rc = self.lib.native_attention(ctypes.byref(a), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("native attention: out of memory")
        return out.to(torch.bfloat16).view(B, T, -1) if rc == 0 else None


def attach(model: torch.nn.Module) -> NativeAttention | None:
    return NativeAttention(model) if why_not(model) is None else None


def use(model: torch.nn.Module, on: bool) -> None:
    """Turn native attention on (where it applies) or off for `model`."""
    model.native_attention = attach(model) if on else None
