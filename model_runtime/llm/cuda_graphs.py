"""Decode steps on a CUDA device, replayed from CUDA graphs.

An eager decode step of a small model launches hundreds of kernels from Python, each too short
to keep the GPU busy: the step is bound by launching, not by the GPU (`python -m bench gpu`
measures it). A graph captured once per bucket of (batch, keys) replays them in one launch, as vLLM
does for decode. Each step's inputs are copied into the bucket's static buffers: the batch is
padded to its bucket by repeating row 0 (the padded rows write row 0's K/V into row 0's slot
again, the same values) and the keys to a multiple of KEYS (masked). A graph is captured against
the cache tensor's address and shape: valid for any cache at that address and shape, so it is
keyed by them. Off the device the same static step runs eagerly (`GraphStep.step_eager`), which
is how CPU tests check the padding.

Not claimed: bit-identical logits to the eager step. Masked keys add no weight, but the padded
attention and matmuls of another batch size may pick other GPU kernels (another order of the
same sums); greedy ids agree unless two logits tie within that rounding.
MESHLM_CUDA_GRAPHS=0 turns graphs off (eager steps).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model_runtime.llm.model import BatchLayout, KVCache, Transformer, all_finite

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a step's batch is padded up to one of these
KEYS = 256  # attended keys are padded to a multiple of this
MAX_GRAPHS = 64  # captured graphs kept (least recently used dropped)


def why_not(model: Transformer) -> str | None:
    """Why decode steps of `model` do not replay CUDA graphs, or None."""
    if os.environ.get("MESHLM_CUDA_GRAPHS", "1") == "0":
        return "MESHLM_CUDA_GRAPHS=0"
    if model.device.type != "cuda":
        return f"the model is on {model.device}, not a CUDA device"
    return None


def bucket(batch: int, keys: int) -> tuple[int, int] | None:
    """The (batch, keys) a step of `batch` rows attending `keys` slots is padded to, or None
    when the batch is larger than the largest bucket (the step runs eagerly)."""
    b = next((b for b in BATCHES if b >= batch), None)
    return None if b is None else (b, -(-keys // KEYS) * KEYS)


@dataclass
class _Bucket:
    """A padded step's static inputs (the step reads nothing else) and, once a graph is
    captured, the graph and its logits."""

    rows: torch.Tensor  # int64 [3, batch]: each row's token, position and write slot
    gather: torch.Tensor  # int64 [batch, keys]: the slots each row attends
    out: torch.Tensor | None = None
    graph: object | None = None  # torch.cuda.CUDAGraph


class GraphStep:
    """`model.native_step` on a CUDA device: (tokens [B, 1], cache, layout) -> (logits [B, V],
    finite) from a replayed graph, or None where no bucket fits."""

    def __init__(self, model: Transformer):
        self.model = model
        self.buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.captures = 0

    def _fill(self, b: _Bucket, tokens: torch.Tensor, lay: BatchLayout) -> None:
        B, L = lay.gather_slots.shape
        b.rows[0, :B] = tokens.view(-1)
        b.rows[1, :B] = lay.input_pos.view(-1)
        b.rows[2, :B] = lay.write_slots.view(-1)
        b.rows[:, B:] = b.rows[:, :1]  # padded rows repeat row 0
        b.gather[:B, :L] = lay.gather_slots
        b.gather[:B, L:] = 0  # masked: each row attends positions <= its own
        b.gather[B:] = b.gather[0]

    def _run(self, b: _Bucket, cache: KVCache) -> torch.Tensor:
        """The padded step in torch ops, reading only `b`'s inputs (what a graph captures)."""
        batch, keys = b.gather.shape
        pos = b.rows[1].view(batch, 1)
        mask = torch.arange(keys, device=pos.device).view(1, keys) <= pos
        lay = BatchLayout(
            input_pos=pos,
            write_slots=b.rows[2],
            gather_slots=b.gather,
            mask=mask.view(batch, 1, 1, keys),
        )
        return self.model.ops_forward(b.rows[0].view(batch, 1), cache, lay, False, None, None)

    def _bucket(self, cache: KVCache, size: tuple[int, int]) -> _Bucket:
        key = (cache.kv.data_ptr(), tuple(cache.kv.shape), cache.kv.dtype, size)
        b = self.buckets.get(key)
        if b is None:
            dev = self.model.device
            b = _Bucket(
                torch.zeros(3, size[0], dtype=torch.int64, device=dev),
                torch.zeros(size, dtype=torch.int64, device=dev),
            )
            self.buckets[key] = b
            while len(self.buckets) > MAX_GRAPHS:
                self.buckets.popitem(last=False)
        self.buckets.move_to_end(key)
        return b

    def _capture(self, b: _Bucket, cache: KVCache) -> None:
        # warm-up on a side stream first (lazy cuBLAS/attention set-up must not be captured);
        # it runs the real step, writing the same K/V that the replay writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(b, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            b.out = self._run(b, cache)
        b.graph = graph
        self.captures += 1

    def _prepared(self, tokens, cache: KVCache, lay: BatchLayout) -> _Bucket | None:
        """The step's bucket, its inputs filled in; None where no bucket fits."""
        size = bucket(*lay.gather_slots.shape)
        if size is None:
            return None
        b = self._bucket(cache, size)
        self._fill(b, tokens, lay)
        return b

    def step_eager(self, tokens, cache: KVCache, lay: BatchLayout):
        """The padded static step without a graph (any device): what a replay computes."""
        b = self._prepared(tokens, cache, lay)
        if b is None:
            return None
        out = self._run(b, cache)[: tokens.shape[0]]
        return out, all_finite(out)

    def __call__(self, tokens, cache: KVCache, lay: BatchLayout):
        b = self._prepared(tokens, cache, lay)
        if b is None:
            return None
        if b.graph is None:
            self._capture(b, cache)
        b.graph.replay()
        # a copy: the next replay of any graph in the shared pool may reuse `out`'s memory
        out = b.out[: tokens.shape[0]].clone()
        return out, all_finite(out)


def use(model: Transformer, on: bool) -> None:
    """Replay decode steps from CUDA graphs where they apply (on), or run them eagerly."""
    model.native_step = GraphStep(model) if on and why_not(model) is None else None
