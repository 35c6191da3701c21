"""Draft tokens for speculative decoding by prompt lookup (vLLM's `ngram` method, "prompt lookup
decoding"): match the last n tokens of a sequence against its earlier text (the prompt and the
output so far) and propose the tokens that followed the latest earlier match. The engine checks
the drafts with the model in one forward and keeps only what greedy decoding would have chosen.

How many tokens to draft: each draft is one more row in the decode step's matmuls, which is not
free on a CPU (ROW_COST of a one-row step each). Draft token j pays when the chance that drafts
1..j are all accepted, q**j, beats what the row costs in units of one emitted token at this batch
size; q is each stream's running estimate.
"""

from __future__ import annotations

import math

ROW_COST = 0.28  # one more decode row / a one-row decode step (int4, 2-core CPU)
PRIOR = 0.8  # assumed acceptance of a stream's first drafts (3-gram drafts: 0.7-0.9 measured)
WEIGHT = 0.3  # how fast the estimate follows each accepted or rejected draft token
RELAX = 0.05  # steps without drafts move the estimate back toward PRIOR (so it retries)


def row_cost(batch: int) -> float:
    """One more row's cost in tokens' worth at `batch` streams (a step of `batch` rows costs
    1 + ROW_COST * (batch - 1) one-row steps and emits `batch` tokens)."""
    return ROW_COST * batch / (1 + ROW_COST * (batch - 1))


class PromptLookup:
    """One greedy stream's n-gram index (extended as the sequence grows: it only appends) and its
    draft acceptance estimate."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes: need 1 <= min {min_ngram} <= max {max_ngram}")
        self.max_n, self.min_n = max_ngram, min_ngram
        # n-gram -> the index just past its latest occurrence that has a token after it
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # occurrences ending at indexes below this are in _after
        self.acceptance = PRIOR

    def draft(self, tokens: list[int], k: int, batch: int = 1) -> list[int]:
        """Up to `k` tokens (fewer when more would not pay at `batch` streams) that followed the
        latest earlier occurrence of the longest suffix n-gram of `tokens`; [] when none."""
        end = len(tokens) - 1  # the last token has nothing after it yet: not indexed
        for e in range(max(self._indexed, self.min_n), end + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._after[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end + 1)
        k = min(k, self._worth(batch))
        if k < 1:
            return []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            e = self._after.get(tuple(tokens[-n:]))
            if e is not None:
                return tokens[e : e + k]
        return []

    def _worth(self, batch: int) -> int:
        """The most drafts j with acceptance**j above one row's cost."""
        q, cost = self.acceptance, row_cost(batch)
        if q <= cost:
            return 0
        return math.floor(math.log(cost) / math.log(q)) if q < 1 else 1 << 30

    def feedback(self, drafted: int, accepted: int) -> None:
        """After a step: `accepted` of the `drafted` tokens were the model's own choices."""
        if drafted == 0:
            self.acceptance += RELAX * (PRIOR - self.acceptance)
            return
        for _ in range(accepted):
            self.acceptance += WEIGHT * (1.0 - self.acceptance)
        if accepted < drafted:  # the first rejected draft; the ones after it were never checked
            self.acceptance -= WEIGHT * self.acceptance
