"""Runtime fault injection, for rehearsing rollbacks: a canary that fails or slows down on purpose.

`meshlm serve --fault-error-percent P` answers UNAVAILABLE to about P % of Generate calls;
`--fault-delay-ms D` holds back the first token of every stream by D ms. Both count as real
failures and latency in the runtime's metrics, exactly as the mesh and the rollout gates see them.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field


@dataclass
class Faults:
    error_percent: float = 0.0
    delay_ms: float = 0.0
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_percent <= 100.0:
            raise ValueError(f"fault error percent {self.error_percent} is outside [0, 100]")
        if self.delay_ms < 0:
            raise ValueError(f"fault delay {self.delay_ms} ms is negative")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return self.error_percent > 0 or self.delay_ms > 0

    def should_fail(self) -> bool:
        if self.error_percent <= 0:
            return False
        with self._lock:
            return self._rng.random() * 100.0 < self.error_percent

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0
