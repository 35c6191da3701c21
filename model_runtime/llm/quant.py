"""INT4 weight-only linear layers (torch int4pack, 16-bit activations) and the non-finite guard.

torch's int4pack dequantizes a group as w = (q - 8) * scale + zero. A GGUF Q4_1 block stores
w = q * d + m for 32 weights, so scale = d and zero = m + 8 d: the remap is exact at group 32.
With bf16 activations (int4 at group 32), on CPUs with AVX-512 or AVX2 the int4 and int8 layers
run the native kernels of model_runtime/kernels (faster; within one bf16 rounding of torch's
int4pack and int8pack kernels, the same bits on every CPU: kernels/qmm.py); else torch's. A
layer keeps the build it was made with (`isa`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime.kernels import isas, qmm

NATIVE_BLOCK = 64  # output columns per block of the native layout (kernels/qmm.c)
_SHIFTS = torch.tensor([[0, 16], [4, 20], [8, 24], [12, 28]], dtype=torch.int32)  # [j, k % 2]


def _pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """(packed codes, scales and zeros, the native build or None) for torch's int4pack kernel or
    the native one (the same layout for every build)."""
    n, k = codes.shape
    group = k // scale.shape[1]
    if dtype == torch.bfloat16 and group == 32 and n % NATIVE_BLOCK == 0 and qmm.applies():
        # kernels/qmm.c's layout: [block, k / 8, panel, column] 32-bit lanes holding k + 2 j in
        # bits 4 j and k + 2 j + 1 in bits 16 + 4 j (j < 4), as bytes [block, k / 2, 64]; then
        # [block, group, scale | zero, column] bf16
        c = codes.to(torch.int32).view(n // NATIVE_BLOCK, 4, 16, k // 8, 4, 2)
        # the shifted codes' bits do not overlap: their sum is their OR
        lanes = (c << _SHIFTS).sum(dim=(-2, -1), dtype=torch.int32).permute(0, 3, 1, 2)
        packed = lanes.contiguous().view(torch.uint8).view(n // NATIVE_BLOCK, k // 2, NATIVE_BLOCK)
        sz = torch.stack([scale.to(dtype), zero.to(dtype)])  # [2, n, groups]
        sz = sz.view(2, n // NATIVE_BLOCK, NATIVE_BLOCK, -1).permute(1, 3, 0, 2).contiguous()
        return packed, sz, isas.isa()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, sz, None


def native_codes(packed: torch.Tensor) -> torch.Tensor:
    """The native int4 layout's codes (_pack) as uint8 [N, K]."""
    blocks, halves, _ = packed.shape
    lanes = packed.view(torch.int32).view(blocks, halves // 4, 4, 16, 1, 1)
    c = (lanes >> _SHIFTS) & 15  # [block, k / 8, panel, column, j, k % 2]
    return c.permute(0, 2, 3, 1, 4, 5).reshape(blocks * NATIVE_BLOCK, halves * 2).to(torch.uint8)


def pack_q8(packed: torch.Tensor) -> torch.Tensor:
    """The native int4 layout's codes in kernels/q8.c's layout for int8 activations:
    [N / 16, K / 8, 16, 4] bytes, byte j of lane c holding column c's codes at k0 + j (low
    nibble) and k0 + 4 + j (high)."""
    codes = native_codes(packed)
    n, k = codes.shape
    # [panel, chunk, lane, j, half]
    codes = codes.view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous()


def pack_head_q8(q: torch.Tensor) -> torch.Tensor:
    """Int8Linear's weights [N, K] in kernels/q8.c's head layout for int8 activations:
    [N / 16, K / 4, 16, 4] bytes, weight + 128 (unsigned)."""
    n, k = q.shape
    u8 = (q.to(torch.int16) + 128).to(torch.uint8)
    return u8.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


@dataclass
class Q4_1:
    """One Q4_1 matrix [n, k]: codes 0..15 and per-32-block d, m with w = q * d + m."""

    codes: torch.Tensor  # int32 [n, k]
    d: torch.Tensor  # float32 [n, k // 32]
    m: torch.Tensor  # float32 [n, k // 32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // 32, 32).float()
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)


class Int4Linear(nn.Module):
    """y = x @ W.T with W held as 4-bit codes plus a (scale, zero) per group of `group_size`."""

    def __init__(
        self, packed, scales_zeros, out_features, in_features, group_size, dense=None, isa=None
    ):
        super().__init__()
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size
        self.isa = isa  # the native build ("avx512" | "avx2") or None: torch's kernel
        self.native = isa is not None  # packed/scales_zeros in the native kernel's layout
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        # int8 activations (use_int8_activations): the codes in kernels/q8.c's layout
        self.register_buffer("codes8", None)
        self.vnni = False
        # a dense copy is kept only for the non-finite guard (keep_dense=True)
        self.register_buffer("dense", dense)
        self.use_dense = False

    @classmethod
    def from_q4_1(cls, q: Q4_1, dtype=torch.bfloat16, keep_dense: bool = False) -> Int4Linear:
        n, k = q.codes.shape
        packed, sz, isa = _pack(q.codes, q.d, q.m + 8 * q.d, dtype)
        dense = q.dequantize().to(dtype) if keep_dense else None
        return cls(packed, sz, n, k, 32, dense, isa)

    @classmethod
    def from_dense(
        cls, w: torch.Tensor, group_size: int = 32, dtype=torch.bfloat16, keep_dense: bool = False
    ) -> Int4Linear:
        """Re-quantize dense weights [n, k], asymmetric min/max per group (like Q4_1)."""
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
        g = w.float().reshape(n, k // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).reshape(n, k)
        packed, sz, isa = _pack(codes, scale, lo + 8 * scale, dtype)
        dense = w.to(dtype) if keep_dense else None
        return cls(packed, sz, n, k, group_size, dense, isa)

    def dequantize(self) -> torch.Tensor:
        """The weights as the kernel sees them, [out, in] (via an identity matmul)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return self._mm(eye).T.contiguous()

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.native:
            lib = qmm.library(self.isa)
            return _native_mm(lib.int4mm_bf16, x2, self.packed, self.scales_zeros, self)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_zeros
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_dense:
            w = self.dense if self.dense is not None else self.dequantize()
            return F.linear(x.float(), w.float()).to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.codes8 is not None:
            lib = qmm.library(self.isa)
            y = _native_mm(lib.int4mm_q8, x2, self.codes8, self.scales_zeros, self, self.vnni)
        else:
            y = self._mm(x2)
        return y.view(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        codes8 = 0 if self.codes8 is None else self.codes8.numel()
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scales_zeros.numel() * 2
            + codes8
        )

    def extra_repr(self) -> str:
        kernel = f"native {self.isa}" if self.native else "torch"
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}, {kernel}"


def _native_mm(fn, x2: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, lin, *more):
    """y = fn(x2, weights, scales, *more) of kernels/qmm.c for a [rows, in] bf16 input."""
    x2 = x2.contiguous()
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"the native kernels take bf16 activations, got {x2.dtype}")
    m = x2.shape[0]
    y = torch.empty(m, lin.out_features, dtype=torch.bfloat16)
    if m:
        k, n = lin.in_features, lin.out_features
        rc = fn(
            x2.data_ptr(), m, k, weights.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
            torch.get_num_threads(), *more,
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"native kernel refused shapes {tuple(x2.shape)} x {lin}")
    return y


class Int8Linear(nn.Module):
    """Weight-only int8, one scale per output channel (torch's int8pack CPU kernel).

    Used for the tied output head under int4: re-quantizing the head (stored Q8_0 in the GGUF)
    to int4 costs perplexity that int8 keeps (BENCHMARKS.md, quality), and int8 is faster.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dense=None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        # the native kernel reads the same buffers as torch's (kernels/qmm.c)
        native = (
            scales.dtype == torch.bfloat16
            and self.out_features % NATIVE_BLOCK == 0
            and self.in_features % 32 == 0  # kernels/qmm.c: chunks of 32
            and qmm.applies()
        )
        self.isa = isas.isa() if native else None  # the native build or None: torch's
        self.native = native
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        self.register_buffer("head8", None)  # int8 activations: q in kernels/q8.c's layout
        self.vnni = False
        self.register_buffer("dense", dense)
        self.use_dense = False

    @classmethod
    def from_dense(cls, w: torch.Tensor, dtype=torch.bfloat16, keep_dense: bool = False):
        wf = w.float()
        scale = wf.abs().amax(1).clamp(min=1e-12) / 127
        q = (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale.to(dtype), w.to(dtype) if keep_dense else None)

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_dense:
            w = self.dense if self.dense is not None else self.dequantize()
            return F.linear(x.float(), w.float()).to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.head8 is not None:
            lib = qmm.library(self.isa)
            y = _native_mm(lib.int8mm_q8, x2, self.head8, self.scales, self, self.vnni)
        elif self.native:
            y = _native_mm(qmm.library(self.isa).int8mm_bf16, x2, self.q, self.scales, self)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scales)
        return y.view(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        head8 = 0 if self.head8 is None else self.head8.numel()
        return self.q.numel() + self.scales.numel() * 2 + head8


class TiedInt8Embedding(nn.Module):
    """Token embeddings read from the int8 output head they are tied to (no second copy)."""

    def __init__(self, head: Int8Linear):
        super().__init__()
        self.head = [head]  # a list: not registered twice as a submodule
        self.embedding_dim = head.in_features

    @property
    def weight(self) -> torch.Tensor:  # dtype/device probes only
        return self.head[0].scales

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.head[0]
        return h.q[tokens].to(h.scales.dtype) * h.scales[tokens].unsqueeze(-1)


def use_int8_activations(model: nn.Module) -> None:
    """Every native Int4Linear and Int8Linear of `model` takes int8 activations from now on
    (kernels/q8.c: a second copy of its weights in that kernel's layout). Raises ValueError
    where a quantized layer is not on the native kernels."""
    for mod in model.modules():
        if isinstance(mod, Int4Linear | Int8Linear):
            if not mod.native or mod.in_features % 32:
                raise ValueError(f"int8 activations need native layers of groups of 32: {mod}")
            mod.vnni = isas.has_vnni(mod.isa)
            if isinstance(mod, Int4Linear):
                mod.codes8 = pack_q8(mod.packed)
            else:
                mod.head8 = pack_head_q8(mod.q)


def quantize_dense_linears(model: nn.Module, group_size: int, keep_dense: bool = False) -> None:
    """Replace every nn.Linear (output head included) by an Int4Linear re-quantized from it."""
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                q = Int4Linear.from_dense(child.weight.data, group_size, keep_dense=keep_dense)
                setattr(mod, child_name, q)


@contextlib.contextmanager
def dense_mode(block: nn.Module) -> Iterator[None]:
    lins = [m for m in block.modules() if isinstance(m, Int4Linear | Int8Linear)]
    for m in lins:
        m.use_dense = True
    try:
        yield
    finally:
        for m in lins:
            m.use_dense = False


class NonFiniteGuard:
    """Checks each layer's output; on inf/nan recomputes that layer densely (float32) and counts."""

    def __init__(self) -> None:
        self.fallbacks = 0
        self.unrecovered = 0

    def __call__(
        self, i: int, block: nn.Module, h_in: torch.Tensor, out: torch.Tensor, recompute: Callable
    ) -> torch.Tensor:
        if bool(torch.isfinite(out).all()):
            return out
        self.fallbacks += 1
        with dense_mode(block):
            out = recompute()
        if not bool(torch.isfinite(out).all()):
            self.unrecovered += 1
            raise FloatingPointError(f"non-finite activations in layer {i} (dense path too)")
        return out
