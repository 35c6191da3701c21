"""Paged KV cache bookkeeping: a pool of fixed-size blocks shared by all sequences.

Full blocks are keyed by a hash chain over their tokens (hash of the previous block's key and
this block's token ids), so a sequence whose prompt starts with the same tokens (a repeated
system prompt) reuses the cached blocks and skips their prefill. Blocks are reference counted;
an unreferenced block that holds a hashed prefix stays cached until the pool needs it (LRU).
The tensors themselves live in `model.KVCache`; this module hands out slot indices.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from model_runtime.llm.model import BatchLayout, MixedLayout


def block_keys(token_ids: list[int], block_size: int) -> list[bytes]:
    """The hash-chain key of every full block of `token_ids`."""
    keys, prev = [], b""
    arr = np.asarray(token_ids, dtype=np.int64)
    for i in range(len(token_ids) // block_size):
        prev = hashlib.blake2b(
            prev + arr[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16
        ).digest()
        keys.append(prev)
    return keys


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError("kv_blocks and block_size must be positive")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks - 1, -1, -1))
        self._ref = [0] * n_blocks
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks

    def available(self) -> int:
        return len(self._free) + len(self._lru)

    def used(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.n_blocks - self.available()

    def unreferenced(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the LRU (acquiring them takes them out of `available`)."""
        return sum(1 for b in blocks if b in self._lru)

    def cached(self) -> int:
        return len(self._lru)

    def match_prefix(self, keys: list[bytes]) -> list[int]:
        """Cached blocks for the longest run of leading keys (not yet referenced)."""
        out = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] == 0:
                self._lru.pop(b, None)
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.available():
            raise MemoryError(f"KV pool: need {n} blocks, {self.available()} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)  # evict the least recently used prefix
                del self._by_key[self._key_of.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    def register(self, block: int, key: bytes) -> None:
        """Mark a full, written block as holding the prefix `key` (first writer wins)."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)


@dataclass
class SeqCache:
    """One sequence's block table and how many of its tokens have K/V written."""

    blocks: list[int] = field(default_factory=list)
    written: int = 0
    registered: int = 0  # leading full blocks already registered in the pool

    def slots(self, start: int, end: int, block_size: int) -> torch.Tensor:
        return torch.from_numpy(self.slots_np(start, end, block_size))

    def slots_np(self, start: int, end: int, block_size: int) -> np.ndarray:
        pos = np.arange(start, end)
        return np.asarray(self.blocks, dtype=np.int64)[pos // block_size] * block_size + (
            pos % block_size
        )


def _run(gather: np.ndarray, valid: np.ndarray) -> tuple[int, int] | None:
    """(start, stride) when row b attends slots start + b * stride + [0, lens[b]) (`valid`: the
    attended entries of `gather`): the model then reads the cache as one strided view instead of
    gathering it per layer."""
    start = gather[:, 0]
    stride = int(start[1] - start[0]) if len(start) > 1 else 0
    if stride < 0 or (np.diff(start) != stride).any():
        return None
    offs = np.arange(gather.shape[1])
    if not (np.where(valid, gather - start[:, None], offs) == offs).all():
        return None
    return int(start[0]), stride


@functools.lru_cache(maxsize=256)
def _offsets(length: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions [0, length), their block index and their offset in the block (read-only)."""
    offs = np.arange(length)
    out = (offs, offs // block_size, offs % block_size)
    for a in out:
        a.flags.writeable = False
    return out


def layout_prefill(seq: SeqCache, start: int, n: int, block_size: int) -> BatchLayout:
    """One sequence, tokens [start, start + n) are new; attends [0, start + n)."""
    all_slots = seq.slots_np(0, start + n, block_size)
    q = torch.arange(start, start + n)[:, None]
    mask = (torch.arange(start + n)[None, :] <= q).view(1, 1, n, start + n)
    gather = torch.from_numpy(all_slots).view(1, -1)
    return BatchLayout(
        input_pos=torch.arange(start, start + n).view(1, n),
        write_slots=gather[0, start:],
        gather_slots=gather,
        mask=mask,
        kv_run=_run(all_slots[None, :], np.ones((1, start + n), dtype=bool)),
    )


def layout_decode(seqs: list[SeqCache], block_size: int) -> BatchLayout:
    """Each sequence adds one token at position `written`; attends [0, written + 1)."""
    B = len(seqs)
    lens = np.array([s.written + 1 for s in seqs], dtype=np.int64)
    # padded up to a multiple of 16: SDPA's CPU kernel rounds a row the same for every padded
    # length from there on, so a row decodes to the same logits alone, batched beside a longer
    # sequence, or beside its own speculative drafts (which lengthen the batch)
    longest = -(-int(lens.max()) // 16) * 16
    offs, block_of, within = _offsets(longest, block_size)
    table = np.zeros((B, -(-longest // block_size)), dtype=np.int64)
    for i, s in enumerate(seqs):
        n = -(-(s.written + 1) // block_size)
        table[i, :n] = s.blocks[:n]
    # one vectorized pass, not a slot list per sequence: built per sequence in Python, the
    # layout was a visible share of a native decode step
    valid = offs < lens[:, None]
    gather = np.where(valid, table[:, block_of] * block_size + within, 0)
    return BatchLayout(
        input_pos=torch.from_numpy(lens - 1).view(-1, 1),
        write_slots=torch.from_numpy(gather[np.arange(B), lens - 1]),
        gather_slots=torch.from_numpy(gather),
        # always masked, even when no slot is padding: the same SDPA kernel runs whatever the
        # batch, so a sequence decodes to the same tokens alone or batched
        mask=torch.from_numpy(valid).view(B, 1, 1, longest),
        kv_run=_run(gather, valid),
    )


def layout_mixed(
    decode: list[SeqCache], prefill: SeqCache, start: int, n: int, block_size: int
) -> MixedLayout:
    """Decode rows of `decode` (as layout_decode) then `prefill`'s tokens [start, start + n)."""
    return MixedLayout(
        layout_decode(decode, block_size), layout_prefill(prefill, start, n, block_size)
    )
