"""Open-loop load: calls at a fixed rate on a thread pool, each outcome kept with its times, so a
scenario can ask what happened before, during and after a fault."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Outcome:
    start: float  # monotonic
    end: float
    status: str  # gRPC status name; "OK" on success
    detail: str = ""  # the error's details, for the report

    @property
    def latency_s(self) -> float:
        return self.end - self.start


class Load:
    """`call()` makes one request and raises grpc.RpcError on failure. Open loop: a slow
    server does not slow the sender down (up to `workers` calls in flight; beyond that a call
    is counted as CLIENT_SATURATED rather than queued, so the rate stays honest)."""

    def __init__(self, call: Callable[[], object], rate: float, *, workers: int = 32) -> None:
        self.call = call
        self.rate = rate
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._slots = threading.Semaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chaos-load")
        self._pacer = threading.Thread(target=self._pace, daemon=True)
        self.started = 0.0
        self.stopped = 0.0

    def __enter__(self) -> Load:
        self.started = time.monotonic()
        self._pacer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._pacer.join()
        self._pool.shutdown(wait=True)
        self.stopped = time.monotonic()

    def _pace(self) -> None:
        n = 0
        while not self._stop.is_set():
            t = time.monotonic()
            if self._slots.acquire(blocking=False):
                self._pool.submit(self._one, t)
            else:
                self._add(Outcome(t, t, "CLIENT_SATURATED"))
            n += 1
            self._stop.wait(max(0.0, self.started + n / self.rate - time.monotonic()))

    def _one(self, t0: float) -> None:
        status, detail = "OK", ""
        try:
            self.call()
        except grpc.RpcError as e:
            status = e.code().name if e.code() else "UNKNOWN"
            detail = str(e.details() or "")[:120]
        except Exception as e:  # a client-side bug must show up in the report, not vanish
            status, detail = f"CLIENT_{type(e).__name__}", str(e)[:120]
        finally:
            self._slots.release()
        self._add(Outcome(t0, time.monotonic(), status, detail))

    def _add(self, o: Outcome) -> None:
        with self._lock:
            self.outcomes.append(o)

    # -- views ------------------------------------------------------------------------------
    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return sorted(self.outcomes, key=lambda o: o.start)

    def between(self, t0: float, t1: float = float("inf")) -> list[Outcome]:
        return [o for o in self.snapshot() if t0 <= o.start < t1]

    def by_status(self, outcomes: list[Outcome] | None = None) -> Counter[str]:
        return Counter(o.status for o in (self.snapshot() if outcomes is None else outcomes))

    def held(self) -> str:
        dur = (self.stopped or time.monotonic()) - self.started
        return f"{self.rate:g} req/s for {dur:.0f} s"


def failures(outcomes: list[Outcome], ok: tuple[str, ...] = ("OK",)) -> list[Outcome]:
    return [o for o in outcomes if o.status not in ok]


def recovery(outcomes: list[Outcome], fault_at: float, ok: tuple[str, ...] = ("OK",)) -> float:
    """Seconds from the fault to the end of the last failed call started after it (0 when
    nothing failed)."""
    bad = [o.end for o in outcomes if o.start >= fault_at and o.status not in ok]
    return max(bad) - fault_at if bad else 0.0


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(p / 100 * len(v) + 0.5) - 1))]
