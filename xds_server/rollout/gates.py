"""Measurements behind the rollout gates, and the verdict of one analysis interval.

Two real sources, each behind a one-method seam (`read()`), so the controller takes them as
constructor arguments:

- `EnvoyStatsSource`: Envoy's `grpc_stats` counters on the caller-side sidecars,
  `cluster.<cluster>.grpc.<service>.<method>.{total,success,failure,<grpc code>}`. gRPC errors are
  HTTP 200 with a `grpc-status` trailer, so 5xx counters are blind to them
  (docs/ARCHITECTURE.md). The OpenAI HTTP API (issue 17) shares the version's cluster: its
  calls are the cluster's completed upstream requests beyond the gRPC calls, its faults the
  cluster's `upstream_rq_5xx` (see `parse_http_stats`).
- `PrometheusSource`: with `gates.provider.prometheus` in the spec, the gates are PromQL queries
  to that server instead (issue 16; Flagger's and Argo's Prometheus provider), judged by
  `evaluate_metrics`: one host's loopback polling no longer bounds the mesh.
- `RuntimeMetricsSource`: the canary runtime's loopback `GET /metrics.json`. A gate reads the
  TTFT/TPOT p99 of exactly its analysis interval: one `snapshot()` of the runtime's cumulative
  histograms at the interval's start, one at its end, the percentile of the difference (as
  Prometheus' histogram_quantile over a rate). `read()` gives the runtime's sliding-window p99.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from xds_server.mesh.source_url import url_problem
from xds_server.rollout.liveness import GrpcHealthSource
from xds_server.rollout.promql import QueryError, duration, render, single_value
from xds_server.rollout.spec import Gates, PrometheusProvider, RolloutSpec


class MeasurementError(RuntimeError):
    """A source could not be read (unreachable sidecar, bad JSON)."""


class HttpStatusError(MeasurementError):
    """A source answered an HTTP error status; `body` is the start of its answer."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


# UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS: the codes a
# server answers for its own faults (grpc/doc/statuscodes.md lists which codes are server-side).
SERVER_FAULT_CODES = frozenset({"2", "4", "12", "13", "14", "15"})
# by_status keys of the OpenAI HTTP API's calls (issue 17): a 5xx is the upstream's fault.
HTTP_5XX = "http_5xx"
HTTP_OTHER = "http_other"


@dataclass(frozen=True)
class GrpcCounts:
    total: int = 0
    success: int = 0
    failure: int = 0
    by_status: dict[str, int] = field(default_factory=dict)  # grpc code number -> calls

    def __add__(self, o: GrpcCounts) -> GrpcCounts:
        codes = dict(self.by_status)
        for k, v in o.by_status.items():
            codes[k] = codes.get(k, 0) + v
        return GrpcCounts(
            self.total + o.total, self.success + o.success, self.failure + o.failure, codes
        )

    def since(self, before: GrpcCounts | None) -> GrpcCounts:
        """Counts added since `before`. A counter that went down means Envoy restarted (its
        stats start at zero), so everything now counted is new."""
        if before is None or self.total < before.total:
            return self
        codes = {k: v - before.by_status.get(k, 0) for k, v in self.by_status.items()}
        return GrpcCounts(
            self.total - before.total,
            max(0, self.success - before.success),
            max(0, self.failure - before.failure),
            {k: v for k, v in codes.items() if v > 0},
        )

    @property
    def server_faults(self) -> int:
        """Calls that failed through the upstream's fault. A denial by the authz filter
        (UNAUTHENTICATED, PERMISSION_DENIED, a tenant's RESOURCE_EXHAUSTED) or a client's bad
        argument is the right answer to a bad call, and must not roll a healthy canary back."""
        if not self.by_status:
            return self.failure
        faults = SERVER_FAULT_CODES | {HTTP_5XX}
        return sum(v for k, v in self.by_status.items() if k in faults)

    @property
    def success_rate(self) -> float | None:
        return 100.0 * (self.total - self.server_faults) / self.total if self.total else None


class GrpcCountsSource(Protocol):
    def read(self) -> dict[str, GrpcCounts]:
        """Counts per sidecar (key: its admin URL), cumulative since that Envoy started."""
        ...


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
        return _worst(readings)


class LatencySource(Protocol):
    def snapshot(self) -> LatencySnapshot: ...


def delta(before: dict[str, GrpcCounts] | None, after: dict[str, GrpcCounts]) -> GrpcCounts:
    """Sum over sidecars of what each counted between two reads (per sidecar, so one Envoy's
    restart does not spoil the others' numbers)."""
    out = GrpcCounts()
    for url, now in after.items():
        out = out + now.since((before or {}).get(url))
    return out


MAX_BODY = 4 * 2**20  # a filtered Envoy /stats or a runtime's /metrics.json is a few KB


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A source that redirects is refused: a redirect could lead to any other URL or scheme."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[override]
        raise urllib.error.HTTPError(
            req.full_url, code, f"redirect to {newurl!r} not followed", headers, fp
        )


# http and https only (no file:, ftp:, data: handlers), no proxy from the environment.
_OPENER = urllib.request.OpenerDirector()
for _h in (
    urllib.request.ProxyHandler({}),
    urllib.request.HTTPHandler(),
    urllib.request.HTTPSHandler(),
    urllib.request.HTTPDefaultErrorHandler(),
    _NoRedirect(),
    urllib.request.HTTPErrorProcessor(),
):
    _OPENER.add_handler(_h)


def _get_json(url: str, timeout: float) -> Any:
    """GET a source URL: http(s) only, no redirects, at most MAX_BODY bytes within `timeout`
    seconds in all (a slow trickle does not hold the controller)."""
    problem = url_problem(url)
    if problem:
        raise MeasurementError(f"source refused: {problem}")
    deadline = time.monotonic() + timeout
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            body = bytearray()
            while chunk := r.read(65536):
                body += chunk
                if len(body) > MAX_BODY:
                    raise MeasurementError(f"{url}: response over {MAX_BODY} bytes")
                if time.monotonic() > deadline:
                    raise MeasurementError(f"{url}: no complete response within {timeout:g}s")
        if body.startswith(b"# HELP") or body.startswith(b"# TYPE"):
            # A runtime's /metrics is Prometheus text since issue 16; its JSON moved.
            raise MeasurementError(
                f"{url}: answered Prometheus text, not JSON (a runtime's JSON is at /metrics.json)"
            )
        return json.loads(body)
    except urllib.error.HTTPError as e:  # its body says why (Prometheus: a JSON error)
        why = e.read(1000).decode("utf-8", "replace").strip() if e.fp else ""
        raise HttpStatusError(f"{url}: {e}{': ' + why if why else ''}", e.code, why) from e
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise MeasurementError(f"{url}: {e}") from e


def parse_grpc_stats(stats_json: dict[str, Any], cluster: str) -> GrpcCounts:
    """Envoy admin `/stats?format=json` -> the cluster's gRPC counts, summed over methods.

    The last name segment says what is counted; service and method names contain dots, so the
    name is read from the right."""
    prefix = f"cluster.{cluster}.grpc."
    total = success = failure = 0
    codes: dict[str, int] = {}
    for s in stats_json.get("stats", []):
        name, value = s.get("name", ""), s.get("value")
        if value is None or not name.startswith(prefix):
            continue
        last = name.rsplit(".", 1)[-1]
        if last == "total":
            total += value
        elif last == "success":
            success += value
        elif last == "failure":
            failure += value
        elif last.isdigit():
            codes[last] = codes.get(last, 0) + value
    return GrpcCounts(total, success, failure, codes)


def parse_http_stats(stats_json: dict[str, Any], cluster: str, grpc: GrpcCounts) -> GrpcCounts:
    """`grpc` plus the cluster's non-gRPC calls (the OpenAI HTTP API, issue 17).

    Envoy's cluster counters mix both protocols. HTTP calls: the completed upstream requests
    that are neither a retry nor a gRPC call. A gRPC call answered by the upstream is HTTP 200
    whatever its grpc-status, so `upstream_rq_5xx` holds the HTTP API's 5xx, plus gRPC calls the
    caller sidecar failed itself (connect failure, reset), which grpc_stats already counts: the
    HTTP faults are capped at the HTTP calls, so gRPC-only traffic reads as before."""
    prefix = f"cluster.{cluster}."
    got = {"upstream_rq_completed": 0, "upstream_rq_retry": 0, "upstream_rq_5xx": 0}
    for s in stats_json.get("stats", []):
        name = s.get("name", "")
        if name.startswith(prefix) and name[len(prefix) :] in got:
            got[name[len(prefix) :]] += s.get("value") or 0
    calls = got["upstream_rq_completed"] - got["upstream_rq_retry"] - grpc.total
    if calls <= 0:
        return grpc
    failed = min(got["upstream_rq_5xx"], calls)
    http = {HTTP_5XX: failed, HTTP_OTHER: calls - failed}
    return grpc + GrpcCounts(calls, calls - failed, failed, {k: v for k, v in http.items() if v})


class EnvoyStatsSource:
    """gRPC counters for one upstream cluster, read from several Envoys' admin `/stats`, with
    the OpenAI HTTP API's calls to it (`parse_http_stats`).
    `admin_urls` is a list, or a function asked at every read (sidecars come and go)."""

    def __init__(
        self,
        admin_urls: list[str] | Callable[[], list[str]],
        cluster: str,
        *,
        timeout: float = 2.0,
    ) -> None:
        if not callable(admin_urls) and not admin_urls:
            raise ValueError("EnvoyStatsSource needs at least one caller-side admin URL")
        self._urls = admin_urls if callable(admin_urls) else (lambda: list(admin_urls))
        self.cluster = cluster
        self.timeout = timeout
        c = re.escape(f"cluster.{cluster}.")
        regex = f"^{c}(grpc\\.|upstream_rq_(completed|retry|5xx)$)"
        self._query = "/stats?format=json&filter=" + urllib.parse.quote(regex, safe="")

    def read(self) -> dict[str, GrpcCounts]:
        urls = [u.rstrip("/") for u in self._urls()]
        if not urls:
            raise MeasurementError("no caller-side sidecar with an admin URL is connected")
        docs = {url: _get_json(url + self._query, self.timeout) for url in urls}
        return {
            url: parse_http_stats(doc, self.cluster, parse_grpc_stats(doc, self.cluster))
            for url, doc in docs.items()
        }


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
        return {u: _get_json(u, self.timeout) for u in urls}

    def read(self) -> LatencyReading:
        """The p99s over each endpoint's sliding window (the worst endpoint counts)."""
        return _worst([parse_runtime_metrics(doc) for doc in self._docs().values()])

    def snapshot(self) -> LatencySnapshot:
        """Each endpoint's cumulative histograms now (and its window reading)."""
        return LatencySnapshot(
            {u: (parse_histograms(d), parse_runtime_metrics(d)) for u, d in self._docs().items()}
        )


def _worst(readings: list[LatencyReading]) -> LatencyReading:
    def worst(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return max(vals) if vals else None

    return LatencyReading(
        worst([r.ttft_p99 for r in readings]),
        worst([r.tpot_p99 for r in readings]),
        sum(r.samples for r in readings),
        ", ".join(sorted({r.over for r in readings})),
    )


class PrometheusSource:
    """Instant queries to a Prometheus server's HTTP API (`GET /api/v1/query`), fetched as
    every source is (`_get_json`: http(s) only, no redirects, no proxy, size cap, deadline)."""

    def __init__(self, provider: PrometheusProvider) -> None:
        self.url = provider.url.rstrip("/")
        self.timeout = provider.timeout

    def query(self, promql: str) -> float | None:
        """The query's one value now; None for no data (empty, NaN). MeasurementError when the
        server cannot be read, QueryError when it answers with an error or several series."""
        q = urllib.parse.urlencode({"query": promql})
        try:
            return single_value(_get_json(f"{self.url}/api/v1/query?{q}", self.timeout))
        except HttpStatusError as e:
            if e.status not in (400, 422):  # bad_data, execution: the query's fault
                raise
            try:
                answer = json.loads(e.body)
            except ValueError:
                raise QueryError(f"Prometheus answered {e.status}: {e.body}") from e
            return single_value(answer)


def query_variables(spec: RolloutSpec) -> dict[str, str]:
    """What a gate query's `{{ name }}`s stand for (xds_server.rollout.promql.VARIABLES)."""
    from xds_server.resources.names import outbound_cluster

    return {
        "interval": duration(spec.interval),
        "service": spec.service,
        "version": spec.canary,
        "stable": spec.stable,
        "cluster": outbound_cluster(spec.service, spec.canary),
        "stable_cluster": outbound_cluster(spec.service, spec.stable),
    }


def metrics_problem(spec: RolloutSpec, source: PrometheusSource) -> str | None:
    """Why the provider's gates could never be judged (checked before a rollout starts), or
    None. No data is fine here: the canary has had no calls yet."""
    variables = query_variables(spec)
    for g in spec.gates.metrics:
        try:
            source.query(render(g.query, variables))
        except MeasurementError as e:
            return f"Prometheus cannot be read: {e}"
        except QueryError as e:
            return f"gates.metrics.{g.name}: {e}"
    return None


def evaluate_metrics(spec: RolloutSpec, source: PrometheusSource) -> Verdict:
    """One interval's verdict from the provider's queries: FAIL when a value is outside its
    [min, max]; else HALT when one has no data (an empty result or NaN: neither promotes nor
    fails, as with too little traffic), Prometheus answers an error or cannot be read; else
    PASS."""
    values: dict[str, float | None] = {}
    m: dict[str, Any] = {"metrics": values, "provider": source.url}
    failed: list[str] = []
    held: list[str] = []
    variables = query_variables(spec)
    for g in spec.gates.metrics:
        try:
            v = values[g.name] = source.query(render(g.query, variables))
        except MeasurementError as e:
            return Verdict(HALT, f"halted: Prometheus unavailable ({e})", m)
        except QueryError as e:
            values[g.name] = None
            held.append(f"{g.name}: {e}")
            continue
        if v is None:
            held.append(f"{g.name}: no data")
        elif g.min is not None and v < g.min:
            failed.append(f"{g.name} {v:g} < min {g.min:g}")
        elif g.max is not None and v > g.max:
            failed.append(f"{g.name} {v:g} > max {g.max:g}")
    if failed:
        return Verdict(FAIL, "; ".join(failed), m)
    if held:
        return Verdict(HALT, f"halted: {'; '.join(held)}", m)
    shown = ", ".join(f"{k} {v:g}" for k, v in values.items() if v is not None)
    return Verdict(PASS, f"gates passed: {shown}", m)


@dataclass(frozen=True)
class Sources:
    """What the controller reads for one rollout: caller-side gRPC counts for the canary
    cluster, and (optionally) the canary runtime's latency."""

    grpc: GrpcCountsSource
    latency: LatencySource | None = None
    stable: GrpcCountsSource | None = None  # only to report the traffic split per step
    live: GrpcHealthSource | None = None  # the canary's endpoints, probed by the control plane
    quality: Any = None  # xds_server.rollout.quality.ReplaySource or MirrorSource (spec.quality)


PASS, FAIL, HALT = "pass", "fail", "halt"


@dataclass
class Verdict:
    outcome: str  # PASS, FAIL or HALT (halt: neither promotes nor counts as a failure)
    reason: str
    measurements: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.0f}ms"


NOT_ENOUGH_TRAFFIC = "halted: not enough traffic"


def traffic_hint(gates: Gates, weight: int, interval: float, canary_header: str) -> str:
    """What to do about an interval that halted on too little traffic at `weight` %."""
    rate = gates.min_requests / (interval * weight / 100) if weight > 0 and interval > 0 else 0
    need = f" take about {rate:.3g} calls/s in all" if rate else " need more calls"
    return (
        f"{gates.min_requests} calls to the canary in {interval:g}s at {weight} %{need}: send "
        f"more, send test calls to the canary with the header `{canary_header}: always`, or "
        f"start the rollout again with a lower --min-requests or a higher first step "
        f"(--steps 25,50,100)"
    )


def evaluate(
    gates: Gates,
    counts: GrpcCounts | None,
    latency: LatencyReading | None,
    *,
    counts_error: str | None = None,
    latency_error: str | None = None,
) -> Verdict:
    """One interval's verdict. A source that cannot be read holds the rollout (HALT: it
    neither promotes nor fails), and so does too little traffic (Flagger's best-known trap:
    no data must neither promote nor fail) -- unless the calls seen failed so often that the
    success rate could not reach the gate even if every call still missing to `min_requests`
    succeeded: 5 calls that all failed are a failed interval, not "too little traffic"."""
    m: dict[str, Any] = {}
    if counts is None:
        return Verdict(HALT, f"halted: gRPC counts unavailable ({counts_error})", m)
    m.update(requests=counts.total, success=counts.success, failure=counts.failure)
    m["by_status"] = dict(counts.by_status)
    floor = max(counts.total, gates.min_requests)
    best_rate = 100.0 * (floor - counts.server_faults) / floor if floor else 100.0
    if counts.total < gates.min_requests or counts.total == 0:
        if best_rate < gates.grpc_success_rate_min:
            return Verdict(
                FAIL,
                f"{counts.server_faults} of {counts.total} calls to the canary failed (by "
                f"grpc-status {counts.by_status}): below min_requests {gates.min_requests}, but "
                f"the gRPC success rate can no longer reach {gates.grpc_success_rate_min:g}%",
                m,
            )
        return Verdict(
            HALT,
            f"{NOT_ENOUGH_TRAFFIC} ({counts.total} requests to the canary, "
            f"min_requests {gates.min_requests})",
            m,
        )
    rate = counts.success_rate or 0.0
    m["success_rate"] = round(rate, 3)
    failed: list[str] = []
    if rate < gates.grpc_success_rate_min:
        failed.append(
            f"gRPC success rate {rate:.2f}% < {gates.grpc_success_rate_min:g}% "
            f"({counts.server_faults} of {counts.total} failed, by grpc-status {counts.by_status})"
        )
    wants_latency = gates.ttft_p99_max is not None or gates.tpot_p99_max is not None
    if latency is not None:
        m.update(ttft_p99=latency.ttft_p99, tpot_p99=latency.tpot_p99)
        m.update(latency_samples=latency.samples, latency_over=latency.over)
        for name, value, limit in (
            ("TTFT", latency.ttft_p99, gates.ttft_p99_max),
            ("TPOT", latency.tpot_p99, gates.tpot_p99_max),
        ):
            if limit is not None and value is not None and value > limit:
                failed.append(f"{name} p99 {_ms(value)} > {_ms(limit)}")
    if failed:
        return Verdict(FAIL, "; ".join(failed), m)
    if wants_latency and latency is None:
        return Verdict(HALT, f"halted: canary runtime metrics unavailable ({latency_error})", m)
    if wants_latency and latency is not None:
        missing = [
            n
            for n, v, lim in (
                ("TTFT", latency.ttft_p99, gates.ttft_p99_max),
                ("TPOT", latency.tpot_p99, gates.tpot_p99_max),
            )
            if lim is not None and v is None
        ]
        if missing:
            return Verdict(HALT, f"halted: no {'/'.join(missing)} samples at the canary", m)
    return Verdict(
        PASS,
        f"gates passed: {counts.total} requests, success {rate:.2f}%, "
        f"TTFT p99 {_ms(latency.ttft_p99 if latency else None)}",
        m,
    )


def mesh_sources(
    caller_admin_urls: list[str],
    runtime_metrics_urls: dict[str, list[str]] | None = None,
    endpoints: dict[str, list[str]] | None = None,
):
    """A `sources_factory` for `RolloutController` from fixed lists: the canary's (and
    stable's) outbound cluster counters on the given caller-side sidecars, the canary version's
    runtime metrics endpoints and its endpoints to probe, when listed (version -> URLs, version
    -> host:port). `xds_server.rollout.sources.configured_sources` takes them from the mesh."""
    from xds_server.resources.names import outbound_cluster

    def factory(spec) -> Sources:  # spec: xds_server.rollout.spec.RolloutSpec
        urls = (runtime_metrics_urls or {}).get(spec.canary)
        eps = (endpoints or {}).get(spec.canary)
        return Sources(
            grpc=EnvoyStatsSource(caller_admin_urls, outbound_cluster(spec.service, spec.canary)),
            latency=RuntimeMetricsSource(urls) if urls else None,
            stable=EnvoyStatsSource(caller_admin_urls, outbound_cluster(spec.service, spec.stable)),
            live=GrpcHealthSource(eps) if eps is not None else None,
        )

    return factory
