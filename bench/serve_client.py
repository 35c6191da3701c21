"""The serving benchmark's light client: one thread per stream, each with its own keep-alive
connection, timing every streamed token as it arrives (issue 36).

A call is one streaming chat completion (OpenAI HTTP: server-sent events) or one Generate stream
(gRPC + FlatBuffers). Its record holds when it was sent, when each token arrived and how many came;
TTFT, inter-token times and goodput come from those. The threads pin themselves to one CPU when
asked (`cpu`), so the client takes the same share of the machine beside every server it drives.

Closed loop (`closed_loop`): N streams, each sending its next call when the last one ended.
Open loop (`open_loop`): calls sent at Poisson arrival times, whether or not earlier ones ended.
Both are bounded in calls and in seconds and stop by themselves.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from model_runtime.serving.client import Client

MAX_TOKENS = 64
CALL_TIMEOUT_S = 120.0

# The SLO goodput counts by (issue 36): a call is good when its TTFT and its mean inter-token time
# (time per output token after the first, as DistServe's TPOT) are both within these.
SLO_TTFT_S = 1.0
SLO_ITL_S = 0.050

_TEXT = (
    "river market engine garden silver winter signal harbor pattern lantern orbit canyon "
    "ledger meadow quartz rhythm saddle timber velvet wander anchor bridge candle desert "
    "feather glacier hollow island jungle kettle ladder mirror needle oyster pepper "
    "quiver ribbon shadow thunder umbrella valley whistle yonder zephyr amber basalt "
    "cobalt delta"
)
_WORDS = tuple(_TEXT.split(" "))


def unique_prompt(i: int, words: int = 110, seed: int = 0) -> str:
    """A chat prompt of about 150 tokens that shares no leading KV block with any other: its
    first words are its own number and random words."""
    rng = random.Random(seed * 1_000_003 + i)
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Note {i}-{seed}: {body}. Write a long story that uses these words."


SHARED_SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in plain English, in full "
    "sentences, and keep to the facts you are given. "
    + " ".join(_WORDS * 2)
    + ". Never invent an order number."
)


def shared_prompt(i: int, seed: int = 0) -> list[dict[str, str]]:
    """The shared-prefix variant: the same ~150-token system prompt, then a short question of
    its own."""
    rng = random.Random(seed * 1_000_003 + i)
    q = " ".join(rng.choice(_WORDS) for _ in range(12))
    return [
        {"role": "system", "content": SHARED_SYSTEM},
        {"role": "user", "content": f"Question {i}: {q}. Tell a long story about it."},
    ]


def messages_for(i: int, shared: bool, seed: int = 0) -> list[dict[str, str]]:
    return (
        shared_prompt(i, seed)
        if shared
        else [{"role": "user", "content": unique_prompt(i, seed=seed)}]
    )


@dataclass
class Record:
    sent: float
    token_times: list[float] = field(default_factory=list)  # arrival of each token (monotonic)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def good(self) -> bool:
        return self.ok and self.ttft <= SLO_TTFT_S and (self.tpot is None or self.tpot <= SLO_ITL_S)


# ---- transports: each returns a function that makes one call and fills a Record ----


class OpenAIStream:
    """Streaming chat completions over HTTP/1.1 keep-alive; one token per `content` delta (both
    meshlm and llama-server send one delta per token)."""

    def __init__(self, host: str, port: int, model: str, api_key: str | None = None) -> None:
        self.host, self.port, self.model = host, port, model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self) -> Callable[[list[dict[str, str]], Record], None]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=CALL_TIMEOUT_S)

        def send(body: str) -> http.client.HTTPResponse:
            try:
                conn.request("POST", "/v1/chat/completions", body, self.headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # the server closed the idle keep-alive connection (llama-server does): once
                # more on a new one, as HTTP clients' connection pools do
                conn.close()
                conn.request("POST", "/v1/chat/completions", body, self.headers)
                return conn.getresponse()

        def call(messages: list[dict[str, str]], rec: Record) -> None:
            body = {
                "model": self.model,
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
            }
            resp = send(json.dumps(body))
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return
            for line in _sse_lines(resp):
                if line == b"[DONE]":
                    break
                chunk = json.loads(line)
                for choice in chunk.get("choices", ()):
                    if (choice.get("delta") or {}).get("content"):
                        rec.token_times.append(time.monotonic())
            resp.read()

        return call


def _sse_lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


class GrpcStream:
    """Generate streams over one gRPC channel per stream thread; a token per token id."""

    def __init__(self, target: str) -> None:
        self.target = target

    def connect(self) -> Callable[[list[dict[str, str]], Record], None]:
        client = Client(self.target)

        def call(messages: list[dict[str, str]], rec: Record) -> None:
            chunks = client.generate(
                messages=messages,
                max_new_tokens=MAX_TOKENS,
                temperature=0.0,
                timeout=CALL_TIMEOUT_S,
                mirror=False,
            )
            for chunk in chunks:
                if chunk.error is not None:
                    rec.error = chunk.error.message
                    return
                now = time.monotonic()
                rec.token_times.extend([now] * len(chunk.token_ids))

        return call


# ---- load shapes ----


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: affinity is per thread)


def _guarded(call: Callable[[list[dict[str, str]], Record], None], msgs, rec: Record) -> None:
    try:
        call(msgs, rec)
    except Exception as e:  # a failed call is a record with an error, never a dead stream
        rec.error = f"{type(e).__name__}: {e}"


@dataclass
class Window:
    """Where a closed loop is steady: from when every stream has sent its first counted call to
    when the first stream sent its last one's last token; every token that arrived in between
    (counted call or not) over its length."""

    tokens: int
    seconds: float


def closed_loop(
    transport: OpenAIStream | GrpcStream,
    streams: int,
    calls: int,
    deadline_s: float,
    *,
    shared: bool = False,
    cpu: int | None = None,
    seed: int = 0,
) -> tuple[list[Record], Window]:
    """`streams` streams, each sending its next call when its last one ended: first one call
    that is not counted (the streams start together, so their first calls measure a start-up
    burst, not the load), then `calls` counted calls among them, until the calls or `deadline_s`
    run out. Returns the counted records and the steady window."""
    lock = threading.Lock()
    taken = iter(range(calls))
    counted: list[Record] = []
    mine: list[list[Record]] = [[] for _ in range(streams)]
    end = time.monotonic() + deadline_s

    def stream(k: int) -> None:
        _pin(cpu)
        call = transport.connect()
        first = True
        while time.monotonic() < end:
            with lock:
                i = -1 - k if first else next(taken, None)
            if i is None:
                return
            rec = Record(sent=time.monotonic())
            _guarded(call, messages_for(i, shared, seed), rec)
            mine[k].append(rec)
            if not first:
                with lock:
                    counted.append(rec)
            first = False

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=deadline_s + CALL_TIMEOUT_S)
    return counted, _steady([m for m in mine if len(m) > 1])


def _steady(per_stream: list[list[Record]]) -> Window:
    if not per_stream:
        return Window(0, 0.0)
    w0 = max(m[1].sent for m in per_stream)
    w1 = min((m[-1].token_times or [m[-1].sent])[-1] for m in per_stream)
    if w1 <= w0:  # too few calls for a steady window: all of it
        w0 = min(m[0].sent for m in per_stream)
        w1 = max((m[-1].token_times or [m[-1].sent])[-1] for m in per_stream)
    n = sum(w0 <= t <= w1 for m in per_stream for r in m for t in r.token_times)
    return Window(n, w1 - w0)


def open_loop(
    transport: OpenAIStream | GrpcStream,
    rate_per_s: float,
    calls: int,
    deadline_s: float,
    *,
    shared: bool = False,
    cpu: int | None = None,
    seed: int = 0,
    max_in_flight: int = 32,
) -> tuple[list[Record], float]:
    """`calls` calls at Poisson arrivals of `rate_per_s`, each on a connection of its own
    thread; no more than `max_in_flight` at once (an arrival beyond that is counted as failed,
    not queued in the client, so the server's own queueing is what the figures show)."""
    rng = random.Random(seed)
    records: list[Record] = []
    lock = threading.Lock()
    in_flight = threading.Semaphore(max_in_flight)
    threads: list[threading.Thread] = []

    def one(i: int, rec: Record) -> None:
        _pin(cpu)
        try:
            _guarded(transport.connect(), messages_for(i, shared, seed), rec)
        finally:
            in_flight.release()
        with lock:
            records.append(rec)

    t0 = time.monotonic()
    at = t0
    for i in range(calls):
        at += rng.expovariate(rate_per_s)
        if at > t0 + deadline_s:
            break
        time.sleep(max(0.0, at - time.monotonic()))
        rec = Record(sent=time.monotonic())
        if not in_flight.acquire(blocking=False):
            rec.error = "client: too many calls in flight"
            with lock:
                records.append(rec)
            continue
        t = threading.Thread(target=one, args=(i, rec), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=CALL_TIMEOUT_S)
    return records, time.monotonic() - t0


# ---- figures ----


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(records: list[Record], window: Window | float) -> dict[str, float | int | None]:
    """Latency figures of `records`; output tok/s over `window` (a closed loop's steady window,
    or an open loop's wall time: every record's tokens over it)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    if not isinstance(window, Window):
        window = Window(sum(len(r.token_times) for r in ok), window)
    per_call = statistics.mean(len(r.token_times) for r in ok) if ok else None
    tok_s = window.tokens / window.seconds if window.seconds > 0 else None
    calls_s = tok_s / per_call if tok_s is not None and per_call else None
    good = sum(r.good for r in records)
    ms = 1000.0
    return {
        "calls": len(records),
        "ok": len(ok),
        "ttft_p50_ms": None if not ttft else _pct(ttft, 0.5) * ms,
        "ttft_p99_ms": None if not ttft else _pct(ttft, 0.99) * ms,
        "itl_p50_ms": None if not gaps else _pct(gaps, 0.5) * ms,
        "itl_p99_ms": None if not gaps else _pct(gaps, 0.99) * ms,
        "tokens_per_call": per_call,
        "output_tok_s": tok_s,
        "calls_per_s": calls_s,
        "goodput_per_s": None if calls_s is None else calls_s * good / len(ok),
        "good_share": good / len(records) if records else None,
    }
