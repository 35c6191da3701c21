"""The runtime's per-request records (issue 18): a greedy call's token ids by request id on the
metrics port, teacher-forced scoring of a given continuation, sampled calls not kept, the LRU
bound, and bad queries answered 400 naming the field. A real runtime over real gRPC."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model_runtime.serving.client import Client
from model_runtime.serving.records import Records
from tests.runtime_fixtures import get_json, serving_records

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def served(smollm_int4) -> Iterator[tuple[str, Client]]:
    with serving_records(smollm_int4) as (url, c, _):
        yield url, c


def _tokens(c: Client, rid: str, **kw) -> list[int]:
    chunks = c.generate(messages=MESSAGES, max_new_tokens=6, request_id=rid, **kw)
    return [t for ch in chunks for t in ch.token_ids]


def test_a_greedy_call_is_recorded_by_request_id_and_scored(served) -> None:
    url, c = served
    got = _tokens(c, "greedy-1")
    status, body = get_json(f"{url}/records?ids=greedy-1,unknown")
    assert status == 200
    rec = body["records"]["greedy-1"]
    assert list(body["records"]) == ["greedy-1"]
    assert (rec["token_ids"], rec["finish_reason"], rec["shadow"]) == (got, "length", False)
    ids = ",".join(map(str, got))
    status, score = get_json(f"{url}/score?request_id=greedy-1&token_ids={ids}")
    assert status == 200
    # teacher-forced on its own greedy answer: the model's argmax is that answer
    assert score["argmax"] == got
    assert len(score["logprobs"]) == len(got) and all(lp <= 0 for lp in score["logprobs"])


def test_a_sampled_call_is_not_recorded(served) -> None:
    url, c = served
    _tokens(c, "sampled-1", temperature=0.8, seed=3)
    status, body = get_json(f"{url}/records?ids=sampled-1")
    assert (status, body["records"]) == (200, {})


def test_bad_queries_answer_400_naming_the_field(served) -> None:
    url, c = served
    _tokens(c, "greedy-2")
    for query, field in [
        ("/records", "ids"),
        ("/score?token_ids=1", "request_id"),
        ("/score?request_id=greedy-2&token_ids=a,b", "token_ids"),
        ("/score?request_id=greedy-2&token_ids=99999999", "token_ids"),
        ("/score?request_id=greedy-2&token_ids=" + ",".join(["1"] * 8192), "token_ids"),
    ]:
        status, body = get_json(url + query)
        assert status == 400, query
        assert body["error"].startswith(field + ":"), body
    status, body = get_json(f"{url}/score?request_id=nobody&token_ids=1")
    assert status == 404 and body["error"].startswith("request_id:")


def test_records_keep_the_most_recent_up_to_their_capacity() -> None:
    r = Records(capacity=2)
    for i in range(3):
        r.add(f"id{i}", [1], [i], "stop")
    r.add("id3", [1], [3], "stop")
    assert [k for k in ("id0", "id1", "id2", "id3") if r.get(k)] == ["id2", "id3"]
