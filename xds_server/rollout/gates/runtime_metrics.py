"""The built-in latency gates' source: the canary runtimes' loopback `GET /metrics.json`. A gate
reads the TTFT/TPOT p99 of exactly its analysis interval: one `snapshot()` of each runtime's
cumulative histograms at the interval's start, one at its end, the percentile of the difference
(as Prometheus' histogram_quantile over a rate). `read()` gives the runtimes' sliding-window
p99."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from xds_server.rollout.gates.fetch import MeasurementError, get_json


@dataclass(frozen=True)
class LatencyReading:
    ttft_p99: float | None = None  # seconds; None when the window holds no samples
    tpot_p99: float | None = None
    samples: int = 0

    # what the percentiles cover: "interval" (exactly the analysis interval, from cumulative
    # histograms) or the endpoint's sliding window ("window 60s"; an endpoint without them)
    over: str = "window"


@dataclass(frozen=True)
class Histograms:
    """One runtime's cumulative TTFT/TPOT counts per bucket since it started (`instance`):
    `bounds` are the buckets' upper bounds in seconds, the last bucket is everything above."""

    instance: str
    bounds: tuple[float, ...]
    ttft: tuple[int, ...]
    tpot: tuple[int, ...]

    def since(self, before: Histograms | None) -> Histograms:
        """Counts added since `before`; everything when the runtime restarted since then."""
        if before is None or (before.instance, before.bounds) != (self.instance, self.bounds):
            return self
        return Histograms(
            self.instance,
            self.bounds,
            _minus(self.ttft, before.ttft),
            _minus(self.tpot, before.tpot),
        )


def _minus(now: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(0, a - b) for a, b in zip(now, before, strict=True))


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[int, ...]) -> float | None:
    """The q-quantile (0..1) of bucketed counts, interpolated linearly inside its bucket as
    Prometheus' histogram_quantile does; in the open last bucket, its lower bound. None when
    there are no counts."""
    n = sum(counts)
    if not n:
        return None
    rank, seen = q * n, 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i == len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / c
        seen += c
    return bounds[-1]


def parse_histograms(doc: dict[str, Any]) -> Histograms | None:
    """The runtime `/metrics.json`'s `histograms` (bounds in ms) -> Histograms, None if absent."""
    h = doc.get("histograms")
    if h is None:
        return None
    try:
        bounds = tuple(float(b) / 1e3 for b in h["bounds_ms"])
        ttft, tpot = (tuple(int(c) for c in h[k]) for k in ("ttft", "tpot"))
        instance = str(h["instance"])
    except (KeyError, TypeError, ValueError) as e:
        raise MeasurementError(f"metrics histograms unreadable: {e!r}") from e
    if not (len(ttft) == len(tpot) == len(bounds) + 1) or list(bounds) != sorted(set(bounds)):
        raise MeasurementError("metrics histograms: one count per bound and one above needed")
    return Histograms(instance, bounds, ttft, tpot)


@dataclass(frozen=True)
class LatencySnapshot:
    """What each canary endpoint's metrics said at one moment (its URL -> cumulative histograms,
    or None, with its sliding-window reading)."""

    endpoints: dict[str, tuple[Histograms | None, LatencyReading]]

    def since(self, before: LatencySnapshot) -> LatencyReading:
        """TTFT/TPOT p99 of the calls between `before` and this snapshot, per endpoint; the
        worst endpoint counts. An endpoint without histograms gives its window's reading."""
        readings = []
        for url, (hist, window) in self.endpoints.items():
            if hist is None:
                readings.append(window)
                continue
            d = hist.since(before.endpoints.get(url, (None, window))[0])
            readings.append(
                LatencyReading(
                    quantile(0.99, d.bounds, d.ttft),
                    quantile(0.99, d.bounds, d.tpot),
                    sum(d.ttft),
                    "interval",
                )
            )
        return worst_reading(readings)


class LatencySource(Protocol):
    def snapshot(self) -> LatencySnapshot: ...


def _seconds(v: Any, unit_s: float) -> float | None:
    return None if v is None else float(v) * unit_s


def parse_runtime_metrics(doc: dict[str, Any]) -> LatencyReading:
    """The runtime's `/metrics.json` -> TTFT/TPOT p99 in seconds.

    Accepts `{"ttft_ms": {"p99": ..}, "tpot_ms": {..}}` (milliseconds) or `{"ttft": {"p99": ..}}`
    (seconds); sample count from `count`/`samples` of the TTFT entry."""
    out: dict[str, float | None] = {}
    samples = 0
    for name in ("ttft", "tpot"):
        for key, unit in ((f"{name}_ms", 0.001), (f"{name}_s", 1.0), (name, 1.0)):
            entry = doc.get(key)
            if isinstance(entry, dict):
                out[name] = _seconds(entry.get("p99"), unit)
                if name == "ttft":
                    samples = int(entry.get("count", entry.get("samples", 0)) or 0)
                break
        else:
            out[name] = None
    window = doc.get("window_s")
    over = f"window {window:g}s" if isinstance(window, int | float) else "window"
    return LatencyReading(out["ttft"], out["tpot"], samples, over)


class RuntimeMetricsSource:
    """TTFT/TPOT p99 from the canary runtimes' metrics endpoints (the worst endpoint counts).
    `url` is one URL, a list, or a function asked at every read."""

    def __init__(
        self, url: str | list[str] | Callable[[], list[str]], *, timeout: float = 2.0
    ) -> None:
        if callable(url):
            self._urls = url
        else:
            fixed = [url] if isinstance(url, str) else list(url)
            self._urls = lambda: fixed
        self.timeout = timeout

    def _docs(self) -> dict[str, dict[str, Any]]:
        urls = self._urls()
        if not urls:
            raise MeasurementError("no runtime metrics endpoint is known for the canary")
        return {u: get_json(u, self.timeout) for u in urls}

    def read(self) -> LatencyReading:
        """The p99s over each endpoint's sliding window (the worst endpoint counts)."""
        return worst_reading([parse_runtime_metrics(doc) for doc in self._docs().values()])

    def snapshot(self) -> LatencySnapshot:
        """Each endpoint's cumulative histograms now (and its window reading)."""
        return LatencySnapshot(
            {u: (parse_histograms(d), parse_runtime_metrics(d)) for u, d in self._docs().items()}
        )


def worst_reading(readings: list[LatencyReading]) -> LatencyReading:
    def worst(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return max(vals) if vals else None

    return LatencyReading(
        worst([r.ttft_p99 for r in readings]),
        worst([r.tpot_p99 for r in readings]),
        sum(r.samples for r in readings),
        ", ".join(sorted({r.over for r in readings})),
    )
