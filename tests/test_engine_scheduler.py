"""The engine on the real model: continuous batching, prefix reuse, cancel, admission, stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from model_runtime.engine.engine import Engine, EngineFull, GenerateParams, TokenEvent

PROMPTS = [
    "What is the capital of France? Answer with one word.",
    "What is 2+2?",
    "Name three colors.",
    "Write a haiku about the sea.",
]
TIMEOUT = 120


class Stream:
    """Collects one request's events (on_event runs on the engine thread)."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, ev: TokenEvent) -> None:
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()

    def wait(self) -> Stream:
        assert self.done.wait(TIMEOUT), "request did not finish"
        return self

    @property
    def ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text_delta for e in self.events)

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish_reason


def chat(loaded, prompt: str, **kw) -> GenerateParams:
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return GenerateParams(prompt_ids=ids, **{"max_new_tokens": 24, **kw})


def run(engine: Engine, params: list[GenerateParams]) -> list[Stream]:
    streams = [Stream() for _ in params]
    for i, (p, s) in enumerate(zip(params, streams, strict=True)):
        engine.submit(f"r{i}-{time.monotonic_ns()}", p, s)
    return [s.wait() for s in streams]


@pytest.fixture
def engine(smollm_bf16) -> Iterator[Engine]:
    e = Engine(smollm_bf16, max_batch=4, max_queue=8)
    e.start()
    yield e
    e.shutdown(drain_timeout=5)


def wait_for(cond, timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def reference_margins(loaded, prompt_ids: list[int], generated: list[int]) -> list[float]:
    """For each generated token: how far its logit is below the best one, recomputed without
    any KV cache or batching (0 = it is the argmax)."""
    x = torch.tensor([prompt_ids + generated])
    with torch.inference_mode():
        logits = loaded.model(x, all_logits=True)[0, len(prompt_ids) - 1 : -1]
    chosen = logits[torch.arange(len(generated)), torch.tensor(generated)]
    return (logits.max(-1).values - chosen).tolist()


def test_batched_decode_equals_one_at_a_time(smollm_bf16):
    params = [chat(smollm_bf16, p) for p in PROMPTS]
    alone = []
    for p in params:  # a fresh engine each: no batching, no prefix reuse
        e = Engine(smollm_bf16, max_batch=1)
        e.start()
        alone.append(run(e, [p])[0].ids)
        e.shutdown()
    e = Engine(smollm_bf16, max_batch=4)
    e.start()
    try:
        together = run(e, params)
        assert e.stats()["tokens_generated"] >= sum(len(a) for a in alone)
    finally:
        e.shutdown()
    # where the model is confident, batching changes nothing
    assert [s.ids for s in together[:3]] == alone[:3]
    assert together[0].text == "The capital of France is Paris."
    # everywhere, every token is the argmax of an uncached, unbatched forward up to bf16
    # rounding of near-ties (a wrong mask, position or slot would be off by whole logits)
    for p, s in zip(params, together, strict=True):
        assert max(reference_margins(smollm_bf16, p.prompt_ids, s.ids)) <= 0.25


def test_events_stream_in_order_with_timings(engine, smollm_bf16):
    s = run(engine, [chat(smollm_bf16, PROMPTS[0])])[0]
    assert s.finish == "stop" and s.text == "The capital of France is Paris."
    assert all(e.finish_reason is None for e in s.events[:-1])
    first = s.events[0]
    assert first.queue_wait_s >= 0 and first.ttft_s is not None and first.ttft_s > 0
    assert all(e.ttft_s is None for e in s.events[1:])
    assert engine.stats()["kv_blocks_used"] == 0  # freed on completion


def test_prefix_reuse_gives_identical_tokens_and_counts_hits(engine, smollm_bf16):
    p = chat(smollm_bf16, PROMPTS[2])
    cold = run(engine, [p])[0].ids
    hits, queries = engine.stats()["prefix_hit_tokens"], engine.stats()["prefix_query_tokens"]
    warm = run(engine, [p])[0].ids
    assert warm == cold
    block = engine.block_size
    gained = engine.stats()["prefix_hit_tokens"] - hits
    assert gained == (len(p.prompt_ids) - 1) // block * block  # every full prompt block
    assert engine.stats()["prefix_query_tokens"] - queries == len(p.prompt_ids)
    other = run(engine, [chat(smollm_bf16, PROMPTS[1])])[0]  # shares the system prompt only
    assert other.text == "The answer to this classic math problem is 4."


def test_a_greedy_stream_does_not_depend_on_what_the_engine_served_before(smollm_int4):
    """Prefilled whole on a fresh engine or from the system prompt's blocks another prompt left
    cached: the same tokens (the stall demo once saw a stream that no uninterrupted call gave,
    from a replica whose prefix cache held other prompts; prefill attention is native now)."""
    target = chat(smollm_int4, "Say hello in Spanish.", max_new_tokens=10)
    streams, hits = [], []
    for before in ([], [chat(smollm_int4, PROMPTS[1], max_new_tokens=10)]):
        e = Engine(smollm_int4, max_batch=4)
        e.start()
        try:
            run(e, before)
            hit = e.stats()["prefix_hit_tokens"]
            streams.append(run(e, [target])[0].ids)
            hits.append(e.stats()["prefix_hit_tokens"] - hit)
        finally:
            e.shutdown()
    assert hits[0] == 0 and 0 < hits[1] < len(target.prompt_ids) - e.block_size
    assert streams[0] == streams[1]


def test_cancel_frees_blocks_and_reports_cancelled(engine, smollm_bf16):
    s = Stream()
    engine.submit(
        "long", chat(smollm_bf16, "Write a long story about a dragon.", max_new_tokens=400), s
    )
    wait_for(lambda: len(s.events) >= 3)
    assert engine.stats()["kv_blocks_used"] > 0
    engine.cancel("long")
    assert s.wait().finish == "cancelled"
    st = engine.stats()
    assert st["kv_blocks_used"] == 0 and st["running"] == 0
    engine.cancel("long")  # unknown / finished ids are ignored


def test_admission_control_queue_full_then_engine_full(smollm_bf16):
    e = Engine(smollm_bf16, max_batch=1, max_queue=2)  # not started: nothing leaves the queue
    p = chat(smollm_bf16, PROMPTS[1])
    e.submit("a", p, Stream())
    e.submit("b", p, Stream())
    with pytest.raises(EngineFull, match="queue full"):
        e.submit("c", p, Stream())
    with pytest.raises(ValueError, match="already in flight"):
        e.submit("a", p, Stream())
    e.shutdown(drain_timeout=0)


def test_requests_wait_for_kv_blocks(smollm_bf16):
    p = chat(smollm_bf16, PROMPTS[0], max_new_tokens=16)
    blocks = -(-(len(p.prompt_ids) + 16) // 16)
    e = Engine(smollm_bf16, max_batch=4, kv_blocks=blocks + 1)  # room for one at a time
    e.start()
    try:
        streams = run(e, [p, p, p])
        assert [s.text for s in streams] == ["The capital of France is Paris."] * 3
        assert max(e.stats()["kv_blocks_used"], 0) == 0
    finally:
        e.shutdown()


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("prompt_ids", GenerateParams(prompt_ids=[])),
        ("prompt_ids", GenerateParams(prompt_ids=[1, 10**9])),
        ("prompt_ids", GenerateParams(prompt_ids=[5] * 9000)),
        ("max_new_tokens", GenerateParams(prompt_ids=[5], max_new_tokens=0)),
        ("temperature", GenerateParams(prompt_ids=[5], temperature=-1)),
        ("top_p", GenerateParams(prompt_ids=[5], top_p=0)),
        ("top_k", GenerateParams(prompt_ids=[5], top_k=-2)),
        ("stop", GenerateParams(prompt_ids=[5], stop=[""])),
    ],
)
def test_bad_params_name_the_field(engine, field, params):
    with pytest.raises(ValueError, match=field):
        engine.submit("bad", params, Stream())


def test_stop_sequence_and_length(engine, smollm_bf16):
    s = run(engine, [chat(smollm_bf16, PROMPTS[0], stop=[" is"])])[0]
    assert s.finish == "stop" and s.text == "The capital of France"
    s = run(engine, [chat(smollm_bf16, PROMPTS[0], max_new_tokens=3)])[0]
    assert s.finish == "length" and len(s.ids) == 3 and s.text == "The capital of"


def test_stop_sequence_longer_than_the_text_so_far_is_honoured(engine, smollm_bf16):
    # The text held back for a stop sequence was sliced with a negative end while the stream
    # was shorter than the stop sequence, so its first characters went out early and the stop
    # sequence was never matched.
    plain = run(engine, [chat(smollm_bf16, PROMPTS[0], max_new_tokens=6)])[0]
    stop = plain.text.strip()
    assert len(stop) > 8, plain.text
    s = run(engine, [chat(smollm_bf16, PROMPTS[0], stop=[stop])])[0]
    assert s.finish == "stop" and stop not in s.text and s.text.strip() == ""


def test_seeded_sampling_is_reproducible(smollm_bf16):
    # Same seed, same conditions -> same tokens. (A prefix-cache hit changes the prefill's
    # matmul shapes, hence bf16 rounding, so fresh engines keep the conditions equal.)
    kw = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7, "max_new_tokens": 16}

    def once(**extra):
        e = Engine(smollm_bf16, max_batch=1)
        e.start()
        try:
            return run(e, [chat(smollm_bf16, PROMPTS[3], **{**kw, **extra})])[0]
        finally:
            e.shutdown()

    a, b, c = once(), once(), once(seed=8)
    # The length is not asserted exactly: another CPU's rounding may sample EOS earlier.
    assert a.ids == b.ids and 0 < len(a.ids) <= 16
    assert c.ids != a.ids


def test_priority_orders_admission(smollm_bf16):
    e = Engine(smollm_bf16, max_batch=1, max_queue=8)
    order: list[str] = []

    def tag(name):
        s = Stream()

        def cb(ev):
            if ev.token_ids and name not in order:
                order.append(name)
            s(ev)

        return s, cb

    streams = []
    for name, prio in (("low", 0), ("high", 5), ("mid", 2)):
        s, cb = tag(name)
        e.submit(name, chat(smollm_bf16, PROMPTS[1], max_new_tokens=2, priority=prio), cb)
        streams.append(s)
    e.start()
    try:
        for s in streams:
            s.wait()
    finally:
        e.shutdown()
    assert order == ["high", "mid", "low"]


def test_static_batching_and_shutdown_drain(smollm_bf16):
    e = Engine(smollm_bf16, max_batch=2, static_batching=True)
    e.start()
    streams = [Stream() for _ in range(3)]
    for i, s in enumerate(streams):
        e.submit(f"s{i}", chat(smollm_bf16, PROMPTS[0], max_new_tokens=8), s)
    e.shutdown(drain_timeout=TIMEOUT)  # finishes everything accepted
    assert [s.finish for s in streams] == ["stop"] * 3
    with pytest.raises(EngineFull, match="shutting down"):
        e.submit("late", chat(smollm_bf16, PROMPTS[0]), Stream())


def test_adaptive_batch_shrinks_under_an_unreachable_target(smollm_int4):
    e = Engine(smollm_int4, max_batch=4, tpot_target_ms=0.001)
    e.start()
    try:
        run(e, [chat(smollm_int4, "Write a long story.", max_new_tokens=40) for _ in range(4)])
        assert e.stats()["max_batch"] < 4
    finally:
        e.shutdown()
