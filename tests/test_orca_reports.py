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

from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.serving.client import Client
from model_runtime.serving.faults import Faults
from model_runtime.serving.orca import UTILIZATION_FLOOR, UTILIZATION_SCALE, Sample, load
from model_runtime.serving.service import Runtime

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone

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


def test_utilization_rises_with_load_past_the_batch_limit_and_rps_comes_with_it(
    runtime: Runtime,
) -> None:
    with grpc.insecure_channel(runtime.target) as ch:
        stream = reports(ch, 100)
        idle = next(stream)
        assert idle.application_utilization == 0.0 and idle.rps_fractional == 0.0
        assert idle.named_metrics["running"] == 0 and idle.named_metrics["queue_length"] == 0
        load = threading.Thread(target=calls, args=(runtime, 8, 0.0, 32))
        load.start()
        seen = []
        try:
            for r in stream:
                seen.append(r)
                if not load.is_alive():
                    break
        finally:
            load.join()
            stream.cancel()
    # Eight streams on four batch slots: the time average passes 1 (ORCA allows it; the queue
    # still counts), with the request rate Envoy needs beside it to move weights.
    peak = max(seen, key=lambda r: r.named_metrics["utilization"])
    assert peak.named_metrics["utilization"] > 1.0, [r.named_metrics["utilization"] for r in seen]
    # rps counts calls that ended, so on a slow CPU the peak may come before the first one does;
    # what Envoy needs is a report that carries both while the runtime is past its limit.
    assert any(r.rps_fractional > 0 and r.named_metrics["utilization"] > 1.0 for r in seen), [
        (round(r.named_metrics["utilization"], 2), r.rps_fractional) for r in seen
    ]
    # what Envoy reads: scaled alike on every host, so its whole-number weights keep resolution
    assert peak.application_utilization == pytest.approx(
        peak.named_metrics["utilization"] * UTILIZATION_SCALE
    )
    assert max(r.named_metrics["running"] for r in seen) == 4
    assert max(r.named_metrics["queue_length"] for r in seen) >= 1
    assert 0 < max(r.named_metrics["kv_used"] for r in seen) <= 1
    # not reported: on shared cores a slowed replica shows less CPU and would look idle
    assert all(r.cpu_utilization == 0 for r in seen)


def calls(rt: Runtime, n: int, gap_s: float, max_new_tokens: int) -> None:
    """`n` Generate calls on their own threads, started `gap_s` apart, all run to the end."""
    with Client(rt.target) as c:
        threads = []
        for _ in range(n):
            threads.append(
                threading.Thread(
                    target=lambda: list(c.generate(messages=STORY, max_new_tokens=max_new_tokens))
                )
            )
            threads[-1].start()
            time.sleep(gap_s)
        for t in threads:
            t.join()


def cost(model, slow_decode: float) -> float:
    """utilization / rps reported just after six short calls, 0.3 s apart: the mean time a
    stream stayed over the batch limit (Little's law), what Envoy's weight is the inverse of."""
    engine = Engine(model, max_batch=4, max_queue=8, slow_decode=slow_decode)
    engine.start()
    rt = Runtime().start()
    rt.set_model(model, engine)
    try:
        with grpc.insecure_channel(rt.target) as ch:
            first = reports(ch, 100)
            next(first)  # the runtime counts its streams from the first report stream on
            calls(rt, 6, 0.3, 12)
            first.cancel()
            after = next(reports(ch, 100))  # a fresh report, not one queued during the calls
    finally:
        rt.shutdown(grace=5)
    assert after.rps_fractional > 0 and after.application_utilization > 0
    return after.application_utilization / after.rps_fractional


def test_slower_streams_report_more_utilization_per_request(smollm_int4) -> None:
    """The hot-replica case: at light load the same calls on a replica that decodes 4x slower
    cost more per request, although all streams have ended when the report is read (a snapshot
    would say 0 for both). Best of two each, interleaved, so a busy machine does not decide."""
    runs = [(cost(smollm_int4, 1.0), cost(smollm_int4, 4.0)) for _ in range(2)]
    assert min(s for _, s in runs) > 1.5 * min(n for n, _ in runs), runs


def test_a_call_in_flight_does_not_make_a_replica_look_free(smollm_int4) -> None:
    """Envoy weighs a host by rps / utilization. A call just admitted to an idle replica must not
    count as a request whose stream cost nothing (weight = rps over a sliver of utilization:
    the replica least_loaded sends few calls looked nearly free on each new one and drew a
    burst); a request counts once its stream has ended, with all of its time in the window."""
    engine = Engine(smollm_int4, max_batch=2, max_queue=8, slow_decode=4.0)
    engine.start()
    rt = Runtime().start()
    rt.set_model(smollm_int4, engine)
    try:
        with grpc.insecure_channel(rt.target) as ch:
            first = reports(ch, 100)
            next(first)  # the runtime counts its streams from the first report stream on
            done = threading.Event()
            t0 = time.monotonic()
            call = threading.Thread(target=lambda: (calls(rt, 1, 0.0, 96), done.set()))
            call.start()
            try:
                in_flight = next(r for r in first if r.named_metrics["running"] >= 1)
                assert not done.is_set()
                # no request counted yet: Envoy ignores rps 0 and keeps the host's last weight
                assert in_flight.rps_fractional == 0, in_flight
            finally:
                call.join()
            stream_s = time.monotonic() - t0
            first.cancel()
            after = next(reports(ch, 100))
    finally:
        rt.shutdown(grace=5)
    # Little's law over the window: utilization / rps = the stream's time over the batch limit
    assert after.rps_fractional > 0
    cost_s = after.named_metrics["utilization"] / after.rps_fractional * 2
    assert 0.5 * stream_s < cost_s < 1.5 * stream_s, (cost_s, stream_s)


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


def test_load_is_rps_and_the_time_average_over_the_same_span() -> None:
    a = Sample(t=10.0, finished=3, streams_s=1.0, kv_s=0.5)
    # 4 requests in 2 s; 2.5 batches of streams held on average (more than the limit)
    assert load(a, Sample(12.0, 7, 6.0, 1.0)) == pytest.approx((2.0, 2.5))
    # KV use decides where it is the larger share
    assert load(a, Sample(12.0, 7, 1.2, 2.1)) == pytest.approx((2.0, 0.8))
    # requests served but no stream seen in a sample: never 0, Envoy would fall back to CPU
    assert load(a, Sample(12.0, 4, 1.0, 0.5)) == pytest.approx((0.5, UTILIZATION_FLOOR))
    assert load(a, Sample(12.0, 3, 1.0, 0.5)) == (0.0, 0.0)
    assert load(a, a) == (0.0, 0.0)


def test_slow_decode_fault_slows_decoding(smollm_int4) -> None:
    """--fault-slow-decode F (the hot-replica scenario's slow replica): decode steps take about
    F times as long. Timed from the first token to the last (the decode steps alone: start-up
    and prefill, which the fault leaves alone, would dilute the ratio as decoding gets faster).
    Best of two runs each, interleaved, so a busy machine does not decide."""
    ids = smollm_int4.tokenizer.encode_chat(STORY)

    def seconds(factor: float) -> float:
        engine = Engine(smollm_int4, max_batch=1, slow_decode=factor)
        engine.start()
        done = threading.Event()
        times: list[float] = []

        def on_event(ev) -> None:
            times.append(time.monotonic())
            if ev.finish_reason:
                done.set()

        engine.submit(f"r{factor}", GenerateParams(ids, max_new_tokens=24), on_event)
        assert done.wait(120)
        engine.shutdown()
        return times[-1] - times[0]

    runs = [(seconds(1.0), seconds(5.0)) for _ in range(2)]
    assert min(s for _, s in runs) >= 2 * min(n for n, _ in runs)
    with pytest.raises(ValueError, match=r"slow-decode factor 0\.5 is outside"):
        Faults(slow_decode=0.5)
