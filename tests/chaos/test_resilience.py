"""Chaos on the data path with tiny grpcio upstreams: a slow and erroring upstream behind circuit
breakers and a retry budget; weights and policy changed every second under load."""

from __future__ import annotations

import json
import time
import urllib.request

from mesh_common.ports import free_port
from meshlm.demo.procs import wait_until
from tests.chaos.harness import EchoUpstream, Mesh, echo_call, envoy_stats
from tests.chaos.load import Load, failures, percentile
from tests.chaos.record import record
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh


def test_slow_erroring_upstream_p99_bounded_no_retry_storm(tmp_path) -> None:
    t_start = time.monotonic()
    v1 = EchoUpstream("v1", workers=64)
    services = {
        "llm": {
            "versions": {"v1": {"endpoints": [v1.address]}},
            "route": {"weights": {"v1": 100}},
            "circuit_breakers": {
                "max_requests": 16,
                "max_pending_requests": 8,
                "retry_budget": {"budget_percent": 20, "min_retry_concurrency": 3},
            },
            "retry_policy": {"retry_on": "unavailable,connect-failure", "num_retries": 3,
                             "per_try_timeout": "1s"},
        }
    }  # fmt: skip
    mesh = Mesh(tmp_path, {"services": services})
    try:
        mesh.start_control_plane()
        port, admin = free_port(), free_port()
        mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
        call = echo_call(port, timeout=10)
        wait_until(lambda: call() == "v1", 30, "caller routes llm")
        v1.calls = 0
        rate, retry_stat = 60.0, "cluster.outbound|llm|v1.upstream_rq_retry"
        base = envoy_stats(admin, r"cluster\.outbound\|llm\|v1\.upstream_")
        with Load(call, rate, workers=128) as load:
            time.sleep(3)
            healthy_end = time.monotonic()
            v1.delay_s, v1.error_percent = 0.5, 30.0  # the fault, while serving
            time.sleep(10)
            v1.delay_s, v1.error_percent = 0.0, 0.0
            fault_end = time.monotonic()
            time.sleep(3)
        stats = envoy_stats(admin, r"cluster\.outbound\|llm\|v1\.upstream_")
        out = load.snapshot()
        faulty = [o for o in out if healthy_end <= o.start < fault_end]
        sent = len(out)
        retries = stats.get(retry_stat, 0) - base.get(retry_stat, 0)
        overflow = "cluster.outbound|llm|v1.upstream_rq_retry_overflow"
        cb_open = "cluster.outbound|llm|v1.upstream_rq_pending_overflow"
        p99 = percentile([o.latency_s for o in faulty], 99)
        after = failures([o for o in out if o.start >= fault_end + 1.0])
        record(
            "test_slow_erroring_upstream_p99_bounded_no_retry_storm",
            "Upstream made slow and erroring (circuit breakers, retry budget)",
            load=f"{load.held()}, unary echo via caller Envoy",
            faults=["upstream +500 ms and 30 % UNAVAILABLE for 10 s (changed while serving)"],
            by_status=load.by_status(),
            allowed_lost=len(after),
            recovery_s=None,
            started=t_start,
            caller_p99_ms_during_fault=round(1000 * p99, 1) if p99 else None,
            caller_p50_ms_during_fault=round(
                1000 * percentile([o.latency_s for o in faulty], 50), 1
            ),
            retries_per_request=round(retries / sent, 3),
            upstream_calls_per_request=round(v1.calls / sent, 3),
            retry_budget_overflow=stats.get(overflow, 0) - base.get(overflow, 0),
            circuit_breaker_pending_overflow=stats.get(cb_open, 0) - base.get(cb_open, 0),
            envoy_counters_moved={
                k.split(".")[-1]: v - base.get(k, 0)
                for k, v in stats.items()
                if v - base.get(k, 0) and not k.endswith("_total")
            },
            failed_during_fault=dict(load.by_status(failures(faulty))),
        )
        # Retries are bounded by the budget (20 % of active requests, floor 3), not by
        # num_retries x load: the upstream never sees a retry storm.
        assert v1.calls / sent < 1.5, (v1.calls, sent)
        assert p99 is not None and p99 < 5.0  # bounded by breakers, not by queueing
        assert not after, load.by_status(after)
    finally:
        mesh.stop()
        v1.stop()


TENANTS = {
    "acme": {"key_sha256": hash_key("chaos-acme-key"), "allow": ["llm/*"]},
}


def _mesh(addrs: dict[str, str], weights: dict[str, int], tenants: dict) -> object:
    return parse_mesh(
        {
            "control_plane": {"debounce": "20ms"},
            "services": {
                "llm": {
                    "versions": {v: {"endpoints": [a]} for v, a in addrs.items()},
                    "route": {"weights": weights},
                    "retry_policy": {"retry_on": "unavailable,connect-failure,refused-stream",
                                     "num_retries": 2},
                }
            },
            "tenants": tenants,
        }
    )  # fmt: skip


def test_weight_and_policy_change_every_second_no_allowed_request_fails(tmp_path) -> None:
    """In-process control plane (the admin API has no policy endpoint; `update_mesh` is the
    seam), real Envoys: a caller sidecar and an inbound sidecar with Wasm authz per version."""
    t_start = time.monotonic()
    ups = {"v1": EchoUpstream("v1"), "v2": EchoUpstream("v2")}
    inbound = {v: free_port() for v in ups}
    addrs = {v: f"127.0.0.1:{p}" for v, p in inbound.items()}
    cp = build_server(_mesh(addrs, {"v1": 100, "v2": 0}, TENANTS)).start()
    mesh = Mesh(tmp_path, {"services": {}})
    mesh.grpc_port = cp.grpc_port
    try:
        for v, u in ups.items():
            mesh.start_sidecar(f"llm-{v}", admin_port=free_port(), service="llm", version=v,
                               inbound_port=inbound[v], local_endpoint=u.address)  # fmt: skip
        port, admin = free_port(), free_port()
        mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
        call = echo_call(port, key="chaos-acme-key")
        wait_until(lambda: call() == "v1", 30, "caller routes llm through authz")
        changes, nacks, slow = 0, 0, 0
        duration = 30
        with Load(call, 20.0) as load:
            end = time.monotonic() + duration
            while time.monotonic() < end:
                t0 = time.monotonic()
                w = 10 * (changes % 11)
                extra = {f"t{changes % 5}": {"key_sha256": hash_key(f"k{changes}"),
                                             "allow": ["llm/Generate"]}}  # fmt: skip
                r = cp.update_mesh(
                    _mesh(addrs, {"v1": 100 - w, "v2": w}, {**TENANTS, **extra}), timeout=10
                )
                changes += 1
                nacks += bool(r.errors)
                slow += not r.ok
                time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
        lost = failures(load.snapshot())
        replies = {"v1": ups["v1"].calls, "v2": ups["v2"].calls}
        record(
            "test_weight_and_policy_change_every_second_no_allowed_request_fails",
            "Weight and policy change every second under load",
            load=f"{load.held()}, tenant acme, caller Envoy -> inbound Envoys (Wasm authz)",
            faults=[
                f"{changes} changes, one per second: weights v2 0..100 % in steps of 10 "
                "and a tenant added/replaced (ECDS) in the same push"
            ],
            by_status=load.by_status(),
            allowed_lost=len(lost),
            recovery_s=None,
            started=t_start,
            changes_nacked=nacks,
            changes_not_acked_within_10s=slow,
            upstream_calls=replies,
            listeners_drained=_drains(admin),
        )
        assert not lost, load.by_status()
        assert changes >= duration * 0.8 and not nacks
    finally:
        mesh.stop()
        cp.stop()
        for u in ups.values():
            u.stop()


def _drains(admin: int) -> int:
    url = f"http://127.0.0.1:{admin}/stats?format=json&filter=total_listeners_draining"
    with urllib.request.urlopen(url, timeout=5) as r:
        return sum(s.get("value", 0) for s in json.loads(r.read())["stats"])
