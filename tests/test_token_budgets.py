"""Token budgets' buckets (mesh_common/token_budgets.py), which runtimes and the control plane
keep: reserve prompt + max_tokens at admission, refund the unused part, refill over the budget's
span, keep the levels in a state file. The clock is the test's, so refills are exact; the mesh
path (the authz filter's header, real Envoy, the openai SDK, global mode):
tests/test_token_budget_mesh.py."""

from __future__ import annotations

import threading

import pytest

from mesh_common.token_budgets import BudgetError, BudgetExceeded, TokenBudgets, parse_budget
from model_runtime.serving.budgets import Budgets
from wasm_filters.policy import PolicyError, TokenBudget, parse_policy
from xds_server.resources.ratelimit import budget_share


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_the_header_parses_and_a_bad_one_is_named() -> None:
    assert parse_budget("tokens_per_minute=600;tokens_per_day=9000") == (
        {"tokens_per_minute": 600, "tokens_per_day": 9000},
        None,
    )
    assert parse_budget("tokens_per_day=9;global=llm") == ({"tokens_per_day": 9}, "llm")
    with pytest.raises(BudgetError, match="unknown part 'tokens_per_hour'"):
        parse_budget("tokens_per_hour=5")
    with pytest.raises(BudgetError, match="tokens_per_day must be a positive integer"):
        parse_budget("tokens_per_day=-1")
    with pytest.raises(BudgetError, match="names no budget"):
        parse_budget(";")


def test_a_reservation_past_the_level_is_refused_with_when_it_refills() -> None:
    clock = Clock()
    b = TokenBudgets(clock=clock)
    r = b.reserve("acme", {"tokens_per_minute": 600}, 500)
    with pytest.raises(BudgetExceeded) as e:
        b.reserve("acme", {"tokens_per_minute": 600}, 200)
    # 100 left, 200 wanted: 100 more tokens at 10 a second.
    assert e.value.retry_after_s == 10
    assert "tenant 'acme'" in str(e.value) and "tokens_per_minute of 600" in str(e.value)
    b.reserve("other", {"tokens_per_minute": 600}, 200)  # tenants are apart
    clock.now += 10
    b.reserve("acme", {"tokens_per_minute": 600}, 200)
    b.settle(r, used=500)  # all used: nothing back
    assert b.levels()["acme"]["tokens_per_minute"] == pytest.approx(0)
    clock.now += 30  # levels count the refill since
    assert b.levels()["acme"]["tokens_per_minute"] == pytest.approx(300)


def test_the_unused_part_is_refunded_never_above_the_budget() -> None:
    b = TokenBudgets(clock=Clock())
    r = b.reserve("acme", {"tokens_per_day": 1000}, 600)
    b.settle(r, used=100)
    assert b.levels()["acme"]["tokens_per_day"] == pytest.approx(900)
    r = b.reserve("acme", {"tokens_per_day": 1000}, 100)
    b.settle(r, used=0)
    assert b.levels()["acme"]["tokens_per_day"] == pytest.approx(900)


def test_a_call_larger_than_the_budget_never_fits() -> None:
    b = TokenBudgets(clock=Clock())
    with pytest.raises(BudgetExceeded, match="lower max_tokens") as e:
        b.reserve("acme", {"tokens_per_minute": 100, "tokens_per_day": 5000}, 101)
    assert e.value.retry_after_s is None


def test_every_budget_must_hold_the_reservation() -> None:
    b = TokenBudgets(clock=Clock())
    b.reserve("acme", {"tokens_per_minute": 1000, "tokens_per_day": 1500}, 900)
    b.settle(b.reserve("acme", {"tokens_per_minute": 1000, "tokens_per_day": 1500}, 50), 50)
    with pytest.raises(BudgetExceeded, match="tokens_per_minute"):
        b.reserve("acme", {"tokens_per_minute": 1000, "tokens_per_day": 1500}, 100)
    assert b.levels()["acme"] == {
        "tokens_per_minute": pytest.approx(50),
        "tokens_per_day": pytest.approx(550),
    }


def test_concurrent_reservations_at_the_edge_never_overshoot() -> None:
    b = TokenBudgets(clock=Clock())
    admitted: list[int] = []
    start = threading.Barrier(16)

    def call() -> None:
        start.wait()
        try:
            b.reserve("acme", {"tokens_per_day": 1000}, 90)
            admitted.append(1)
        except BudgetExceeded:
            pass

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 11  # 11 x 90 = 990 <= 1000 < 12 x 90


def test_the_state_file_charges_what_a_dead_runtime_had_reserved(tmp_path) -> None:
    clock = Clock()
    state = tmp_path / "budgets.json"
    first = TokenBudgets(state, clock=clock)
    first.settle(first.reserve("acme", {"tokens_per_day": 1000}, 300), used=100)
    first.reserve("acme", {"tokens_per_day": 1000}, 500)  # in flight when the runtime dies
    successor = TokenBudgets(state, clock=clock)
    assert successor.levels()["acme"]["tokens_per_day"] == pytest.approx(400)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(BudgetError, match="unreadable"):
        TokenBudgets(tmp_path / "bad.json")
    with pytest.raises(BudgetExceeded):
        successor.reserve("acme", {"tokens_per_day": 1000}, 401)


def test_an_unreadable_state_file_is_an_error_not_a_fresh_budget(tmp_path) -> None:
    state = tmp_path / "budgets.json"
    state.write_text("{not json")
    with pytest.raises(BudgetError, match="unreadable"):
        TokenBudgets(state)


def test_the_policy_reads_budgets_and_names_a_bad_field() -> None:
    key = "a" * 64
    p = parse_policy({"acme": {"key_sha256": key, "token_budget": {"tokens_per_minute": 600}}})
    assert p.tenant("acme").token_budget == TokenBudget(tokens_per_minute=600)
    assert p.tenant("acme").token_budget.header_value() == "tokens_per_minute=600"
    with pytest.raises(PolicyError, match=r"tenants\.acme\.token_budget\.tokens_per_hour"):
        parse_policy({"acme": {"key_sha256": key, "token_budget": {"tokens_per_hour": 5}}})
    with pytest.raises(PolicyError, match=r"tenants\.acme\.token_budget\.tokens_per_day"):
        parse_policy({"acme": {"key_sha256": key, "token_budget": {"tokens_per_day": 0}}})


def test_local_shares_divide_the_budget_rounding_down() -> None:
    budget = TokenBudget(tokens_per_minute=1000, tokens_per_day=50_001)
    assert budget_share(budget, 3) == TokenBudget(tokens_per_minute=333, tokens_per_day=16_667)
    assert budget_share(budget, 1) is budget
    assert budget_share(None, 3) is None


def test_global_budgets_fall_back_to_the_whole_budget_here_while_unreachable() -> None:
    """A runtime whose budget service does not answer keeps the header's whole budget itself
    (the tier that holds while the control plane is down), as call limits' sidecar buckets do."""
    from mesh_common.ports import free_port

    b = Budgets(service=f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        held = b.reserve("acme", "tokens_per_day=100;global=llm", 60)
        assert held.local is not None
        with pytest.raises(BudgetExceeded):
            b.reserve("acme", "tokens_per_day=100;global=llm", 60)
    finally:
        b.close()


def test_the_filter_header_says_global_and_keeps_the_whole_budget() -> None:
    from xds_server.mesh import parse_mesh
    from xds_server.resources.ratelimit import local_policy

    tenants = {"acme": {"key_sha256": "a" * 64, "token_budget": {"tokens_per_day": 900}}}
    llm = {"versions": {"v1": {"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]}}}
    doc = {"services": {"llm": llm}, "tenants": tenants}
    for mode, want in (
        ("local", "tokens_per_day=450"),
        ("global", "tokens_per_day=900;global=llm"),
    ):
        mesh = parse_mesh({**doc, "rate_limits": {"mode": mode}}).with_inbound_sidecars("llm", 2)
        budget = local_policy(mesh, mesh.services["llm"]).tenant("acme").token_budget
        assert budget.header_value() == want
