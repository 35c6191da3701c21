"""A mirrored copy at the runtime (issue 18), `x-meshlm-shadow: 1` as the canary's sidecar sets
it: recorded with `shadow: true` under the `x-request-id` Envoy copied to it, fetched by a
monotonic seq (`/records?shadow=1&since=SEQ`), counted apart from the series the traffic gates
read, and refused before any generation when it is not greedy. One real runtime, real gRPC."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.serving.client import Client
from model_runtime.serving.records import Records
from model_runtime.serving.service import Runtime
from tests.runtime_fixtures import get_json, serving_records

MESSAGES = [{"role": "user", "content": "Name a colour."}]
SHADOW = ("x-meshlm-shadow", "1")


@pytest.fixture(scope="module")
def served(smollm_int4) -> Iterator[tuple[str, Client, Runtime]]:
    with serving_records(smollm_int4) as served:
        yield served


def _counts(url: str) -> dict[str, float]:
    """What a traffic gate reads (both pages), and the shadow counters."""
    _, snap = get_json(url + "/metrics.json")
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    out = {
        "json_generate": sum(snap["totals"].get("Generate", {}).values()),
        "json_ttft": sum(snap["histograms"]["ttft"]),
        "json_tpot": sum(snap["histograms"]["tpot"]),
        "json_shadow_ok": snap["shadow_requests"].get("OK", 0),
        "json_shadow_refused": snap["shadow_requests"].get("FAILED_PRECONDITION", 0),
    }
    for fam in fams.values():
        for s in fam.samples:
            if s.name == "meshlm_requests_total" and s.labels["method"] == "Generate":
                out["prom_generate"] = out.get("prom_generate", 0) + s.value
            elif s.name in (
                "meshlm_time_to_first_token_seconds_count",
                "meshlm_inter_token_latency_seconds_count",
                "meshlm_e2e_request_latency_seconds_count",
                "meshlm_request_queue_time_seconds_count",
            ):
                out[s.name] = s.value
            elif s.name == "meshlm_shadow_requests_total":
                out[f"prom_shadow_{s.labels['code']}"] = s.value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted({*before, *after})}


def _tokens(c: Client, **kw) -> list[int]:
    return [t for ch in c.generate(messages=MESSAGES, max_new_tokens=5, **kw) for t in ch.token_ids]


def test_a_shadow_is_recorded_by_x_request_id_and_counted_apart(served) -> None:
    url, c, _ = served
    _, first = get_json(f"{url}/records?since=0")
    since = first["next_since"]
    before = _counts(url)
    shadow = _tokens(c, metadata=[SHADOW, ("x-request-id", "envoy-rid-1")])
    after_shadow = _counts(url)
    normal = _tokens(c, request_id="caller-1")
    after = _counts(url)

    # the shadow moved nothing a traffic gate reads, only the shadow counters
    d = _delta(before, after_shadow)
    assert {k: v for k, v in d.items() if v} == {"json_shadow_ok": 1, "prom_shadow_OK": 1}
    # the caller's call counts as before
    d = _delta(after_shadow, after)
    assert d["json_generate"] == d["prom_generate"] == d["json_ttft"] == d["json_tpot"] == 1
    assert d["meshlm_time_to_first_token_seconds_count"] == 1
    assert d["json_shadow_ok"] == 0

    status, new = get_json(f"{url}/records?shadow=1&since={since}")
    assert status == 200 and new["more"] is False and new["instance"] == first["instance"]
    (rid, rec), = new["records"].items()  # fmt: skip
    assert rid == "envoy-rid-1" and rec["shadow"] is True and rec["token_ids"] == shadow
    assert rec["finish_reason"] == "length" and rec["seq"] > since
    assert "prompt_ids" not in rec  # the prompt never leaves the runtime

    # nothing new after next_since; both kinds without the filter, in seq order
    status, again = get_json(f"{url}/records?shadow=1&since={new['next_since']}")
    assert status == 200 and again["records"] == {} and again["next_since"] == new["next_since"]
    _, both = get_json(f"{url}/records?since={since}")
    assert list(both["records"]) == ["envoy-rid-1", "caller-1"]
    assert both["records"]["caller-1"]["shadow"] is False
    assert both["records"]["caller-1"]["token_ids"] == normal
    assert both["records"]["caller-1"]["seq"] > rec["seq"]
    _, plain = get_json(f"{url}/records?shadow=0&since={since}")
    assert list(plain["records"]) == ["caller-1"]
    _, by_id = get_json(f"{url}/records?ids=envoy-rid-1,caller-1&shadow=1")
    assert list(by_id["records"]) == ["envoy-rid-1"]

    # the join's next step: the shadow's record scores a continuation (its own answer here)
    ids = ",".join(map(str, shadow))
    status, score = get_json(f"{url}/score?request_id=envoy-rid-1&token_ids={ids}")
    assert status == 200 and score["argmax"] == shadow


def test_a_shadow_that_is_not_greedy_is_refused_before_generation(served) -> None:
    url, c, rt = served
    before, engine_before = _counts(url), rt.engine.stats()
    cases = [
        ({"temperature": 0.7, "request_id": "s-sampled"}, "temperature 0.7"),
        ({"resume_token_ids": [42], "request_id": "s-resumed"}, "resume_token_ids"),
        ({}, "no request_id"),  # nothing to record it under, nothing to join
    ]
    for params, why in cases:
        with pytest.raises(grpc.RpcError) as e:
            _tokens(c, metadata=[SHADOW], **params)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith("x-meshlm-shadow: a mirrored call must be greedy")
        assert why in e.value.details()
    engine_after = rt.engine.stats()
    for k in ("requests_admitted", "tokens_generated", "prefix_hit_tokens"):
        assert engine_after[k] == engine_before[k], k  # no generation, not even a prefill
    d = _delta(before, _counts(url))
    assert {k: v for k, v in d.items() if v} == {
        "json_shadow_refused": 3,
        "prom_shadow_FAILED_PRECONDITION": 3,
    }
    _, got = get_json(f"{url}/records?ids=s-sampled,s-resumed")
    assert got["records"] == {}


def test_records_queries_name_their_bad_field(served) -> None:
    url, _, _ = served
    for query, field in [
        ("/records?since=-1", "since"),
        ("/records?since=x", "since"),
        ("/records?since=0&shadow=maybe", "shadow"),
        ("/records?since=0&ids=a", "ids"),
        ("/records?shadow=1", "ids"),
    ]:
        status, body = get_json(url + query)
        assert status == 400, query
        assert body["error"].startswith(field + ":"), body


def test_since_pages_through_new_records_in_seq_order() -> None:
    r = Records(capacity=4)
    for i in range(6):  # the LRU keeps the last 4: seq 3..6
        r.add(f"id{i}", [1], [i], "stop", shadow=i % 2 == 1)
    page, nxt, more = r.since(0, limit=3)
    assert ([k for k, _ in page], nxt, more) == (["id2", "id3", "id4"], 5, True)
    page, nxt, more = r.since(nxt, limit=3)
    assert ([k for k, _ in page], nxt, more) == (["id5"], 6, False)
    page, nxt, more = r.since(0, shadow=True, limit=1)
    assert ([k for k, _ in page], nxt, more) == (["id3"], 4, True)
    page, nxt, more = r.since(nxt, shadow=True, limit=1)
    assert ([k for k, _ in page], nxt, more) == (["id5"], 6, False)
    r.add("id3", [1], [9], "stop")  # a key answered again moves to the newest seq
    assert [(k, rec.seq) for k, rec in r.since(6)[0]] == [("id3", 7)]
