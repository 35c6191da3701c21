"""ORCA out-of-band load reports from a real runtime (real engine and model, real gRPC on
loopback), read the way Envoy reads them: OpenRcaService/StreamCoreMetrics (issue 12, item 1)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from xds.service.orca.v3.orca_pb2 import OrcaLoadReportRequest

from model_runtime.client import Client
from model_runtime.engine import Engine, GenerateParams
from model_runtime.faults import Faults
from model_runtime.orca import utilization
from model_runtime.service import Runtime

METHOD = "/xds.service.orca.v3.OpenRcaService/StreamCoreMetrics"
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


@pytest.fixture
def runtime(smollm_int4) -> Iterator[Runtime]:
    engine = Engine(smollm_int4, max_batch=4, max_queue=8)
    engine.start()
    rt = Runtime().start()
    rt.set_model(smollm_int4, engine)
    try:
        yield rt
    finally:
        rt.shutdown(grace=5)


def reports(channel: grpc.Channel, interval_ms: int) -> Iterator[OrcaLoadReport]:
    stream = channel.unary_stream(
        METHOD,
        request_serializer=OrcaLoadReportRequest.SerializeToString,
        response_deserializer=OrcaLoadReport.FromString,
    )
    req = OrcaLoadReportRequest(report_interval=Duration(nanos=interval_ms * 1_000_000))
    return stream(req, timeout=120)


def test_utilization_rises_with_load_and_rps_comes_with_it(runtime: Runtime) -> None:
    with grpc.insecure_channel(runtime.target) as ch:
        stream = reports(ch, 100)
        idle = next(stream)
        assert idle.application_utilization == 0.0
        assert idle.named_metrics["running"] == 0 and idle.named_metrics["queue_length"] == 0
        done = threading.Event()

        def busy() -> None:
            with Client(runtime.target) as c:
                calls = [
                    threading.Thread(
                        target=lambda: list(c.generate(messages=STORY, max_new_tokens=64))
                    )
                    for _ in range(6)
                ]
                for t in calls:
                    t.start()
                for t in calls:
                    t.join()
            done.set()

        load = threading.Thread(target=busy)
        load.start()
        try:
            loaded = next(r for r in stream if r.named_metrics["running"] >= 4)
        finally:
            load.join()
            stream.cancel()
    # four of four batch slots taken (or more queued): fully utilized, and the request rate
    # Envoy needs beside the utilization to move weights
    assert loaded.application_utilization == 1.0
    assert loaded.rps_fractional > 0
    assert 0 < loaded.named_metrics["kv_used"] <= 1
    assert 0 <= loaded.cpu_utilization <= 1


def test_report_interval_is_bounded_below(runtime: Runtime) -> None:
    with grpc.insecure_channel(runtime.target) as ch:
        stream = reports(ch, 1)  # asks for 1 ms
        t0 = time.monotonic()
        for _ in range(11):
            next(stream)
        elapsed = time.monotonic() - t0
        stream.cancel()
    assert elapsed >= 0.95  # ten gaps of at least 100 ms


def test_drain_does_not_wait_for_open_report_streams(smollm_int4) -> None:
    engine = Engine(smollm_int4, max_batch=1)
    engine.start()
    rt = Runtime().start()
    rt.set_model(smollm_int4, engine)
    with grpc.insecure_channel(rt.target) as ch:
        stream = reports(ch, 1000)
        next(stream)
        t0 = time.monotonic()
        rt.shutdown(grace=30)
        assert time.monotonic() - t0 < 10  # not the 30 s grace: the report stream ended
        assert list(stream) == []


def test_utilization_is_the_largest_ratio_clamped() -> None:
    stats = {"running": 2, "max_batch": 8, "queue_depth": 6, "kv_blocks_used": 10}
    assert utilization({**stats, "kv_blocks_total": 100}, max_queue=8) == 0.75
    assert utilization({**stats, "kv_blocks_total": 100}, max_queue=0) == 0.25
    assert utilization({**stats, "running": 12, "kv_blocks_total": 100}, max_queue=8) == 1.0


def test_slow_decode_fault_slows_decoding(smollm_int4) -> None:
    """--fault-slow-decode F (the hot-replica scenario's slow replica): decode steps take about
    F times as long. Best of two runs each, interleaved, so a busy machine does not decide."""
    ids = smollm_int4.tokenizer.encode_chat(STORY)

    def seconds(factor: float) -> float:
        engine = Engine(smollm_int4, max_batch=1, slow_decode=factor)
        engine.start()
        done = threading.Event()
        t0 = time.monotonic()
        engine.submit(
            f"r{factor}",
            GenerateParams(ids, max_new_tokens=12),
            lambda ev: ev.finish_reason and done.set(),
        )
        assert done.wait(120)
        took = time.monotonic() - t0
        engine.shutdown()
        return took

    runs = [(seconds(1.0), seconds(5.0)) for _ in range(2)]
    assert min(s for _, s in runs) >= 2 * min(n for n, _ in runs)
    with pytest.raises(ValueError, match=r"slow-decode factor 0\.5 is outside"):
        Faults(slow_decode=0.5)
