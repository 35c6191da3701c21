"""Tenant isolation in the engine on the real model (issue 12, item 3): a fair share of tokens
inside a priority class, per-tenant limits, and shedding of the lowest priority under overload.

Requests are queued before the engine thread starts, so the order of admission is decided by the
scheduler alone, never by how fast this machine runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from mesh_common.headers import PRIORITY_HEADER, TENANT_HEADER
from model_runtime.engine.engine import Engine, EngineFull, GenerateParams, TokenEvent
from model_runtime.engine.fair import FairQueue
from model_runtime.serving.client import Client
from model_runtime.serving.service import Runtime

TIMEOUT = 120


class Order:
    """The order in which requests got their first event, and each one's last event."""

    def __init__(self) -> None:
        self.first: list[str] = []
        self.last: dict[str, TokenEvent] = {}
        self.seen: list[dict] = []  # engine.stats()["tenants"] at each first token
        self.engine: Engine | None = None
        self._done = threading.Condition()

    def sink(self, name: str):
        def on_event(ev: TokenEvent) -> None:
            if name not in self.first:
                self.first.append(name)
                if self.engine is not None:
                    self.seen.append(self.engine.stats()["tenants"])
            if ev.finish_reason is not None:
                with self._done:
                    self.last[name] = ev
                    self._done.notify_all()

        return on_event

    def wait(self, n: int) -> None:
        with self._done:
            assert self._done.wait_for(lambda: len(self.last) >= n, TIMEOUT), self.last


def params(loaded, text: str, tenant: str, n: int, priority: int = 0) -> GenerateParams:
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": text}])
    return GenerateParams(ids, max_new_tokens=n, tenant=tenant, priority=priority)


@pytest.fixture
def engines(smollm_int4) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.shutdown(drain_timeout=10)


def flood_then_quiet(loaded, engine: Engine, order: Order) -> None:
    """Five long calls of tenant `noisy`, then one short call of `quiet`, same priority."""
    for i in range(5):
        p = params(loaded, f"Write a long story number {i}.", "noisy", 24)
        engine.submit(f"noisy-{i}", p, order.sink(f"noisy-{i}"))
    engine.submit("quiet", params(loaded, "What is 2+2?", "quiet", 4), order.sink("quiet"))


def test_quiet_tenant_goes_ahead_of_a_flood_of_the_same_priority(smollm_int4, engines) -> None:
    engine = Engine(smollm_int4, max_batch=1, max_queue=16)
    engines.append(engine)
    order = Order()
    flood_then_quiet(smollm_int4, engine, order)
    engine.start()
    order.wait(6)
    # the quiet call asks for few tokens: it is served first, not after the five long ones
    assert order.first.index("quiet") == 0, order.first
    assert all(ev.finish_reason in ("stop", "length") for ev in order.last.values())


def test_without_isolation_the_flood_is_served_first(smollm_int4, engines) -> None:
    engine = Engine(smollm_int4, max_batch=1, max_queue=16, tenant_isolation=False)
    engines.append(engine)
    order = Order()
    flood_then_quiet(smollm_int4, engine, order)
    engine.start()
    order.wait(6)
    assert order.first == [f"noisy-{i}" for i in range(5)] + ["quiet"]


def test_a_tenant_holds_at_most_its_share_of_the_batch(smollm_int4, engines) -> None:
    engine = Engine(smollm_int4, max_batch=4, max_queue=16, tenant_max_streams=2)
    engines.append(engine)
    order = Order()
    order.engine = engine
    for i in range(4):
        p = params(smollm_int4, f"Write a long story number {i}.", "noisy", 16)
        engine.submit(f"noisy-{i}", p, order.sink(f"noisy-{i}"))
    long_quiet = params(smollm_int4, "Write a long poem.", "quiet", 16)
    engine.submit("quiet", long_quiet, order.sink("quiet"))
    engine.start()
    order.wait(5)
    assert max(s.get("noisy", {}).get("running", 0) for s in order.seen) <= 2, order.seen
    # the quiet tenant started in the first round, before the flood's third call
    assert order.first.index("quiet") < order.first.index("noisy-2"), order.first


def test_a_tenant_cannot_queue_more_tokens_than_its_limit(smollm_int4, engines) -> None:
    engine = Engine(smollm_int4, max_batch=1, max_queue=16, tenant_max_queued_tokens=100)
    engines.append(engine)
    p = params(smollm_int4, "Write a story.", "noisy", 40)
    cost = len(p.prompt_ids) + p.max_new_tokens
    assert cost <= 100 < 2 * cost
    engine.submit("n0", p, lambda ev: None)
    with pytest.raises(EngineFull, match=r"tenant queue full: tenant 'noisy' has \d+ tokens"):
        engine.submit("n1", p, lambda ev: None)
    engine.submit("q0", params(smollm_int4, "Hi.", "quiet", 4), lambda ev: None)  # others can
    engine.start()  # so that shutdown drains them at once


def test_overload_sheds_the_lowest_priority_first(smollm_int4, engines) -> None:
    engine = Engine(smollm_int4, max_batch=1, max_queue=2)
    engines.append(engine)
    order = Order()

    def submit(name: str, priority: int) -> None:
        p = params(smollm_int4, "Hello.", name, 4, priority=priority)
        engine.submit(name, p, order.sink(name))

    submit("low-1", -1)
    submit("low-2", -1)
    submit("high", 1)  # the queue is full: the low call served last makes room
    shed = order.last["low-2"]
    assert shed.shed and shed.finish_reason == "error" and shed.token_ids == []
    assert "shed under overload" in shed.error and "priority -1" in shed.error
    with pytest.raises(EngineFull, match="none waiting has a priority below this one's"):
        submit("low-3", -1)  # a low call does not displace its equals
    submit("normal", 0)
    assert order.last["low-1"].shed
    assert engine.stats()["requests_shed"] == 2
    engine.start()
    order.wait(4)
    assert order.first[2:] == ["high", "normal"]


def test_a_flood_cannot_fill_the_queue_and_lock_a_quiet_tenant_out(smollm_int4, engines):
    engine = Engine(smollm_int4, max_batch=1, max_queue=2)
    engines.append(engine)
    order = Order()
    for i in range(2):
        p = params(smollm_int4, f"Write a long story number {i}.", "noisy", 24)
        engine.submit(f"noisy-{i}", p, order.sink(f"noisy-{i}"))
    engine.submit("quiet", params(smollm_int4, "Hi.", "quiet", 4), order.sink("quiet"))
    shed = order.last["noisy-1"]
    assert shed.shed and "tenant 'noisy' holds the most queued tokens at priority 0" in shed.error
    with pytest.raises(EngineFull, match="nor is another tenant's backlog larger"):
        p = params(smollm_int4, "Write a long story.", "noisy", 24)
        engine.submit("noisy-2", p, order.sink("noisy-2"))
    engine.start()
    order.wait(3)
    assert order.first == ["noisy-1", "quiet", "noisy-0"]


def test_fair_queue_orders_by_tokens_not_requests() -> None:
    q = FairQueue()
    for i in range(3):
        q.push(f"big-{i}", "a", 0, 1000)
    for i in range(3):
        q.push(f"small-{i}", "b", 0, 10)
    q.push("urgent", "c", 1, 5000)
    order = [e.request for e in q.ordered()]
    assert order[0] == "urgent"  # priority first, whatever its cost
    assert order[1:] == ["small-0", "small-1", "small-2", "big-0", "big-1", "big-2"]
    assert q.queued_tokens("a") == 3000


def test_shed_call_answers_resource_exhausted_naming_the_reason(smollm_int4) -> None:
    engine = Engine(smollm_int4, max_batch=1, max_queue=1)
    rt = Runtime().start()
    rt.set_model(smollm_int4, engine)  # the engine thread is not started: calls stay queued
    outcomes: dict[str, object] = {}

    def call(name: str, priority: str) -> None:
        md = [(PRIORITY_HEADER, priority), (TENANT_HEADER, name)]
        with Client(rt.target, metadata=md) as c:
            try:
                chunks = list(c.generate("Hello.", max_new_tokens=2, timeout=60))
                outcomes[name] = chunks[-1].finish_reason
            except grpc.RpcError as e:
                outcomes[name] = e

    low = threading.Thread(target=call, args=("free", "low"))
    high = threading.Thread(target=call, args=("acme", "high"))
    try:
        low.start()
        while not engine.stats()["queue_depth"]:
            low.join(0.02)
        high.start()  # the queue is full: the low call is shed at once
        low.join(TIMEOUT)
        err = outcomes["free"]
        assert isinstance(err, grpc.RpcError), err
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shed under overload" in err.details()
        engine.start()
        high.join(TIMEOUT)
        assert outcomes["acme"] in ("stop", "length")
    finally:
        rt.shutdown(grace=5)


def test_serve_refuses_tenant_limits_below_one_before_loading() -> None:
    from tests.test_cli_errors import assert_clear, meshlm

    for flag in ("--tenant-max-streams", "--tenant-max-queued-tokens"):
        r = meshlm("serve", "--port", "0", flag, "0")
        assert_clear(r, 2, flag, "at least 1")


def test_untenanted_direct_calls_keep_the_whole_batch(smollm_int4, engines) -> None:
    """No x-meshlm-tenant (a runtime used directly, its benchmark): no per-tenant limit."""
    engine = Engine(smollm_int4, max_batch=4, max_queue=16)
    engines.append(engine)
    order = Order()
    order.engine = engine
    for i in range(4):
        engine.submit(f"d{i}", params(smollm_int4, f"Story {i}.", "", 8), order.sink(f"d{i}"))
    engine.start()
    order.wait(4)
    assert max(s.get("", {}).get("running", 0) for s in order.seen) == 4, order.seen
