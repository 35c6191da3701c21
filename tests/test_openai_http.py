"""The OpenAI-compatible HTTP API (issue 17) with the real `openai` SDK, over loopback HTTP, in
front of a real runtime (engine, int4 SmolLM2): one runtime for the module."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from mesh_common.headers import PROMPT_TOKENS_HEADER, REPLICA_HEADER, TENANT_HEADER
from model_runtime.serving.client import Client
from model_runtime.serving.faults import Faults
from model_runtime.serving.openai_http import OpenAIServer
from model_runtime.serving.service import Runtime
from tests.runtime_fixtures import serving_runtime

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
ANSWER = "The capital of France is Paris."  # greedy (docs/ARCHITECTURE.md: the deterministic check)
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


@pytest.fixture(scope="module")
def runtime(smollm_int4) -> Iterator[Runtime]:
    rt = serving_runtime(smollm_int4, replica_id="replica-h")
    try:
        yield rt
    finally:
        rt.shutdown(grace=5)


@pytest.fixture(scope="module")
def server(runtime) -> Iterator[OpenAIServer]:
    srv = OpenAIServer(runtime)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    url = f"http://127.0.0.1:{server.port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=QUESTION, **kw)


def test_models_lists_the_served_model(client, runtime) -> None:
    ids = [m.id for m in client.models.list().data]
    # by default a slug of the weight file's name (issue 37), not the metadata's spaced name
    assert ids == ["smollm2-135m-instruct.q4_1"] != [runtime.service.model_info.name]
    assert client.models.retrieve(ids[0]).id == ids[0]
    for name in (ids[0].upper(), runtime.service.model_info.name):  # both still accepted
        r = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)
        assert r.model == name and r.usage.completion_tokens == 1
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-nothing")
    assert e.value.code == "model_not_found"


def test_chat_greedy_answers_with_usage(client, model, runtime) -> None:
    r = _chat(client, model, temperature=0, max_tokens=20)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ANSWER
    assert choice.finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model
    assert r.system_fingerprint == runtime.service.model_info.version
    prompt = runtime.service.loaded.tokenizer.encode_chat(QUESTION)
    assert r.usage.prompt_tokens == len(prompt)
    assert 0 < r.usage.completion_tokens < 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_carries_the_same_answer_and_usage(client, model) -> None:
    whole = _chat(client, model, temperature=0, max_tokens=20)
    events = list(
        _chat(
            client,
            model,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == ANSWER
    finishes = [e.choices[0].finish_reason for e in events if e.choices]
    assert finishes[-1] == "stop" and not any(finishes[:-1])
    assert events[-1].choices == [] and events[-1].usage == whole.usage
    assert all(e.usage is None for e in events[:-1])
    assert len({e.id for e in events}) == 1 and events[0].object == "chat.completion.chunk"


def test_max_tokens_cuts_the_answer_and_counts_every_streamed_token(client, model) -> None:
    r = _chat(client, model, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert ANSWER.startswith(r.choices[0].message.content)
    events = list(
        _chat(
            client,
            model,
            temperature=0,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == r.choices[0].message.content
    assert events[-1].usage.completion_tokens == 3


def test_stop_sequence_ends_the_answer_before_it(client, model) -> None:
    r = _chat(client, model, temperature=0, max_tokens=20, stop=[" Paris"])
    assert r.choices[0].message.content == "The capital of France is"
    assert r.choices[0].finish_reason == "stop"
    events = list(_chat(client, model, temperature=0, max_tokens=20, stop=" Paris", stream=True))
    assert "".join(e.choices[0].delta.content or "" for e in events) == "The capital of France is"


def test_completions_with_and_without_stream(client, model) -> None:
    r = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=4
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == 5  # SmolLM2's tokenizer: The| capital| of| France| is
    events = list(
        client.completions.create(
            model=model, prompt="The capital of France is", temperature=0, max_tokens=4, stream=True
        )
    )
    assert "".join(e.choices[0].text for e in events) == r.choices[0].text
    assert events[-1].choices[0].finish_reason == "length"


def test_completions_take_token_ids(client, model, runtime) -> None:
    ids = runtime.service.loaded.tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=4)
    by_text = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=4
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_seeded_sampling_is_reproducible(client, model) -> None:
    kw = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 8}
    a = client.chat.completions.create(model=model, messages=STORY, **kw)
    b = client.chat.completions.create(model=model, messages=STORY, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    events = list(client.chat.completions.create(model=model, messages=STORY, stream=True, **kw))
    streamed = "".join(e.choices[0].delta.content or "" for e in events)
    assert streamed == a.choices[0].message.content


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_completion_tokens", {"max_completion_tokens": 100_000}),
        ("temperature", {"temperature": 2.5}),
        ("top_p", {"top_p": 0}),
        ("seed", {"seed": "seven"}),
        ("n", {"n": 2}),
        ("stop", {"stop": [str(i) for i in range(17)]}),
        ("stop[0]", {"stop": [""]}),
        ("logprobs", {"logprobs": True}),
        ("presence_penalty", {"presence_penalty": 0.5}),
        ("messages", {"messages": []}),
        ("messages", {"messages": [{"role": "user", "content": "dragon " * 9000}]}),  # > context
        ("messages[0].role", {"messages": [{"role": "wizard", "content": "hi"}]}),
        ("messages[0].content", {"messages": [{"role": "user"}]}),
        ("frobnicate", {"extra_body": {"frobnicate": 1}}),
    ],
)
def test_bad_requests_name_the_field(client, model, field, kw) -> None:
    kw.setdefault("messages", QUESTION)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, **kw)
    assert e.value.param == field
    assert e.value.message.startswith(f"{field}: ") or field in e.value.message
    assert e.value.type == "invalid_request_error"


def test_bad_completion_prompts_name_the_field(client, model) -> None:
    for prompt in (["one", "two"], [1, "x"], [49152], [1 << 40], [-1]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert e.value.param == "prompt"


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nothing", messages=QUESTION, max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert "gpt-nothing" in e.value.message


def _post(port: int, path: str, body: bytes, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body, {"content-type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def _invalid(runtime: Runtime) -> int:
    return runtime.telemetry.snapshot()["totals"].get("Generate", {}).get("INVALID_ARGUMENT", 0)


def test_raw_http_errors_are_openai_shaped(server, runtime) -> None:
    before = _invalid(runtime)
    for body, status in ((b"{not json", 400), (b"[]", 400)):
        conn, r = _post(server.port, "/v1/chat/completions", body)
        err = json.loads(r.read())["error"]
        assert r.status == status and set(err) == {"message", "type", "param", "code"}
        conn.close()
    lone = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    conn, r = _post(server.port, "/v1/chat/completions", lone)
    assert r.status == 400 and "not valid Unicode" in json.loads(r.read())["error"]["message"]
    conn.close()
    assert _invalid(runtime) == before + 3  # counted as a gRPC call's INVALID_ARGUMENT is
    # An oversized body is refused from its headers, before it is sent (or read).
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
            b"expect: 100-continue\r\n\r\n" % (5 << 20)
        )
        r = http.client.HTTPResponse(s)
        r.begin()
        assert r.status == 413 and "5242880 bytes" in json.loads(r.read())["error"]["message"]
    conn, r = _post(server.port, "/v1/embeddings", b"{}")
    assert r.status == 404 and json.loads(r.read())["error"]["code"] == "unknown_url"
    conn.close()


def test_keep_alive_serves_calls_in_turn(server, model) -> None:
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 2}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    sockets = set()
    for stream in (False, True, False):
        conn.request("POST", "/v1/chat/completions", json.dumps(body | {"stream": stream}))
        r = conn.getresponse()
        payload = r.read()
        assert r.status == 200, payload
        sockets.add(id(conn.sock))
        if stream:
            assert payload.rstrip().endswith(b"data: [DONE]")
    conn.close()
    assert len(sockets) == 1  # one connection for the three calls


def test_response_headers_carry_replica_and_prompt_tokens(server, model) -> None:
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 2}
    conn, r = _post(server.port, "/v1/chat/completions", json.dumps(body).encode())
    usage = json.loads(r.read())["usage"]
    assert r.headers[REPLICA_HEADER] == "replica-h"
    assert int(r.headers[PROMPT_TOKENS_HEADER]) == usage["prompt_tokens"]
    conn.close()


def test_a_client_leaving_mid_stream_cancels_its_generation(server, model, runtime) -> None:
    def cancelled() -> int:
        return runtime.telemetry.snapshot()["totals"].get("Generate", {}).get("CANCELLED", 0)

    before = cancelled()
    body = {"model": model, "messages": STORY, "max_tokens": 2000, "stream": True, "seed": 1}
    conn, r = _post(
        server.port, "/v1/chat/completions", json.dumps(body).encode(), {TENANT_HEADER: "acme"}
    )
    assert r.status == 200
    assert r.readline().startswith(b"data: {")  # the first token's event
    tenants = runtime.engine.stats()["tenants"]
    assert tenants.get("acme", {}).get("running") == 1  # the verified header's tenant
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and runtime.engine.stats()["running"]:
        time.sleep(0.05)
    assert runtime.engine.stats()["running"] == 0
    assert cancelled() == before + 1


@pytest.fixture
def private(smollm_int4) -> Iterator:
    """make(**kw) -> (runtime, HTTP port, SDK client): a runtime of its own (serving_runtime's
    keywords) on the module's model, with its HTTP server."""
    made: list[tuple[Runtime, OpenAIServer, openai.OpenAI]] = []

    def make(**kw) -> tuple[Runtime, int, openai.OpenAI]:
        rt = serving_runtime(smollm_int4, **kw)
        srv = OpenAIServer(rt)
        url = f"http://127.0.0.1:{srv.port}/v1"
        made.append((rt, srv, openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120)))
        return rt, srv.port, made[-1][2]

    yield make
    for rt, srv, c in made:
        c.close()
        srv.stop()
        rt.shutdown(grace=0)


def test_a_served_model_name_is_listed_and_accepted_on_both_apis(private) -> None:
    """vLLM's --served-model-name: the service's name as the body's `model` (issue 17)."""
    rt, _, c = private(served_model_names=("llm", "chat"))
    assert [m.id for m in c.models.list().data] == ["llm", "chat"]
    assert c.models.retrieve("chat").id == "chat"
    r = c.chat.completions.create(model="llm", messages=QUESTION, temperature=0, max_tokens=20)
    assert r.model == "llm" and r.choices[0].message.content == ANSWER
    with pytest.raises(openai.NotFoundError) as e:  # only the served names are listed
        c.models.retrieve(rt.service.model_info.name)
    assert e.value.code == "model_not_found"
    with Client(rt.target) as grpc_client:
        chunks = list(grpc_client.generate(messages=QUESTION, model="chat", max_new_tokens=2))
    assert sum(len(ch.token_ids) for ch in chunks) == 2


def test_a_full_queue_is_429(private) -> None:
    rt, _, c = private(max_queue=0)  # every call finds the queue full
    model = rt.service.model_info.name
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, stream=stream)
        assert e.value.code == "rate_limit_exceeded" and "queue full" in e.value.message


def test_a_runtime_failure_before_the_first_token_is_500(private) -> None:
    rt, _, c = private(faults=Faults(poison="dragon", poison_action="error"))
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model=rt.service.model_info.name, messages=STORY, max_tokens=2)
    assert e.value.status_code == 500 and e.value.type == "server_error"


def test_an_error_mid_stream_is_an_error_event(private) -> None:
    rt, _, c = private()
    stream = c.chat.completions.create(
        model=rt.service.model_info.name,
        messages=STORY,
        temperature=0,
        max_tokens=2000,
        stream=True,
    )
    events = iter(stream)
    assert next(events).choices[0].delta.role == "assistant"
    threading.Thread(target=rt.engine.shutdown, args=(0,)).start()  # cancels what runs
    with pytest.raises(openai.APIError) as e:
        for _ in events:
            pass
    assert e.value.code == "service_unavailable" and "cancelled by the runtime" in e.value.message


def test_a_client_leaving_while_queued_leaves_the_queue(private) -> None:
    rt, port, c = private(max_batch=1)
    model = rt.service.model_info.name
    body = {"model": model, "messages": STORY, "max_tokens": 1000, "temperature": 0}
    running = c.chat.completions.create(**body, stream=True)
    next(iter(running))  # the one stream the batch holds
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body))  # waits in the queue
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and rt.engine.stats()["queue_depth"] == 0:
        time.sleep(0.02)
    assert rt.engine.stats()["queue_depth"] == 1
    conn.close()  # before a token: nothing was written that could fail
    while time.monotonic() < deadline and rt.engine.stats()["queue_depth"]:
        time.sleep(0.05)
    stats = rt.engine.stats()
    assert stats["queue_depth"] == 0 and stats["running"] == 1
    running.close()


def test_not_ready_is_503() -> None:
    rt = Runtime().start()  # no model yet: health NOT_SERVING, HTTP 503
    srv = OpenAIServer(rt)
    try:
        url = f"http://127.0.0.1:{srv.port}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                c.chat.completions.create(model="m", messages=QUESTION)
            assert e.value.status_code == 503 and e.value.code == "service_unavailable"
            with pytest.raises(openai.InternalServerError):
                c.models.list()
    finally:
        srv.stop()
        rt.shutdown(0)


def test_meshlm_serve_http_port(tmp_path) -> None:
    """`meshlm serve --http-port 0 --served-model-name llm` prints the port it bound and answers
    there under that name; SIGTERM drains."""
    cmd = [sys.executable, "-m", "meshlm.cli", "serve", "--port", "0", "--http-port", "0"]
    cmd += ["--served-model-name", "llm"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "--max-batch", "1"], stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        port = None
        for line in proc.stdout:  # "meshlm serve: grpc H:P metrics - http P (loading ...)"
            words = line.split()
            if line.startswith("meshlm serve: grpc "):
                port = int(words[words.index("http") + 1])
            if "SERVING" in line:
                break
        assert port and proc.poll() is None, (tmp_path / "serve.log").read_text()
        url = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
            assert [m.id for m in c.models.list().data] == ["llm"]
            r = c.chat.completions.create(
                model="llm", messages=QUESTION, temperature=0, max_tokens=20
            )
        assert r.choices[0].message.content == ANSWER
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        log.close()
