"""ORCA out-of-band load reports on the runtime's gRPC port, for Envoy's load-aware routing.

    /xds.service.orca.v3.OpenRcaService/StreamCoreMetrics
        OrcaLoadReportRequest -> stream OrcaLoadReport, one every `report_interval`

Envoy's `client_side_weighted_round_robin` with `enable_oob_load_report` opens this stream on each
host and weighs the host by qps / (utilization + eps / qps * error_utilization_penalty), where
utilization is application_utilization, or cpu_utilization when that is 0; a report without
rps_fractional, or with no utilization at all, does not move the weight (Envoy docs for
ClientSideWeightedRoundRobin; verified on Envoy 1.40, docs/ARCHITECTURE.md). Per-request
reports in trailers would be read once per token stream, too late for long streams, hence
out-of-band.

Both figures cover the same window (the last WINDOW_S), so their ratio is what a host costs:

- rps_fractional: requests finished per second (ended other than shed; a call that is still
  running counts once it ends). Counted at admission, a call admitted just now would count in
  full while only the first moments of its stream are in the utilization, so a replica that got
  few calls (the one least_loaded sends fewer) looked nearly free on each new one, drew a burst
  of calls, and swung. Counted at the end, a stream in flight adds utilization before it adds a
  request: a busy replica errs toward looking busier. A replica that finished none in the window
  reports rps 0, which Envoy ignores (the host keeps its last weight until it expires).
- application_utilization: the time average of the streams in the runtime (running and queued)
  over its batch limit, or of the KV blocks in use over all blocks where that is larger. By
  Little's law the average number of streams is rps x the mean time a stream stays, so
  qps / utilization = batch limit / mean stream time: a replica that decodes at half speed
  weighs half as much at the same rps, however light the load. A snapshot would not do: at
  light load it is mostly 0 and Envoy then falls back to cpu_utilization. Not clamped to 1
  (ORCA allows more "when the usage exceeds the reporter dependent notion of soft limits"): past
  the batch limit the queue still tells an overloaded replica from a less overloaded one.
  Floored at UTILIZATION_FLOOR while rps > 0 (a stream shorter than a sample may be missed).
  Reported times UTILIZATION_SCALE: Envoy truncates qps / utilization to a whole number and
  raises a weight below 1 to 1, and at token-stream rates (about one call a second, streams of
  seconds) batch limit / mean stream time is 1 to 10, so a half-speed replica would weigh 1 or 2
  against 2 to 4, and both 1 once loaded. Scaling every host's utilization alike leaves the
  weights' ratios alone and gives them two more digits. named_metrics["utilization"] has the
  unscaled figure.

cpu_utilization is not reported: the runtime shares its cores with other processes, and a
replica slowed by anything but its own CPU (a sleep, a neighbour) would show less of it and look
idle. named_metrics: utilization (unscaled, over the window); queue_length, running (streams) and
kv_used (fraction of KV blocks in use) as of the report.

Who may open a stream: the caller's sidecar refuses the method to clients, and an inbound
sidecar lets through only the mesh's workloads (its `callers`, when listed). Here each stream
holds a worker of the report pool, which the runtime sizes beside the pool that serves calls
(service.py), so streams are bounded: MAX_STREAMS in all, MAX_STREAMS_PER_PEER per
caller, known by the SPIFFE ID its sidecar put in `x-forwarded-client-cert` from the mTLS
handshake. Without identity the callers cannot be told apart and only the total holds. A stream
past a bound is refused with RESOURCE_EXHAUSTED; Envoy retries it with backoff.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from xds.service.orca.v3.orca_pb2 import OrcaLoadReportRequest

from mesh_common.headers import CLIENT_CERT_HEADER

SERVICE = "xds.service.orca.v3.OpenRcaService"
MIN_INTERVAL_S = 0.1  # a client may not make the runtime report faster than this
MAX_INTERVAL_S = 60.0
DEFAULT_INTERVAL_S = 1.0  # when the request leaves report_interval unset
WINDOW_S = 10.0  # both rps and utilization average over this (longer than most streams)
SAMPLE_S = 0.05  # how often the streams in the runtime are counted
UTILIZATION_FLOOR = 0.01
UTILIZATION_SCALE = 0.01  # what application_utilization carries (weights x100, see above)
# One stream per caller sidecar and balanced cluster; replicas of one workload share its ID.
MAX_STREAMS = 64
MAX_STREAMS_PER_PEER = 16
_URI = re.compile(r'(?:^|;)URI="?([^;",]*)')


def peer_of(metadata: dict[str, str]) -> str:
    """The caller's SPIFFE ID from its sidecar's `x-forwarded-client-cert` (its last element:
    the hop that reached this runtime's sidecar), or "" where there is none."""
    xfcc = str(metadata.get(CLIENT_CERT_HEADER, "")).rsplit(",", 1)[-1]
    m = _URI.search(xfcc)
    return m.group(1) if m else ""


class Sample(NamedTuple):
    """Running totals at time `t` (monotonic s): requests finished, and the integrals over time
    of streams / batch limit and of the KV fraction in use (in seconds)."""

    t: float
    finished: int
    streams_s: float
    kv_s: float


def load(older: Sample, newer: Sample) -> tuple[float, float]:
    """(rps, utilization) between two samples; (0, 0) over an empty span."""
    span = newer.t - older.t
    if span <= 0:
        return 0.0, 0.0
    rps = max(0, newer.finished - older.finished) / span
    util = max(newer.streams_s - older.streams_s, newer.kv_s - older.kv_s) / span
    return rps, max(util, UTILIZATION_FLOOR) if rps > 0 else max(util, 0.0)


class _Sampler:
    """Integrates the engine's streams and KV use every SAMPLE_S, keeping WINDOW_S of samples.
    One thread per runtime, started by the first report stream, stopped by close()."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._samples: collections.deque[Sample] = collections.deque()
        self._last: tuple[float, float] | None = None  # (streams ratio, kv ratio) last counted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="orca-sampler", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def window(self) -> tuple[Sample, Sample] | None:
        """The oldest and newest samples in the window, once there are two."""
        self.sample()
        with self._lock:
            return (self._samples[0], self._samples[-1]) if len(self._samples) > 1 else None

    def sample(self) -> None:
        engine = self._engine()
        if engine is None:
            return
        with self._lock:  # the report's sample and the thread's, in time order
            stats = engine.stats()
            now = time.monotonic()
            ratios = (
                (stats["running"] + stats["queue_depth"]) / max(1, engine.max_batch_limit),
                stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]),
            )
            if not self._samples:
                self._samples.append(Sample(now, stats["requests_finished"], 0.0, 0.0))
            else:
                # left rectangles: what was counted last held until now
                prev, (streams, kv) = self._samples[-1], self._last or ratios
                dt = now - prev.t
                self._samples.append(
                    Sample(
                        now,
                        stats["requests_finished"],
                        prev.streams_s + streams * dt,
                        prev.kv_s + kv * dt,
                    )
                )
            self._last = ratios
            while len(self._samples) > 2 and now - self._samples[1].t >= WINDOW_S:
                self._samples.popleft()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()


class OrcaService:
    """`engine()` returns the engine, or None while the model loads (then all figures are 0)."""

    def __init__(
        self,
        engine: Callable[[], Any],
        *,
        max_streams: int = MAX_STREAMS,
        max_per_peer: int = MAX_STREAMS_PER_PEER,
    ) -> None:
        self._engine = engine
        self._sampler = _Sampler(engine)
        self.max_streams, self.max_per_peer = max_streams, max_per_peer
        self._closed = False
        self._lock = threading.Lock()
        # one per open stream: its peer, and an event set when it must end
        self._streams: dict[threading.Event, str] = {}

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "StreamCoreMetrics": grpc.unary_stream_rpc_method_handler(
                    self.stream_core_metrics,
                    request_deserializer=OrcaLoadReportRequest.FromString,
                    response_serializer=OrcaLoadReport.SerializeToString,
                )
            },
        )

    def close(self) -> None:
        """Ends every open stream (drain must not wait on Envoy's endless report streams)."""
        with self._lock:
            self._closed = True
            for ended in self._streams:
                ended.set()
        self._sampler.stop()

    def report(self) -> OrcaLoadReport:
        engine = self._engine()
        if engine is None:
            return OrcaLoadReport()
        window = self._sampler.window()
        rps, util = load(*window) if window else (0.0, 0.0)
        stats = engine.stats()
        return OrcaLoadReport(
            application_utilization=util * UTILIZATION_SCALE,
            rps_fractional=rps,
            named_metrics={
                "utilization": util,
                "queue_length": float(stats["queue_depth"]),
                "running": float(stats["running"]),
                "kv_used": stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]),
            },
        )

    def stream_core_metrics(
        self, request: OrcaLoadReportRequest, context: grpc.ServicerContext
    ) -> Iterator[OrcaLoadReport]:
        asked = request.report_interval.ToTimedelta().total_seconds()
        interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, asked or DEFAULT_INTERVAL_S))
        ended = threading.Event()
        peer = peer_of(dict(context.invocation_metadata()))
        with self._lock:
            refused = self._full(peer)
            if not refused:
                if self._closed or not context.add_callback(ended.set):
                    return
                self._streams[ended] = peer
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        self._sampler.start()
        try:
            while not ended.is_set():
                yield self.report()
                ended.wait(interval)
        finally:
            with self._lock:
                self._streams.pop(ended, None)

    def _full(self, peer: str) -> str:
        """Why a new stream of `peer` is refused, or "" (under the lock)."""
        if len(self._streams) >= self.max_streams:
            return f"load reports: {self.max_streams} streams are open, this runtime's most"
        if peer and sum(p == peer for p in self._streams.values()) >= self.max_per_peer:
            return (
                f"load reports: {peer} has {self.max_per_peer} streams open, the most one "
                "caller may hold here"
            )
        return ""
