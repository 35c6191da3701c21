"""ORCA out-of-band load reports on the runtime's gRPC port, for Envoy's load-aware routing.

    /xds.service.orca.v3.OpenRcaService/StreamCoreMetrics
        OrcaLoadReportRequest -> stream OrcaLoadReport, one every `report_interval`

Envoy's `client_side_weighted_round_robin` with `enable_oob_load_report` opens this stream on each
host and weighs the host by rps_fractional / application_utilization; it ignores the utilization
unless rps_fractional comes with it (verified on Envoy 1.40, DESIGN.md). Per-request reports in
trailers would be read once per token stream, too late for long streams, hence out-of-band.

application_utilization is what limits this runtime: the largest of running streams / the
(adaptive) batch limit, waiting requests / max_queue and KV blocks in use / all KV blocks, in
[0, 1]. A replica that decodes slowly holds more streams at the same offered load (Little's law),
so its utilization rises and its weight falls. rps_fractional is requests accepted per second over
the last few seconds; cpu_utilization this process's CPU time per wall second per core.
named_metrics: queue_length, running (streams), kv_used (fraction of KV blocks in use).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from xds.service.orca.v3.orca_pb2 import OrcaLoadReportRequest

SERVICE = "xds.service.orca.v3.OpenRcaService"
MIN_INTERVAL_S = 0.1  # a client may not make the runtime report faster than this
MAX_INTERVAL_S = 60.0
DEFAULT_INTERVAL_S = 1.0  # when the request leaves report_interval unset
RATE_WINDOW_S = 5.0


def utilization(stats: dict[str, Any], max_queue: int) -> float:
    """The largest of the batch, queue and KV ratios, clamped to [0, 1]."""
    ratios = [
        stats["running"] / max(1, stats["max_batch"]),
        stats["queue_depth"] / max_queue if max_queue > 0 else 0.0,
        stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]),
    ]
    return min(1.0, max(0.0, *ratios))


class _Rates:
    """Requests/s and CPU share over the last RATE_WINDOW_S, from monotonic counters."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int, float]] = collections.deque()
        self._cores = os.cpu_count() or 1

    def update(self, admitted: int) -> tuple[float, float]:
        now, cpu = time.monotonic(), time.process_time()
        self._samples.append((now, admitted, cpu))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0, c0 = self._samples[0]
        if now - t0 <= 0:
            return 0.0, 0.0
        rps = max(0, admitted - n0) / (now - t0)
        return rps, min(1.0, max(0.0, (cpu - c0) / (now - t0) / self._cores))


class OrcaService:
    """`engine()` returns the engine, or None while the model loads (then all figures are 0)."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self._closed = False
        self._lock = threading.Lock()
        self._streams: set[threading.Event] = set()  # one per open stream, set when it must end

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

    def report(self, rates: _Rates) -> OrcaLoadReport:
        engine = self._engine()
        if engine is None:
            return OrcaLoadReport()
        stats = engine.stats()
        rps, cpu = rates.update(stats.get("requests_admitted", 0))
        kv_used = stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"])
        return OrcaLoadReport(
            application_utilization=utilization(stats, engine.max_queue),
            cpu_utilization=cpu,
            rps_fractional=rps,
            named_metrics={
                "queue_length": float(stats["queue_depth"]),
                "running": float(stats["running"]),
                "kv_used": kv_used,
            },
        )

    def stream_core_metrics(
        self, request: OrcaLoadReportRequest, context: grpc.ServicerContext
    ) -> Iterator[OrcaLoadReport]:
        asked = request.report_interval.ToTimedelta().total_seconds()
        interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, asked or DEFAULT_INTERVAL_S))
        ended = threading.Event()
        with self._lock:
            if self._closed or not context.add_callback(ended.set):
                return
            self._streams.add(ended)
        try:
            rates = _Rates()
            while not ended.is_set():
                yield self.report(rates)
                ended.wait(interval)
        finally:
            with self._lock:
                self._streams.discard(ended)
