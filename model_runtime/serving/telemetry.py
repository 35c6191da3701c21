"""The runtime's telemetry on its loopback metrics port: `GET /metrics` in Prometheus text
(model_runtime/serving/prometheus.py, names after vLLM's), `GET /metrics.json` for the rollout gates
and the SLO loop; and OpenTelemetry traces and metrics, exported over OTLP when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set (model_runtime/serving/otlp.py).

Metrics (OTel SDK): `meshlm.ttft`, `meshlm.tpot` and `meshlm.e2e` histograms (seconds),
`meshlm.rpc.requests` counter by method, gRPC status and tenant, and observable gauges reading
`engine.stats()`: queue depth, running requests, batch size, KV blocks in use. Traces: one SERVER
span per RPC that continues the W3C `traceparent` arriving in gRPC metadata (set by Envoy).

`/metrics.json` serves percentiles over a sliding window of recent calls (the SLO loop reads them),
cumulative TTFT/TPOT histograms since the runtime started (`histograms`: a rollout gate takes
one read at the start of its analysis interval and one at the end and reads the percentile of
the difference, as Prometheus' histogram_quantile over a rate does), plus the gauges.

Mirrored copies (`shadow=True`) count only in their own counter
(`meshlm_shadow_requests_total{code}` in /metrics, `shadow_requests` in /metrics.json,
`meshlm.shadow.requests` over OTLP): never in the requests, TTFT, TPOT, ITL, e2e or queue series
that a canary's traffic gates read, so the canary is judged on its callers' calls alone.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mesh_common.http_server import BoundedHandler, BoundedServer
from mesh_common.prometheus_text import CONTENT_TYPE
from model_runtime.serving import otlp
from model_runtime.serving.prometheus import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    RuntimeMetrics,
)

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
_GAUGES = {
    "meshlm.queue_depth": "queue_depth",
    "meshlm.running": "running",
    "meshlm.batch_size": "batch_size",
    "meshlm.kv_blocks_used": "kv_blocks_used",
}


# Upper bucket bounds in ms, 2^(1/8) apart (9 % wide: an interval's p99 read from the histogram
# is within 9 % of the exact one) from 0.1 ms to about 10 minutes; a last, open bucket above.
BOUNDS_MS = tuple(float(f"{0.1 * 2 ** (i / 8):.6g}") for i in range(181))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Telemetry:
    """One per runtime. `engine_stats` is read by the gauges and by /metrics. Without providers
    given, OTLP exporters from the OTEL_* environment (an OtlpConfigError names a variable it
    cannot honour); call shutdown() to flush them."""

    def __init__(
        self,
        engine_stats: Callable[[], dict] | None = None,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        window_s: float = 60.0,
    ) -> None:
        self.engine_stats = engine_stats
        self.window_s = window_s
        self.reader: InMemoryMetricReader | None = None
        self._exporting: list[TracerProvider | MeterProvider] = []
        if tracer_provider is None and meter_provider is None:
            tracer_provider, meter_provider = otlp.providers(os.environ)
            self._exporting = [p for p in (tracer_provider, meter_provider) if p is not None]
        if meter_provider is None:
            self.reader = InMemoryMetricReader()
            meter_provider = MeterProvider(metric_readers=[self.reader])
        meter = meter_provider.get_meter("meshlm.runtime")
        self.ttft = meter.create_histogram(
            "meshlm.ttft", unit="s", description="time to first token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )  # fmt: skip
        self.tpot = meter.create_histogram(
            "meshlm.tpot", unit="s", description="time per output token",
            explicit_bucket_boundaries_advisory=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = meter.create_histogram(
            "meshlm.e2e", unit="s", description="Generate call, arrival to last chunk",
            explicit_bucket_boundaries_advisory=E2E_BUCKETS,
        )  # fmt: skip
        self.requests = meter.create_counter("meshlm.rpc.requests", description="RPCs by status")
        self.shadow_requests = meter.create_counter(
            "meshlm.shadow.requests", description="mirrored (shadow) Generate calls by status"
        )
        self.prom = RuntimeMetrics(self._stats)
        self._budget_levels: Callable[[], dict[str, dict[str, float]]] = dict
        for name, key in _GAUGES.items():
            meter.create_observable_gauge(name, callbacks=[self._gauge(key)])
        # An SDK provider of our own (no exporter) keeps span and trace ids real even where the
        # process has not configured OpenTelemetry.
        self.tracer = (tracer_provider or TracerProvider()).get_tracer("meshlm.runtime")
        self._lock = threading.Lock()
        self._window: deque[tuple[float, str, str, float | None, float | None]] = deque()
        self._totals: dict[str, dict[str, int]] = {}
        self._shadow_totals: dict[str, int] = {}
        # Generate calls since start, per bucket of BOUNDS_MS (the last: above them).
        self._hist = {"ttft": [0] * (len(BOUNDS_MS) + 1), "tpot": [0] * (len(BOUNDS_MS) + 1)}
        self.instance = secrets.token_hex(8)  # a reader's baseline from before a restart is void

    def _gauge(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def observe(_: CallbackOptions) -> Iterator[Observation]:
            stats = self._stats()
            if key in stats:
                yield Observation(stats[key])

        return observe

    def _stats(self) -> dict:
        if self.engine_stats is None:
            return {}
        try:
            return dict(self.engine_stats())
        except Exception:  # a gauge must never break the metrics pipeline
            log.exception("engine.stats() failed")
            return {}

    @contextmanager
    def span(self, method: str, metadata: Mapping[str, Any]) -> Iterator[trace.Span]:
        """A SERVER span continuing the caller's traceparent (W3C Trace Context) if any."""
        carrier = {k: v for k, v in metadata.items() if isinstance(v, str)}
        ctx = _PROPAGATOR.extract(carrier)
        with self.tracer.start_as_current_span(
            f"meshlm.inference.v1.Inference/{method}",
            context=ctx,
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method},
        ) as span:
            yield span

    def record(
        self,
        method: str,
        code: str,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        *,
        e2e_s: float | None = None,
        tenant: str = "",
        shadow: bool = False,
        usage: tuple[str, int, int] | None = None,
    ) -> None:
        """One call ended. `tenant`: the verified tenant header (a label; never a key).
        `shadow`: a mirrored copy, counted in the shadow counter alone (module doc). `usage`:
        (model id, prompt tokens, completion tokens) of a call the engine ran."""
        if shadow:
            self.shadow_requests.add(1, {"rpc.grpc.status": code})
            self.prom.shadow_requests.labels(code).inc()
            with self._lock:
                self._shadow_totals[code] = self._shadow_totals.get(code, 0) + 1
            return
        tenant = self.prom.tenant(tenant)
        attrs = {"rpc.method": method, "rpc.grpc.status": code}
        self.requests.add(1, {**attrs, "meshlm.tenant": tenant})
        self.prom.requests.labels(method, code, tenant).inc()
        if usage is not None:
            model, prompt, completion = usage
            self.prom.prompt_tokens.labels(tenant, model).inc(prompt)
            self.prom.generation_tokens.labels(tenant, model).inc(completion)
        if ttft_s is not None:
            self.ttft.record(ttft_s, attrs)
        if tpot_s is not None:
            self.tpot.record(tpot_s, attrs)
        if e2e_s is not None:
            self.e2e.record(e2e_s, attrs)
            self.prom.e2e.observe(e2e_s)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, method, code, ttft_s, tpot_s))
            by_code = self._totals.setdefault(method, {})
            by_code[code] = by_code.get(code, 0) + 1
            if method == "Generate" and code == "OK" and tpot_s is not None:
                self._hist["tpot"][bisect.bisect_left(BOUNDS_MS, tpot_s * 1e3)] += 1
            self._trim(now)

    def first_token(self, ttft_s: float, queue_s: float | None = None) -> None:
        """A Generate call's first token, counted in the TTFT histogram when it happens (not
        when the call ends): a gate's interval holds the calls whose first token came in it,
        as its callers saw them, however long they then decode."""
        self.prom.ttft.observe(ttft_s)
        if queue_s is not None:
            self.prom.queue.observe(queue_s)
        with self._lock:
            self._hist["ttft"][bisect.bisect_left(BOUNDS_MS, ttft_s * 1e3)] += 1

    def tokens(self, gap_s: float, n: int) -> None:
        """`n` more tokens of a stream sent `gap_s` after its previous ones: n gaps of gap_s/n."""
        for _ in range(n):
            self.prom.itl.observe(gap_s / n)

    def resumed(self) -> None:
        """A Generate call continues a stream another replica began (a stall resume)."""
        self.prom.resumes.inc()

    def shutdown(self) -> None:
        """Flush and stop the OTLP exporters (if any)."""
        for p in self._exporting:
            p.shutdown()

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - self.window_s:
            self._window.popleft()

    def snapshot(self) -> dict:
        """What GET /metrics.json returns. Top-level `ttft_ms` / `tpot_ms` cover successful Generate
        calls in the window (what `xds_server.rollout.gates.runtime_metrics` reads); `methods`
        breaks calls down by method and gRPC status; `histograms` counts, since this runtime
        started (`instance`) and per bucket of `bounds_ms`, the TTFT of every Generate call
        that sent a first token (as it did) and the TPOT of those that ended OK."""
        with self._lock:
            self._trim(time.monotonic())
            rows = list(self._window)
            totals = {m: dict(c) for m, c in self._totals.items()}
            hist = {name: list(counts) for name, counts in self._hist.items()}
            shadow = dict(self._shadow_totals)
        methods: dict[str, dict] = {}
        for _, method, code, _, _ in rows:
            m = methods.setdefault(method, {"requests": 0, "ok": 0, "by_status": {}})
            m["requests"] += 1
            m["ok"] += code == "OK"
            m["by_status"][code] = m["by_status"].get(code, 0) + 1
        for method, m in methods.items():
            m["success_rate"] = m["ok"] / m["requests"]
            m.update(_latency(rows, method))
        return {
            "window_s": self.window_s,
            **_latency(rows, "Generate"),
            "methods": methods,
            "totals": totals,
            "shadow_requests": shadow,
            "histograms": {"instance": self.instance, "bounds_ms": list(BOUNDS_MS), **hist},
            "engine": self._stats(),
            # tenant -> budget -> tokens left of this runtime's share (meshlm status reads it)
            "token_budgets": {
                t: {n: round(v) for n, v in b.items()} for t, b in self._budget_levels().items()
            },
        }

    def watch_budgets(self, levels: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Report the runtime's token budget levels on /metrics and /metrics.json."""
        self._budget_levels = levels
        self.prom.watch_budgets(levels)


def _latency(rows: list[tuple], method: str) -> dict[str, dict]:
    out = {}
    for name, col in (("ttft", 3), ("tpot", 4)):
        vals = [
            r[col] * 1e3 for r in rows if r[1] == method and r[2] == "OK" and r[col] is not None
        ]
        p50, p99 = _pct(vals, 0.5), _pct(vals, 0.99)
        out[f"{name}_ms"] = {
            "p50": None if p50 is None else round(p50, 3),
            "p99": None if p99 is None else round(p99, 3),
            "count": len(vals),
        }
    return out


# The metrics port serves scrapers and the quality gate (a few connections at once); one thread
# per connection, so both the number and the idle time of connections are bounded.
METRICS_MAX_CONNECTIONS = 16
METRICS_IDLE_TIMEOUT_S = 5.0
METRICS_READ_DEADLINE_S = 10.0  # for a whole request to arrive, from its first byte
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: 30\r\n\r\ntoo many metrics connections\r\n"
)


class MetricsServer:
    """`GET /metrics` (Prometheus text) and `GET /metrics.json` on loopback; a thread of its
    own, and one per connection: at most METRICS_MAX_CONNECTIONS (503 beyond), each closed
    after METRICS_IDLE_TIMEOUT_S without a byte or when a request has not arrived whole within
    METRICS_READ_DEADLINE_S. Use as a context manager or stop()."""

    def __init__(
        self, telemetry: Telemetry, port: int = 0, host: str = "127.0.0.1", records: Any = None
    ) -> None:
        # records (model_runtime/serving/records.py): GET /records and /score, for the quality gate
        queried = {"/records", "/score"} if records is not None else set()
        pages = {
            "/metrics": (CONTENT_TYPE, telemetry.prom.exposition),
            "/metrics.json": (
                "application/json",
                lambda: json.dumps(telemetry.snapshot()).encode(),
            ),
        }

        class Handler(BoundedHandler):
            timeout = METRICS_IDLE_TIMEOUT_S  # on every recv and send of the socket
            body_methods = frozenset()  # GETs alone: a body is refused, never read as a request

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path in queried:
                    status, body = records.page(path, query)
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                page = pages.get(path)
                if page is None:
                    self.send_error(404, "only /metrics and /metrics.json live here")
                    return
                content_type, render = page
                body = render()
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("metrics http: " + fmt, *args)

        self.httpd = BoundedServer(
            (host, port),
            Handler,
            max_connections=METRICS_MAX_CONNECTIONS,
            max_per_peer=METRICS_MAX_CONNECTIONS,  # a loopback port: every peer is local
            request_timeout=METRICS_READ_DEADLINE_S,
            busy=_BUSY,
        )
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
