"""The serving benchmark's client (bench/serve_client.py, issue 36) against a real runtime (int4
SmolLM2, its OpenAI HTTP API and gRPC over loopback): it must count every token a stream
carries, time it, and bound its loops. One server (the keep-alive one) is a stand-in: it plays
a peer that closes idle connections, which no real part here does on cue."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from bench import serve_client as sc
from model_runtime.serving.openai_http import OpenAIServer
from model_runtime.serving.service import Runtime
from tests.runtime_fixtures import serving_runtime


@pytest.fixture(scope="module")
def runtime(smollm_int4) -> Iterator[Runtime]:
    rt = serving_runtime(smollm_int4, max_batch=4)
    try:
        yield rt
    finally:
        rt.shutdown(grace=5)


@pytest.fixture(scope="module")
def http_port(runtime) -> Iterator[int]:
    srv = OpenAIServer(runtime)
    try:
        yield srv.port
    finally:
        srv.stop()


def _completion_tokens(port: int, model: str, messages: list[dict[str, str]]) -> int:
    """The same call without streaming: the server's own count of the tokens it generated."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": model, "messages": messages, "max_tokens": sc.MAX_TOKENS, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    return json.loads(conn.getresponse().read())["usage"]["completion_tokens"]


def _model(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def test_every_streamed_token_is_counted_and_timed_over_http_and_grpc(runtime, http_port):
    model = _model(http_port)
    transports = {
        "openai": sc.OpenAIStream("127.0.0.1", http_port, model),
        "grpc": sc.GrpcStream(runtime.target),
    }
    want = [_completion_tokens(http_port, model, sc.messages_for(i, False, 5)) for i in range(4)]
    for name, transport in transports.items():
        recs, window = sc.closed_loop(transport, 2, 4, 120, seed=5)
        assert len(recs) == 4 and all(r.ok for r in recs), (name, [r.error for r in recs])
        assert sorted(len(r.token_times) for r in recs) == sorted(want), name
        for r in recs:
            assert r.sent < r.token_times[0] and r.token_times == sorted(r.token_times)
        # the steady window: after both streams' first (uncounted) call, before either ran out
        assert 0 < window.tokens <= sum(want) + 2 * sc.MAX_TOKENS and window.seconds > 0
        s = sc.summarize(recs, window)
        assert s["ok"] == 4 and s["ttft_p50_ms"] > 0 and s["itl_p50_ms"] is not None
        assert s["output_tok_s"] == pytest.approx(window.tokens / window.seconds)


def test_unique_prompts_share_no_leading_block_and_shared_ones_do() -> None:
    a, b = sc.unique_prompt(1), sc.unique_prompt(2)
    assert a[:12] != b[:12] and sc.unique_prompt(1) == a  # deterministic per (i, seed)
    s1, s2 = sc.shared_prompt(1), sc.shared_prompt(2)
    assert s1[0] == s2[0] and s1[1] != s2[1]


def test_the_open_loop_sends_at_most_its_calls_and_stops_at_its_deadline(http_port):
    transport = sc.OpenAIStream("127.0.0.1", http_port, _model(http_port))
    t0 = time.monotonic()
    recs, _ = sc.open_loop(transport, rate_per_s=50.0, calls=3, deadline_s=30, seed=1)
    assert len(recs) == 3 and all(r.ok for r in recs)
    recs, wall = sc.open_loop(transport, rate_per_s=0.01, calls=5, deadline_s=0.5, seed=1)
    assert recs == [] and wall < 5  # the first arrival falls after the deadline: none sent
    assert time.monotonic() - t0 < 120


def test_goodput_counts_calls_within_both_slo_bounds() -> None:
    fast = sc.Record(sent=0.0, token_times=[0.2 + 0.01 * i for i in range(10)])
    slow_first = sc.Record(sent=0.0, token_times=[1.5, 1.51])
    slow_tokens = sc.Record(sent=0.0, token_times=[0.1, 0.2, 0.3])  # 100 ms per token
    failed = sc.Record(sent=0.0, error="HTTP 503")
    assert fast.good and not slow_first.good and not slow_tokens.good and not failed.good
    s = sc.summarize([fast, slow_first, slow_tokens, failed], 2.0)
    # 15 tokens in 2 s over 3 completed calls: 7.5 tokens/s, 1.5 calls/s, 1 of 3 good
    assert s["calls"] == 4 and s["ok"] == 3 and s["calls_per_s"] == pytest.approx(1.5)
    assert s["goodput_per_s"] == pytest.approx(0.5) and s["good_share"] == 0.25


class _ClosesIdle(http.server.BaseHTTPRequestHandler):
    """Answers one streamed token, then closes the connection without saying so."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        body = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def test_a_stand_in_server_that_drops_idle_connections_costs_no_call() -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosesIdle)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        transport = sc.OpenAIStream("127.0.0.1", srv.server_address[1], "m")
        recs, _ = sc.closed_loop(transport, 1, 3, 30)  # and one uncounted call before them
        assert [len(r.token_times) for r in recs] == [1, 1, 1], [r.error for r in recs]
    finally:
        srv.shutdown()
        srv.server_close()
