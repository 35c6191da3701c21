"""How many prompt tokens the next step prefills beside the running streams' decode rows.

Stall-free batching: a prompt's chunk rides in the step that decodes every running stream, so the
chunk's size sets those streams' inter-token time. Each step's tokens are chosen from a budget
that keeps a step near `target_s`: the budget scales the last step's tokens by target / its time
(a step costs about a + b * tokens, and this fixed point is where it costs the target), at most
doubling or halving a step. A prompt always moves at least `min_chunk` tokens, so with decode rows
that alone take the target a step costs at most those rows plus `min_chunk` prompt tokens: the
bound on a running stream's step while a prompt is prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK = 16  # prompt tokens a step always prefills (a prompt never starves)
MAX_CHUNK = 256  # and at most (the prefill's activations)


@dataclass
class ChunkBudget:
    target_s: float
    min_chunk: int = MIN_CHUNK
    max_chunk: int = MAX_CHUNK
    tokens: float = float(MIN_CHUNK)  # the step's token budget: decode rows + chunk

    def __post_init__(self) -> None:
        if not self.target_s > 0 or not 1 <= self.min_chunk <= self.max_chunk:
            raise ValueError("need target_s > 0 and 1 <= min_chunk <= max_chunk")

    def chunk(self, decode_rows: int, left: int) -> int:
        """Prompt tokens for the next step beside `decode_rows` rows; `left` still to prefill."""
        room = int(self.tokens) - decode_rows
        return max(1, min(left, max(self.min_chunk, min(self.max_chunk, room))))

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` (decode rows + chunk) took `seconds`."""
        if tokens < 1 or seconds <= 0:
            return
        scale = min(2.0, max(0.5, self.target_s / seconds))
        self.tokens = min(float(self.max_chunk * 4), max(1.0, tokens * scale))
