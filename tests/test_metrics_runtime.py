"""The runtime's `GET /metrics` is Prometheus text that promtool accepts, with vLLM's metric
names under our prefix and buckets fit for token latencies; its JSON moved to /metrics.json
(issue 16). On a real runtime serving the real model over gRPC."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.serving.client import Client
from model_runtime.serving.prometheus import MAX_TENANTS, OTHER_TENANT
from model_runtime.serving.telemetry import MetricsServer, Telemetry
from tests.promtool_support import check_metrics, scrape
from tests.runtime_fixtures import serving_runtime
from xds_server.rollout.gates.fetch import MeasurementError
from xds_server.rollout.gates.runtime_metrics import RuntimeMetricsSource

SECRET_KEY = "sk-do-not-log-4f1c2a"
PROMPT = "Describe a violet giraffe in one sentence."


@pytest.fixture(scope="module")
def served(smollm_int4) -> Iterator[tuple[str, MetricsServer]]:
    rt = serving_runtime(smollm_int4)
    try:
        with MetricsServer(rt.telemetry) as m, Client(rt.target) as c:
            md = (("x-meshlm-tenant", "acme"), ("x-api-key", SECRET_KEY))
            messages = [{"role": "user", "content": PROMPT}]
            chunks = list(c.generate(messages=messages, max_new_tokens=6, metadata=md))
            assert sum(len(ch.token_ids) for ch in chunks) == 6
            with pytest.raises(grpc.RpcError) as bad:  # counted by its status
                list(c.generate(prompt_token_ids=[10**8], max_new_tokens=2, metadata=md))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            yield f"http://127.0.0.1:{m.port}", m
    finally:
        rt.shutdown(grace=5)


def _families(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _value(fam, suffix: str = "", **labels: str) -> float:
    for s in fam.samples:
        if s.name == fam.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {fam.name}{suffix} {labels} in {fam.samples}")


def _bounds(fam) -> list[float]:
    return [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")]


def test_metrics_is_prometheus_text_promtool_accepts(served) -> None:
    url, _ = served
    content_type, body = scrape(url + "/metrics")
    assert content_type.startswith("text/plain; version=0.0.4")
    check_metrics(body)
    fams = _families(body)
    ttft = fams["meshlm_time_to_first_token_seconds"]
    assert ttft.type == "histogram" and _value(ttft, "_count") == 1
    itl = fams["meshlm_inter_token_latency_seconds"]
    assert 1 <= _value(itl, "_count") <= 5  # six tokens: up to five gaps between them
    assert _value(fams["meshlm_e2e_request_latency_seconds"], "_count") == 2  # any status
    assert _value(fams["meshlm_request_queue_time_seconds"], "_count") == 1
    requests = fams["meshlm_requests"]
    assert _value(requests, "_total", method="Generate", code="OK", tenant="acme") == 1
    assert (
        _value(requests, "_total", method="Generate", code="INVALID_ARGUMENT", tenant="acme") == 1
    )
    assert _value(fams["meshlm_num_requests_running"]) == 0
    assert _value(fams["meshlm_num_requests_waiting"]) == 0
    assert 0 <= _value(fams["meshlm_kv_cache_usage_perc"]) <= 1
    assert _value(fams["meshlm_generation_tokens"], "_total") >= 6
    for name in (
        "meshlm_prefix_cache_hits",
        "meshlm_prefix_cache_queries",
        "meshlm_nonfinite_fallbacks",
        "meshlm_request_resumes",
    ):
        assert fams[name].type == "counter"


def test_buckets_fit_token_latencies(served) -> None:
    """Milliseconds between tokens, up to a minute to the first token, minutes for a stream:
    the client library's default buckets (5 ms .. 10 s) would put every gap in one bucket."""
    _, body = scrape(served[0] + "/metrics")
    fams = _families(body)
    itl = _bounds(fams["meshlm_inter_token_latency_seconds"])
    assert itl[0] <= 0.001 and sum(b <= 0.05 for b in itl) >= 8
    assert _bounds(fams["meshlm_time_to_first_token_seconds"])[-2] >= 60
    assert _bounds(fams["meshlm_e2e_request_latency_seconds"])[-2] >= 120


def test_no_key_or_prompt_in_the_exposition(served) -> None:
    _, body = scrape(served[0] + "/metrics")
    assert SECRET_KEY.encode() not in body and b"giraffe" not in body


def test_json_moved_to_metrics_json_and_gates_still_read_it(served) -> None:
    url, _ = served
    with urllib.request.urlopen(url + "/metrics.json", timeout=10) as r:
        assert r.headers["content-type"] == "application/json"
        doc = json.loads(r.read())
    assert doc["totals"]["Generate"] == {"OK": 1, "INVALID_ARGUMENT": 1}
    reading = RuntimeMetricsSource(url + "/metrics.json").read()
    assert reading.samples == 1 and reading.ttft_p99 is not None


def test_a_mesh_file_naming_the_old_url_gets_a_clear_error(served) -> None:
    with pytest.raises(MeasurementError, match=r"Prometheus text, not JSON.*/metrics\.json"):
        RuntimeMetricsSource(served[0] + "/metrics").read()


def test_tenant_label_values_are_capped() -> None:
    """The tenant label comes from a header; a runtime reached around its sidecar could be sent
    any number of values, each a new series."""
    tel = Telemetry()
    for i in range(MAX_TENANTS + 50):
        tel.record("Generate", "OK", tenant=f"t{i}")
    body = tel.prom.exposition()
    check_metrics(body)
    fam = _families(body)["meshlm_requests"]
    tenants = {s.labels["tenant"] for s in fam.samples if s.name == "meshlm_requests_total"}
    assert len(tenants) == MAX_TENANTS + 1
    assert _value(fam, "_total", tenant=OTHER_TENANT) == 50


def test_tokens_are_counted_by_tenant_and_model_id(served, smollm_int4) -> None:
    """Usage accounting (issue 37, item 3): the prompt and streamed tokens of the call the engine
    ran, labelled by the verified tenant and the served model id; the refused call adds none."""
    _, body = scrape(served[0] + "/metrics")
    check_metrics(body)
    fams = _families(body)
    labels = {"tenant": "acme", "model": "smollm2-135m-instruct.q4_1"}
    prompt = smollm_int4.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    assert _value(fams["meshlm_tenant_prompt_tokens"], "_total", **labels) == len(prompt)
    assert _value(fams["meshlm_tenant_generation_tokens"], "_total", **labels) == 6
    samples = fams["meshlm_tenant_generation_tokens"].samples
    assert {s.labels["model"] for s in samples} == {labels["model"]}
