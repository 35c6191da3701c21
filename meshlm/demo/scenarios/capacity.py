"""How fast a replica decodes with its batch slots full, measured before a scenario floods it:
CPUs differ several-fold, so a load fixed in calls per second floods one machine and idles
another."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

STORY_PROMPTS = tuple(
    f"Write a long story about {x}." for x in ("a dragon", "the sea", "a robot", "a city")
)


def decode_capacity(target: str, slots: int, tokens: int = 48) -> float:
    """Tokens/s the runtime at `target` (host:port, straight to it: no tenant's rate limit)
    decodes with `slots` stories at once, after one that warms it; wall time of the batch."""
    from model_runtime.serving.client import generate

    def story(n: int) -> int:
        chat = [{"role": "user", "content": STORY_PROMPTS[n % len(STORY_PROMPTS)]}]
        chunks = generate(target, messages=chat, max_new_tokens=tokens, timeout=120, mirror=False)
        return sum(len(c.token_ids) for c in chunks)

    story(0)
    with ThreadPoolExecutor(slots) as pool:
        t0 = time.monotonic()
        n = sum(pool.map(story, range(slots)))
        return n / (time.monotonic() - t0)


def flood_tokens(capacity: float, rate: float, load: float, bounds: tuple[int, int]) -> int:
    """Tokens per call for calls at `rate` per second to ask `load` times `capacity`, within
    `bounds`."""
    return min(max(round(load * capacity / rate), bounds[0]), bounds[1])
