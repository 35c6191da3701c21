"""Runtime fault injection, for rehearsing rollbacks: a canary that fails or slows down on purpose.

`meshlm serve --fault-error-percent P` answers UNAVAILABLE to about P % of Generate calls;
`--fault-stall-after N [--fault-stall-ms MS]` holds a stream's delivery for MS ms after every
Nth token it sent (without MS: until the call is cancelled or expires) while the engine keeps
decoding every stream; `--fault-exit-after N` kills the process (os._exit, no drain) once a
stream has sent N tokens: a replica that stalls or dies mid-stream, which callers resume.
`--fault-delay-ms D` holds back the first token of every stream by D ms;
`--fault-slow-decode F` makes every decode step take about F times as long (the engine sleeps
the step's own duration x (F - 1)), a replica that decodes slowly for load-aware routing. All
count as real failures and latency in the runtime's metrics, exactly as the mesh and the rollout
gates see them.
`--fault-poison REGEX [--fault-poison-action exit|stall|error]`: a Generate call whose prompt or
any message content matches is a query of death: the runtime exits hard (default),
never answers that call, or fails it with INTERNAL.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NoReturn

log = logging.getLogger(__name__)
EXIT_CODE = 70  # --fault-exit-after: EX_SOFTWARE, so a supervisor sees a crash, not a clean stop
POISON_ACTIONS = ("exit", "stall", "error")
_EXIT_FLUSH_S = 0.2  # lets the Nth token's chunk leave the socket before the process dies


@dataclass
class Faults:
    error_percent: float = 0.0
    delay_ms: float = 0.0
    seed: int | None = None
    slow_decode: float = 1.0
    stall_after: int = 0  # stall after every Nth token of a stream (0 = off)
    stall_ms: float | None = None  # the stall's length; None = until the call ends
    exit_after: int = 0  # exit hard once a stream has sent this many tokens (0 = off)
    poison: str | None = None  # a regex: a request whose text matches is a query of death
    poison_action: str = "exit"  # exit | stall | error
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _poison: re.Pattern[str] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_percent <= 100.0:
            raise ValueError(f"fault error percent {self.error_percent} is outside [0, 100]")
        if self.delay_ms < 0:
            raise ValueError(f"fault delay {self.delay_ms} ms is negative")
        if not 1.0 <= self.slow_decode <= 100.0:
            raise ValueError(f"fault slow-decode factor {self.slow_decode} is outside [1, 100]")
        if self.stall_after < 0 or self.exit_after < 0:
            raise ValueError("fault stall-after and exit-after token counts must be >= 0")
        if self.stall_ms is not None and not (self.stall_after and 0 <= self.stall_ms < math.inf):
            raise ValueError(
                f"fault stall of {self.stall_ms} ms needs a stall-after count and a finite "
                "length >= 0"
            )
        if self.poison_action not in POISON_ACTIONS:
            raise ValueError(
                f"fault poison action {self.poison_action!r}: expected one of "
                f"{', '.join(POISON_ACTIONS)}"
            )
        try:
            self._poison = re.compile(self.poison) if self.poison else None
        except re.error as e:
            raise ValueError(f"fault poison: not a regular expression: {e}") from None
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return (
            self.stall_after > 0
            or self.exit_after > 0
            or self.error_percent > 0
            or self.delay_ms > 0
            or self.slow_decode > 1.0
            or self._poison is not None
        )

    def poisoned(self, texts: Iterable[str]) -> bool:
        """Whether any of a request's texts (prompt, message contents) matches --fault-poison."""
        return self._poison is not None and any(self._poison.search(t) for t in texts if t)

    def should_fail(self) -> bool:
        if self.error_percent <= 0:
            return False
        with self._lock:
            return self._rng.random() * 100.0 < self.error_percent

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0

    def stall_s(self, sent_before: int, sent: int) -> float | None:
        """How long a stream holds its next chunk once its sent tokens went from `sent_before`
        to `sent`: None = no stall (no multiple of stall_after crossed), math.inf = forever."""
        n = self.stall_after
        if n <= 0 or sent // n == sent_before // n:
            return None
        return math.inf if self.stall_ms is None else self.stall_ms / 1000.0

    def exit_due(self, sent: int) -> bool:
        return 0 < self.exit_after <= sent

    def exit_hard(self, sent: int) -> NoReturn:
        log.warning(
            "fault injected (--fault-exit-after %d): a stream sent %d tokens; exiting hard",
            self.exit_after,
            sent,
        )
        time.sleep(_EXIT_FLUSH_S)
        os._exit(EXIT_CODE)

    def poison_exit(self) -> NoReturn:
        log.warning("fault injected (--fault-poison): a request matched; exiting hard")
        os._exit(EXIT_CODE)
