"""The runtime over real grpcio on loopback, with the real int4 SmolLM2 model and engine."""

from __future__ import annotations

import json
import struct
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mesh_common.headers import PRIORITY_HEADER
from model_runtime.engine.engine import Engine
from model_runtime.kernels import compute, qmm
from model_runtime.loading.loader import DTYPE_NAMES
from model_runtime.serving.client import Client
from model_runtime.serving.faults import Faults
from model_runtime.serving.service import (
    SERVICE,
    InferenceService,
    Runtime,
    _priority,
)
from model_runtime.serving.telemetry import MetricsServer, Telemetry
from schemas import codec
from tests.fuzz import codec as fuzz
from tests.runtime_fixtures import serving_runtime
from xds_server.rollout.gates.runtime_metrics import parse_runtime_metrics

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
SPANS = InMemorySpanExporter()


@pytest.fixture(scope="module")
def loaded(smollm_int4):
    return smollm_int4


def _runtime(loaded, *, faults=None, telemetry=None, **engine_kw) -> Runtime:
    return serving_runtime(loaded, faults=faults, telemetry=telemetry, **engine_kw)


@pytest.fixture(scope="module")
def runtime(loaded) -> Iterator[Runtime]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SPANS))
    rt = _runtime(loaded, telemetry=Telemetry(tracer_provider=provider))
    try:
        yield rt
    finally:
        rt.shutdown(grace=5)


@pytest.fixture(scope="module")
def client(runtime) -> Iterator[Client]:
    with Client(runtime.target) as c:
        yield c


def _kv_used(rt: Runtime) -> int:
    return rt.engine.stats()["kv_blocks_used"]


def _wait_kv(rt: Runtime, baseline: int, timeout: float = 20.0) -> int:
    end = time.monotonic() + timeout
    while (used := _kv_used(rt)) != baseline and time.monotonic() < end:
        time.sleep(0.05)
    return used


def test_info_returns_model_info(client, loaded) -> None:
    info = client.info()
    assert info.name == loaded.info.name and info.precision == "int4"
    assert info.version == loaded.info.version
    assert info.context_length == loaded.info.context_length and info.vocab_size == 49152
    # what load() chose and built for this CPU (issue 13): int4 computes in bf16 everywhere, on
    # the native kernels where they apply (x86-64 with AVX-512), else on torch's
    assert info.compute == loaded.info.compute and info.compute.startswith("int4 weights on ")
    assert info.compute_dtype == "bf16" == DTYPE_NAMES[loaded.model.dtype]
    assert info.kernels == ("native" if qmm.applies() else "torch") == loaded.info.kernels


def test_info_of_a_bf16_model_says_the_dtype_it_computes_in(smollm_bf16) -> None:
    # fp32 on a CPU without native bf16 matmuls, bf16 on one with them: either way the dtype the
    # model was built in, and torch's dense kernels (no service started: the Info bytes only)
    svc = InferenceService(smollm_bf16, None, telemetry=Telemetry())
    info = codec.decode_model_info(svc.info(codec.encode_info_request(), _Context()))
    assert info.precision == "bf16" and info.kernels == "torch"
    assert info.compute_dtype == DTYPE_NAMES[smollm_bf16.model.dtype]
    assert info.compute_dtype == DTYPE_NAMES[compute.choose("bf16").dtype]
    assert info.compute == smollm_bf16.info.compute and info.compute.startswith("bf16 weights")


class _Context:
    def invocation_metadata(self):
        return ()


def test_stream_order_final_chunk_and_answer(client) -> None:
    chunks = list(client.generate(messages=QUESTION, max_new_tokens=12, request_id="order-1"))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(c.request_id == "order-1" for c in chunks)
    text = "".join(c.text_delta for c in chunks)
    assert "Paris" in text
    assert chunks[0].ttft_us is not None and chunks[0].ttft_us > 0


def test_token_ids_prompt_and_length_finish(client, loaded) -> None:
    ids = loaded.tokenizer.encode("The capital of France is")
    chunks = list(client.generate(prompt_token_ids=ids, max_new_tokens=3))
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert chunks[-1].finish_reason == "length"


def test_invalid_values_get_invalid_argument_naming_the_field(client) -> None:
    bad = codec.encode_generate_request(codec.GenerateRequest(prompt="x", max_new_tokens=0))
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate_raw(bad, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("max_new_tokens:")
    big = codec.GenerateRequest(prompt_token_ids=[1, 49152])
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate_raw(codec.encode_generate_request(big), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in e.value.details()


def test_wrong_model_is_not_found(client) -> None:
    req = codec.encode_generate_request(codec.GenerateRequest(prompt="x", model="llama-70b"))
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate_raw(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "model" in e.value.details()


VALID = codec.encode_generate_request(
    codec.GenerateRequest(request_id="fz", prompt="Hello", stop=["\n"], max_new_tokens=2)
)


def _mutate(data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["random", "truncate", "flip", "offset"]))
    if kind == "random":
        return data.draw(st.binary(max_size=300))
    if kind == "truncate":
        return VALID[: data.draw(st.integers(0, len(VALID) - 4))]
    b = bytearray(VALID)
    if kind == "flip":
        bit = data.draw(st.integers(0, len(b) * 8 - 1))
        b[bit // 8] ^= 1 << (bit % 8)
    else:
        pos = data.draw(st.integers(0, len(b) // 4 - 1)) * 4
        b[pos : pos + 4] = struct.pack("<I", data.draw(st.integers(0, 2**32 - 1)))
    return bytes(b)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_malformed_buffers_get_invalid_argument_and_server_keeps_serving(
    client, runtime, data
) -> None:
    buf = _mutate(data)
    try:
        codec.decode_generate_request(buf, runtime.service.limits)
    except codec.WireError as e:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate_raw(buf, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == str(e)  # names the field
        return
    # a mutation that is still a valid request (e.g. a flipped letter in the prompt) is served
    # (or refused for a reason other than its encoding)
    # (a valid mutation may ask for thousands of tokens: served = its stream starts)
    call = client.generate_raw(buf, timeout=60)
    try:
        next(call, None)
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        call.cancel()


@pytest.mark.parametrize("shape", ["stop", "stop16", "content", "content256", "table"])
def test_aliased_offsets_get_invalid_argument_at_the_cost_of_the_buffer(
    client, runtime, shape
) -> None:
    # Offsets aliasing one string or message (issue 9, defect 1): each alias used to be verified
    # and copied again, 4000x the buffer for "stop" (a 1 MiB one asked for 64 GiB).
    buf = fuzz.aliased(shape, 1 << 16)
    tracemalloc.start()  # the runtime serves from this process: its allocations are traced
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate_raw(buf, timeout=60))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().split("[")[0].split(":")[0] in ("stop", "messages")
    assert peak < 2 * len(buf) + (512 << 10), f"{peak} bytes for a {len(buf)}-byte request"
    chunks = list(client.generate(prompt="Hi", max_new_tokens=1, timeout=60))
    assert chunks[-1].finish_reason == "length"  # and the runtime keeps serving


def test_server_still_serves_after_the_fuzz(client) -> None:
    assert client.info().precision == "int4"
    chunks = list(client.generate(messages=QUESTION, max_new_tokens=8))
    assert "Paris" in "".join(c.text_delta for c in chunks)


def test_client_cancel_frees_kv_blocks(client, runtime) -> None:
    baseline = _wait_kv(runtime, 0)
    stream = client.generate(messages=STORY, max_new_tokens=400)
    next(stream)
    next(stream)
    assert _kv_used(runtime) > baseline
    stream.close()  # cancels the RPC
    assert _wait_kv(runtime, baseline) == baseline
    assert runtime.engine.stats()["running"] == 0


def test_deadline_exceeded_cancels_in_the_engine(client, runtime) -> None:
    baseline = _wait_kv(runtime, 0)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(messages=STORY, max_new_tokens=2000, timeout=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_kv(runtime, baseline) == baseline


def test_traceparent_is_continued(client) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    md = [("traceparent", f"00-{trace_id}-{parent}-01"), ("x-meshlm-tenant", "acme")]
    SPANS.clear()
    list(client.generate(prompt="Hi", max_new_tokens=2, metadata=md))
    spans = [s for s in SPANS.get_finished_spans() if s.name.endswith("/Generate")]
    assert spans, "no server span recorded"
    span = spans[-1]
    assert format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent
    assert span.attributes["meshlm.tenant"] == "acme"


def test_metrics_endpoint_and_otel_instruments(client, runtime) -> None:
    list(client.generate(prompt="Hi", max_new_tokens=3))
    with MetricsServer(runtime.telemetry) as m:
        url = f"http://127.0.0.1:{m.port}/metrics.json"
        doc = json.loads(urllib.request.urlopen(url, timeout=10).read())
    gen = doc["methods"]["Generate"]
    assert gen["by_status"]["OK"] >= 1 and "INVALID_ARGUMENT" in gen["by_status"]
    assert doc["ttft_ms"]["count"] >= 1 and doc["ttft_ms"]["p99"] > 0
    assert doc["engine"]["kv_blocks_total"] > 0
    reading = parse_runtime_metrics(doc)  # what the rollout gates read
    assert reading.ttft_p99 == pytest.approx(doc["ttft_ms"]["p99"] / 1000)
    names = {
        metric.name
        for rm in runtime.telemetry.reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }
    assert {"meshlm.ttft", "meshlm.tpot", "meshlm.kv_blocks_used", "meshlm.queue_depth"} <= names


def test_priority_is_the_body_bounded_by_the_verified_header() -> None:
    assert _priority(5, {"x-meshlm-priority": "high"}) == 1  # the body may not raise it
    assert _priority(-5, {"x-meshlm-priority": "high"}) == -5  # but may lower it
    assert _priority(None, {"x-meshlm-priority": "high"}) == 1
    assert _priority(None, {"x-meshlm-priority": "-3"}) == -3
    assert _priority(None, {}) == 0
    assert _priority(7, {}) == 0  # no verified header: "normal" at most
    assert _priority(None, {"x-meshlm-priority": "urgent"}) == -1000  # fails closed


def test_body_priority_cannot_jump_the_queue_past_the_verified_header(loaded) -> None:
    # A "low" tenant asks for priority 1000 in the body, then a "normal" one asks for nothing.
    # Both wait in the queue of an engine that has not started; once it starts (one sequence at
    # a time) it admits "normal" first, so "normal" waited less though it came later.
    engine = Engine(loaded, max_batch=1, max_queue=8)
    rt = Runtime().start()
    rt.set_model(loaded, engine)
    waits: dict[str, int] = {}

    def call(c: Client, tier: str, priority: int | None) -> None:
        md = [(PRIORITY_HEADER, tier)]
        first, *_ = c.generate("Hi", max_new_tokens=2, priority=priority, metadata=md, timeout=120)
        waits[tier] = first.queue_wait_us

    try:
        with Client(rt.target) as c:
            threads = []
            for depth, (tier, priority) in enumerate((("low", 1000), ("normal", None)), 1):
                threads.append(threading.Thread(target=call, args=(c, tier, priority)))
                threads[-1].start()
                _wait_queue_depth(engine, depth)
            engine.start()
            for t in threads:
                t.join(timeout=120)
        assert waits["normal"] < waits["low"], waits
    finally:
        rt.shutdown(grace=1)


def _wait_queue_depth(engine: Engine, depth: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while engine.stats()["queue_depth"] != depth:
        assert time.monotonic() < end, f"the queue never held {depth} requests"
        time.sleep(0.02)


def test_engine_full_is_resource_exhausted(loaded) -> None:
    rt = _runtime(loaded, max_batch=1, max_queue=0)  # admits nothing: the queue holds 0
    try:
        with Client(rt.target) as c, pytest.raises(grpc.RpcError) as e:
            list(c.generate(prompt="Hi", max_new_tokens=2, timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in e.value.details()
    finally:
        rt.shutdown(grace=1)


def test_fault_flags_error_rate_and_first_token_delay(loaded) -> None:
    rt = _runtime(loaded, faults=Faults(error_percent=50, delay_ms=300, seed=7))
    try:
        codes = []
        with Client(rt.target) as c:
            for _ in range(40):
                try:
                    chunks = list(c.generate(prompt_token_ids=[1, 2], max_new_tokens=1, timeout=60))
                    codes.append("OK")
                    assert chunks[0].ttft_us >= 300_000  # the injected delay shows in TTFT
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE and "fault" in e.details()
                    codes.append("UNAVAILABLE")
        assert 8 <= codes.count("UNAVAILABLE") <= 32  # about 50 % (binomial, seeded)
        assert rt.telemetry.snapshot()["methods"]["Generate"]["by_status"]["UNAVAILABLE"] >= 8
    finally:
        rt.shutdown(grace=1)


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status


def test_health_transitions_and_graceful_shutdown_finishes_streams(loaded) -> None:
    S = health_pb2.HealthCheckResponse
    rt = Runtime().start()
    try:
        assert _health(rt.target) == S.NOT_SERVING
        with Client(rt.target) as c, pytest.raises(grpc.RpcError) as e:
            c.info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        engine = Engine(loaded, max_batch=2, max_queue=4)
        engine.start()
        rt.set_model(loaded, engine)
        assert _health(rt.target) == S.SERVING

        seen: list[int] = []
        ch = grpc.insecure_channel(rt.target)
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SERVICE))

        def watcher() -> None:
            try:
                for resp in watch:
                    seen.append(resp.status)
                    if resp.status == S.NOT_SERVING:
                        watch.cancel()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED

        w = threading.Thread(target=watcher)
        w.start()
        with Client(rt.target) as c:
            stream = c.generate(messages=STORY, max_new_tokens=16)
            first = next(stream)  # the stream is in flight
            stopper = threading.Thread(target=rt.shutdown, kwargs={"grace": 60})
            stopper.start()
            rest = list(stream)
        stopper.join(timeout=90)
        w.join(timeout=30)
        ch.close()
        chunks = [first, *rest]
        assert chunks[-1].finish_reason == "length"
        assert sum(len(x.token_ids) for x in chunks) == 16  # finished, not cut off
        assert seen[0] == S.SERVING and seen[-1] == S.NOT_SERVING
        with Client(rt.target) as c, pytest.raises(grpc.RpcError):
            c.info(timeout=5)  # a drained runtime takes no new calls
    finally:
        rt.shutdown(grace=1)
