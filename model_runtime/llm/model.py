"""Llama-family transformer (RMSNorm, pairwise RoPE, GQA attention via SDPA, SwiGLU).

One forward serves prefill and decode for a batch of sequences over a paged KV cache: the caller
(`BatchLayout`, built by engine/kvcache.py) says where each new token's K/V go (`write_slots`) and
which cache slots each sequence attends (`gather_slots` + `mask`). Without a layout the forward is
plain causal attention over the given tokens (perplexity, tests). q/k weights use the interleaved
(GGUF) layout, so RoPE rotates adjacent pairs; safetensors checkpoints are permuted at load. The
model runs in torch ops alone: its accelerators (a decode step in one native call or CUDA graphs,
native attention) are attached from outside (llm/accelerators.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    hidden_dim: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    context_length: int = 2048

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class BatchLayout:
    """Where a forward step reads and writes the paged KV cache (see engine/kvcache.py)."""

    input_pos: torch.Tensor  # int64 [B, T] absolute positions of the new tokens
    write_slots: torch.Tensor  # int64 [B * T] cache slot of every new token
    gather_slots: torch.Tensor  # int64 [B, L] cache slots each sequence attends (padded)
    mask: torch.Tensor | None  # bool [B, 1, T, L], None when every slot is valid and causal
    last_idx: torch.Tensor | None = None  # int64 [B] which of the T positions gets logits
    # (start, stride): row b's gather_slots are start + b * stride + [0, L) where unmasked, so
    # attention reads a strided view of the cache instead of gathering it (None: gather)
    kv_run: tuple[int, int] | None = None

    def to(self, device) -> BatchLayout:
        if torch.device(device).type == "cpu":
            return self
        moved = {
            k: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
            for k, t in vars(self).items()
        }
        return BatchLayout(**moved)


@dataclass
class MixedLayout:
    """One forward over running streams' decode rows and one prompt's prefill chunk: the tokens
    are [1, D + n], the first D one new token each of D sequences (`decode`, a decode layout),
    the last n one sequence's chunk (`prefill`, a prefill layout). Linear layers see every row
    at once; each part attends as it would alone, so a row gets the bits it gets unmixed."""

    decode: BatchLayout
    prefill: BatchLayout

    @property
    def input_pos(self) -> torch.Tensor:
        return torch.cat([self.decode.input_pos.view(1, -1), self.prefill.input_pos.view(1, -1)], 1)

    @property
    def write_slots(self) -> torch.Tensor:
        return torch.cat([self.decode.write_slots, self.prefill.write_slots])

    @property
    def rows(self) -> int:
        return self.decode.input_pos.shape[0]

    def to(self, device) -> MixedLayout:
        return MixedLayout(self.decode.to(device), self.prefill.to(device))


def _additive(mask: torch.Tensor | None, dtype, device) -> torch.Tensor | None:
    # additive, once a forward: SDPA converts a bool mask per call
    if mask is None:
        return None
    out = torch.zeros(mask.shape, dtype=dtype, device=device)
    return out.masked_fill_(mask.logical_not(), float("-inf"))


class KVCache(nn.Module):
    """K and V for every layer, indexed by slot (block * block_size + offset)."""

    def __init__(self, args: ModelArgs, n_slots: int, dtype: torch.dtype, device="cpu"):
        super().__init__()
        # K and V side by side per slot: one gather and one scatter per layer and step
        shape = (args.n_layers, n_slots, 2, args.n_kv_heads, args.head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


def all_finite(t: torch.Tensor) -> bool:
    """No inf or NaN in `t`, by one sum (an inf or NaN makes it non-finite) instead of a bool
    tensor as large as `t`. The sum is float32: hidden states reach values whose fp16 sum
    overflows on an ordinary prefill, and each false alarm would run the forward again layer by
    layer. Finite values whose float32 sum overflowed would still read as non-finite: a needless
    recompute, never a missed one."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32)))


def rope_table(args: ModelArgs) -> torch.Tensor:
    """complex64 [context_length, head_dim // 2]."""
    hd = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    t = torch.arange(args.context_length, dtype=torch.float32)
    return torch.polar(torch.ones(args.context_length, hd // 2), torch.outer(t, freqs))


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, hd]; freqs [B, T, 1, hd/2]; adjacent pairs (x0, x1) rotate together. Complex,
    # not real (cos, sin) arithmetic: as fast in eager mode, and real arithmetic rounds
    # differently (the perplexity moves)
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs).flatten(-2)


def _attended(kv: torch.Tensor, lay: BatchLayout, B: int) -> torch.Tensor:
    """[B, L, 2, n_kv, hd]: the cache slots each row attends, a view where they are a run."""
    L = lay.gather_slots.shape[1]
    run = lay.kv_run
    if run is not None and run[0] + (B - 1) * run[1] + L <= kv.shape[0]:
        s = kv.stride(0)
        return kv.as_strided(
            (B, L, *kv.shape[1:]), (run[1] * s, *kv.stride()), kv.storage_offset() + run[0] * s
        )
    return kv.index_select(0, lay.gather_slots.view(-1)).view(B, L, *kv.shape[1:])


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hd = args.head_dim
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, hd
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)

    def forward(
        self, x, rope, layer: int, cache: KVCache | None, lay: BatchLayout | None, mask, native=None
    ):
        """`native`: attention over the cache in one call (decode steps, prefill chunks),
        (qkv, cache.kv, layer, lay) -> output or None where it does not apply; or None."""
        B, T, _ = x.shape
        nq = self.n_heads + self.n_kv
        qkv = self.wqkv(x).view(B, T, nq + self.n_kv, self.hd)
        qk = qkv[:, :, :nq]
        qk.copy_(apply_rope(qk, rope))
        if cache is None or lay is None:
            q = qkv[:, :, : self.n_heads].transpose(1, 2)
            k, v = qkv[:, :, self.n_heads : nq], qkv[:, :, nq:]
            y = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), is_causal=T > 1, enable_gqa=True
            )
            y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd)
        else:
            kv = cache.kv[layer]  # K and V of the new tokens sit side by side in qkv already
            kv.index_copy_(
                0, lay.write_slots, qkv[:, :, self.n_heads :].reshape(B * T, 2, -1, self.hd)
            )
            if isinstance(lay, MixedLayout):
                D = lay.rows
                dec = qkv[0, :D].unsqueeze(1).contiguous()
                pre = qkv[:, D:].contiguous()
                y = torch.cat(
                    [
                        self._attend(dec, cache, layer, lay.decode, mask[0], native).view(D, -1),
                        self._attend(pre, cache, layer, lay.prefill, mask[1], native)[0],
                    ]
                )
                return self.wo(y.unsqueeze(0))
            y = self._attend(qkv, cache, layer, lay, mask, native)
        return self.wo(y)

    def _attend(self, qkv, cache: KVCache, layer: int, lay: BatchLayout, mask, native):
        """Attention of qkv [B, T, ...] (K/V already in the cache) -> [B, T, n_heads * hd]."""
        B, T = qkv.shape[:2]
        if native is not None:
            y = native(qkv, cache.kv, layer, lay)
            if y is not None:
                return y
        g = _attended(cache.kv[layer], lay, B)
        y = F.scaled_dot_product_attention(
            qkv[:, :, : self.n_heads].transpose(1, 2),
            g[:, :, 0].transpose(1, 2),
            g[:, :, 1].transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )
        return y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.hidden_dim
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.eps = args.norm_eps
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.Parameter(torch.ones(args.dim), requires_grad=False)
        self.ffn_norm = nn.Parameter(torch.ones(args.dim), requires_grad=False)

    def forward(self, x, rope, layer, cache, lay, mask, native=None):
        h = x + self.attention(
            F.rms_norm(x, x.shape[-1:], self.attention_norm, self.eps),
            rope,
            layer,
            cache,
            lay,
            mask,
            native,
        )
        return h.add_(self.feed_forward(F.rms_norm(h, h.shape[-1:], self.ffn_norm, self.eps)))


# guard(layer_index, block, block_input, block_output, recompute) -> output to use
LayerGuard = Callable[[int, nn.Module, torch.Tensor, torch.Tensor, Callable], torch.Tensor]
# accelerate(model, "native_step" | "native_attention"): sets that attribute of the model
Accelerate = Callable[["Transformer", str], None]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.Parameter(torch.ones(args.dim), requires_grad=False)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs", rope_table(args), persistent=False)
        self.guard: LayerGuard | None = None
        # a whole decode step in one call, (tokens, cache, layout) -> (logits, finite) or None
        # where it does not apply: "auto" until the first decode step asks `accelerate`
        self.native_step: Callable | str | None = "auto"
        # attention alone, for prefill chunks and decode steps the step does not take (the
        # `native` of Attention.forward): "auto" alike
        self.native_attention: Callable | str | None = "auto"
        # what resolves an "auto" above (the loader attaches one); None: torch ops
        self.accelerate: Accelerate | None = None
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def _layers(
        self, h, rope, cache, lay, mask, guard: LayerGuard | None, native=None
    ) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            out = layer(h, rope, i, cache, lay, mask, native)
            if guard is not None:
                redo = functools.partial(layer, h, rope, i, cache, lay, mask, native)
                out = guard(i, layer, h, out, redo)
            h = out
        return h

    def resolve(self, name: str) -> None:
        """Replace the "auto" of `name` ("native_step" | "native_attention") by what
        `accelerate` chooses, or by None (torch ops) where nothing is attached."""
        if self.accelerate is None:
            setattr(self, name, None)
        else:
            self.accelerate(self, name)

    def decodes_natively(self) -> bool:
        """Whether decode steps run in one native call (or a CUDA graph) rather than in this
        module's ops: such a step has its own arithmetic, so decode rows mixed into a torch
        forward would not keep its bits."""
        if self.native_step == "auto":
            self.resolve("native_step")
        return self.native_step is not None

    def _native_decode(self, tokens, cache: KVCache, lay: BatchLayout) -> torch.Tensor | None:
        if self.native_step == "auto":
            self.resolve("native_step")
        if self.native_step is None or lay.last_idx is not None:
            return None
        out = self.native_step(tokens, cache, lay)
        if out is None:
            return None
        logits, finite = out
        if not finite and self.guard is not None:
            return None  # the torch path redoes the step (same KV slots) and the guard repairs it
        return logits

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        lay: BatchLayout | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """tokens [B, T] -> logits float32 [B, T, V] (all_logits) or [B, V] (last position)."""
        T = tokens.shape[1]
        native = None
        if lay is not None and cache is not None:
            if T == 1 and not all_logits:
                logits = self._native_decode(tokens, cache, lay)
                if logits is not None:
                    return logits
            if self.native_attention == "auto":
                self.resolve("native_attention")
            native = self.native_attention
        return self.ops_forward(tokens, cache, lay, all_logits, native, self.guard)

    def ops_forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None,
        lay: BatchLayout | None,
        all_logits: bool,
        native: Callable | None,
        guard: LayerGuard | None,
    ) -> torch.Tensor:
        """`forward` in torch ops (native attention where `native` is given), without the
        native or graph-replayed decode step; guard None checks nothing (no host sync: a CUDA
        graph captures this)."""
        B, T = tokens.shape
        rope = (
            self.freqs[:T].unsqueeze(0) if lay is None else self.freqs[lay.input_pos]
        ).unsqueeze(2)
        mask = None
        if isinstance(lay, MixedLayout):
            mask = tuple(
                _additive(p.mask, self.dtype, self.device) for p in (lay.decode, lay.prefill)
            )
        elif lay is not None:
            mask = _additive(lay.mask, self.dtype, self.device)
        h0 = self.tok_embeddings(tokens)
        h = self._layers(h0, rope, cache, lay, mask, None, native)
        if guard is not None and not all_finite(h):
            # rare: run again checking every layer, so the guard can repair the one at fault
            # (the re-run rewrites the same KV slots)
            h = self._layers(h0, rope, cache, lay, mask, guard, native)
        if isinstance(lay, MixedLayout):  # every decode row and the chunk's last token
            h = h[0, [*range(lay.rows), T - 1]]
        elif not all_logits:
            if lay is not None and lay.last_idx is not None:
                h = h[torch.arange(B), lay.last_idx]
            else:
                h = h[:, -1]
        return self.output(F.rms_norm(h, h.shape[-1:], self.norm, self.args.norm_eps)).float()
