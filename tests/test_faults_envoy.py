"""Fault injection as mesh policy (`faults:`), on a real caller Envoy fed by the control plane:
Envoy's HTTP fault filter delays or aborts only the calls the fault names (service, version,
header), with the fault's percentage; every change is ACK-gated like a weight change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import grpc
import pytest

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_mesh_support import ACME_KEY, two_hops
from tests.test_xds_support import Caller, eventually, sidecar, upstreams
from wasm_filters.policy import hash_key
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import MeshError, parse_mesh

MARK = "x-meshlm-fault-test"
# A 1 s delay as this process's clock sees it: Envoy's timer may fire a fraction of a
# millisecond before a full second of time.monotonic() has passed.
DELAYED_1S = 0.95


def _raw(ups: dict[str, Any], weights: dict[str, int], faults: dict | None = None) -> dict:
    raw: dict = {
        "services": {
            "llm": {
                "versions": {n: {"endpoints": [u.address]} for n, u in sorted(ups.items())},
                "route": {"weights": weights},
            }
        }
    }
    if faults:
        raw["faults"] = faults
    return raw


def _outcomes(caller: Caller, n: int, metadata: tuple = ()) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(n):
        try:
            seen[caller.who(metadata, timeout=10)] += 1
        except grpc.RpcError as e:
            seen[e.code().name] += 1
    return seen


SERVICES = {
    "services": {
        "llm": {
            "versions": {
                "v1": {"endpoints": ["127.0.0.1:1"]},
                "v2": {"endpoints": ["127.0.0.1:2"]},
            },
            "route": {"weights": {"v1": 100, "v2": 0}},
        }
    }
}


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ({"service": "llm", "abort": {"grpc_status": 14, "percent": 101}}, r"abort.percent"),
        ({"service": "llm", "abort": {"grpc_status": 14, "percent": 0}}, r"abort.percent"),
        ({"service": "nope", "delay": {"fixed_delay": "1s"}}, r"faults.f.service: unknown"),
        ({"service": "llm", "version": "v9", "delay": {"fixed_delay": "1s"}}, r"f.version"),
        ({"service": "llm"}, r"faults.f: needs a delay or an abort"),
        ({"service": "llm", "delay": {"fixed_delay": "soon"}}, r"delay.fixed_delay"),
        ({"service": "llm", "delay": {"fixed_delay": "0s"}}, r"delay.fixed_delay"),
        ({"service": "llm", "abort": {"http_status": 99}}, r"abort.http_status"),
        ({"service": "llm", "abort": {"grpc_status": 17}}, r"abort.grpc_status"),
        ({"service": "llm", "abort": {"grpc_status": 0}}, r"abort.grpc_status"),
        ({"service": "llm", "abort": {}}, r"abort: exactly one of"),
        ({"service": "llm", "abort": {"http_status": 503}, "when": 1}, r"faults.f.when"),
        ({"service": "llm", "headers": {"X-A": "1"}, "abort": {"http_status": 503}}, r"headers"),
        # A host fault names an endpoint of that service (and of that version, if one is named).
        (
            {"service": "llm", "host": "127.0.0.1:9", "delay": {"fixed_delay": "1s"}},
            r"faults.f.host: 127.0.0.1:9 is no endpoint of llm",
        ),
        (
            {"service": "llm", "host": "localhost:1", "delay": {"fixed_delay": "1s"}},
            r"faults.f.host: 'localhost' is not an IPv4 address",
        ),
        (
            {
                "service": "llm",
                "version": "v2",
                "host": "127.0.0.1:1",
                "abort": {"grpc_status": 14},
            },
            r"faults.f.host: 127.0.0.1:1 does not serve llm/v2",
        ),
    ],
)
def test_a_bad_fault_is_refused_naming_the_field(fault: dict, error: str) -> None:
    with pytest.raises(MeshError, match=error):
        parse_mesh({**SERVICES, "faults": {"f": fault}})


def test_one_fault_per_service_and_one_per_host() -> None:
    delay = {"fixed_delay": "1s"}
    host_a = {"service": "llm", "host": "127.0.0.1:1", "delay": delay}
    both = parse_mesh(
        {**SERVICES, "faults": {"a": host_a, "all": {"service": "llm", "delay": delay}}}
    )
    assert both.faults["a"].host == "127.0.0.1:1" and both.faults["all"].host is None
    with pytest.raises(MeshError, match=r"faults.b.host: 127.0.0.1:1 already has fault a"):
        parse_mesh({**SERVICES, "faults": {"a": host_a, "b": host_a}})


def test_faults_on_a_real_envoy_touch_only_the_calls_they_name() -> None:
    with upstreams("v1", "v2") as ups:
        cp = build_server(parse_mesh(_raw(ups, {"v1": 50, "v2": 50})), debounce=0.02).start()
        envoy, port = sidecar(cp, "faults-1")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who(), what="the outbound route")

                def push(faults: dict | None) -> None:
                    mesh = parse_mesh(_raw(ups, {"v1": 50, "v2": 50}, faults))
                    assert cp.update_mesh(mesh, timeout=20).ok  # ACKed: Envoy took it

                # Header-scoped delay: a marked call waits, an unmarked one is not delayed.
                push(
                    {
                        "slow": {
                            "service": "llm",
                            "headers": {MARK: "1"},
                            "delay": {"fixed_delay": "1s"},
                        }
                    }
                )
                t0 = time.monotonic()
                assert caller.who(((MARK, "1"),)) in ("v1", "v2")
                assert time.monotonic() - t0 >= DELAYED_1S
                before = envoy.stats("fault")
                assert _outcomes(caller, 10).keys() <= {"v1", "v2"}
                after = envoy.stats("fault")
                delays = [k for k in after if k.endswith("fault.delays_injected")]
                assert delays and all(after[k] == before.get(k, 0) for k in delays), after

                # gRPC-status abort of one version only: the other version's calls are served.
                push({"v2-down": {"service": "llm", "version": "v2", "abort": {"grpc_status": 8}}})
                seen = _outcomes(caller, 40)
                assert set(seen) == {"v1", "RESOURCE_EXHAUSTED"}, seen

                # HTTP-status abort, seen by the gRPC client as its gRPC mapping (403 -> 7).
                push({"no": {"service": "llm", "abort": {"http_status": 403}}})
                assert set(_outcomes(caller, 10)) == {"PERMISSION_DENIED"}

                # A percentage, roughly honoured (50 % of 200: 0 or 200 failures has p ~ 2**-199).
                push({"half": {"service": "llm", "abort": {"grpc_status": 14, "percent": 50}}})
                seen = _outcomes(caller, 200)
                assert 40 <= seen["UNAVAILABLE"] <= 160, seen

                # Removed: every call is served again.
                push(None)
                assert _outcomes(caller, 20).keys() <= {"v1", "v2"}
                caller.close()
        finally:
            cp.stop()


TOKEN = "fault-test-token"


def _meshlm(*argv: str, token: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
    if token:
        env["MESHLM_ADMIN_TOKEN"] = TOKEN
    return subprocess.run(
        [sys.executable, "-m", "meshlm.cli", *argv],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_meshlm_fault_add_list_remove_and_expiry_on_a_real_envoy() -> None:
    with upstreams("v1") as ups:
        cp = build_server(parse_mesh(_raw(ups, {"v1": 100})), debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN).start()
        envoy, port = sidecar(cp, "faults-cli")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who(), what="the outbound route")
                url = ("--admin", admin.url)

                # The token guards it as every admin change.
                r = _meshlm(
                    "fault", "add", "x", "--service", "llm", "--abort-grpc", "14", *url, token=False
                )
                assert r.returncode != 0 and not cp.mesh.faults, r.stderr
                # A bad spec is refused naming the field; nothing is pushed.
                r = _meshlm(
                    "fault",
                    "add",
                    "x",
                    "--service",
                    "llm",
                    "--abort-grpc",
                    "14",
                    "--percent",
                    "120",
                    *url,
                )
                assert r.returncode == 1 and "faults.x.abort.percent" in r.stderr, r.stderr
                r = _meshlm(
                    "fault",
                    "add",
                    "x",
                    "--service",
                    "llm",
                    "--version",
                    "v7",
                    "--delay",
                    "1s",
                    *url,
                )
                assert r.returncode == 1 and "faults.x.version" in r.stderr, r.stderr
                r = _meshlm(
                    "fault",
                    "add",
                    "x",
                    "--service",
                    "llm",
                    "--delay",
                    "1s",
                    "--duration",
                    "soon",
                    *url,
                )
                assert r.returncode == 1 and "faults.x.duration" in r.stderr, r.stderr
                assert not cp.mesh.faults

                # Added: answered once the caller sidecar ACKed it; the call is aborted at once.
                r = _meshlm("fault", "add", "down", "--service", "llm", "--abort-grpc", "14", *url)
                assert r.returncode == 0 and "ACKed by faults-cli" in r.stdout, r.stderr
                assert set(_outcomes(caller, 5)) == {"UNAVAILABLE"}
                r = _meshlm("fault", "list", *url)
                assert "down: llm: abort gRPC 14 (100%)" in r.stdout, r.stdout
                r = _meshlm("status", *url)
                assert "faults:\n  down: llm: abort gRPC 14 (100%)" in r.stdout, r.stdout
                r = _meshlm("fault", "remove", "down", *url)
                assert r.returncode == 0 and "ACKed by faults-cli" in r.stdout, r.stderr
                assert set(_outcomes(caller, 5)) == {"v1"}
                assert "no faults" in _meshlm("fault", "list", *url).stdout

                # With a duration, the control plane removes it (a new ACKed version) itself.
                before = cp.mesh
                r = _meshlm(
                    "fault",
                    "add",
                    "brief",
                    "--service",
                    "llm",
                    "--abort-http",
                    "503",
                    "--duration",
                    "2s",
                    *url,
                )
                assert r.returncode == 0, r.stderr
                assert set(_outcomes(caller, 3)) == {"UNAVAILABLE"}
                eventually(lambda: not cp.mesh.faults, timeout=20, what="the fault's expiry")
                assert cp.mesh.faults == before.faults
                eventually(lambda: caller.who() == "v1", what="the ACKed removal")
                caller.close()
        finally:
            admin.stop()
            cp.stop()


def test_a_delayed_call_without_a_key_is_still_refused_by_authz() -> None:
    """The fault filter sits on the caller sidecar; authz (Wasm) on the runtime's: a delayed
    call still passes authz after its delay, so a key-less one is refused (fails closed), and
    an abort answers locally, reaching no runtime at all."""
    slow = {"service": "llm", "headers": {MARK: "1"}, "delay": {"fixed_delay": "1s"}}
    with two_hops(faults={"slow": slow}) as mesh:
        eventually(lambda: mesh.call([("x-api-key", ACME_KEY)]), what="the route")
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            mesh.call([(MARK, "1")])
        assert time.monotonic() - t0 >= DELAYED_1S  # delayed first, then refused
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
        t0 = time.monotonic()
        assert mesh.call([("x-api-key", ACME_KEY), (MARK, "1")])  # keyed: delayed, served
        assert time.monotonic() - t0 >= DELAYED_1S


def test_a_restarted_control_plane_keeps_live_faults_and_drops_ended_ones(tmp_path) -> None:
    """A fault set over the admin API is saved with its end time; the next control plane on
    the same state pushes it again (ACKed by the caller sidecar) unless it has ended."""
    store = tmp_path / "faults.json"
    with upstreams("v1") as ups:
        mesh = parse_mesh(_raw(ups, {"v1": 100}))
        cp = build_server(mesh, debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN, faults_file=store).start()
        try:
            url = ("--admin", admin.url)
            r = _meshlm("fault", "add", "kept", "--service", "llm", "--abort-grpc", "8", *url)
            assert r.returncode == 0, r.stderr
            r = _meshlm(
                "fault",
                "add",
                "ended",
                "--service",
                "llm",
                "--version",
                "v1",
                "--delay",
                "1s",
                "--duration",
                "1s",
                *url,
            )
            assert r.returncode == 1 and "one fault per service" in r.stderr, r.stderr
        finally:
            admin.stop()
            cp.stop()
        saved = json.loads(store.read_text())
        assert [f["name"] for f in saved] == ["kept"]
        ended = {**saved[0], "name": "ended", "expires_at": time.time() - 1}
        store.write_text(json.dumps([saved[0], ended]))

        cp = build_server(mesh, debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN, faults_file=store).start()
        envoy, port = sidecar(cp, "faults-restart")
        try:
            with envoy:
                assert set(cp.mesh.faults) == {"kept"}
                caller = Caller(port)
                eventually(
                    lambda: _outcomes(caller, 1) == {"RESOURCE_EXHAUSTED": 1}, what="the fault"
                )
                caller.close()
        finally:
            admin.stop()
            cp.stop()


def _timed(caller: Caller, metadata: tuple = ()) -> tuple[str, float]:
    t0 = time.monotonic()
    who = caller.who(metadata, timeout=10)
    return who, time.monotonic() - t0


def test_a_host_fault_slows_that_host_alone_for_every_caller() -> None:
    """Two hosts of one service, each behind its own inbound sidecar (Wasm authz): a delay on
    host A is injected by A's sidecar, so the caller's calls that land on A wait and those on B
    do not; a call without a key is refused by A's authz at once, not delayed; removal
    restores A."""
    with upstreams("A", "B") as ups:
        inbound = {"A": free_port(), "B": free_port()}
        host_a = f"127.0.0.1:{inbound['A']}"
        raw = {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{p}" for p in inbound.values()]}},
                    "route": {"weights": {"v1": 100}},
                }
            },
            "tenants": {"acme": {"key_sha256": hash_key(ACME_KEY), "allow": ["llm/*"]}},
        }
        cp = build_server(parse_mesh(raw), debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN).start()
        xds = ("127.0.0.1", cp.grpc_port)
        outbound = free_port()
        boots = [
            ads_bootstrap(
                f"runtime-{n}",
                xds_address=xds,
                service="llm",
                version="v1",
                inbound_port=inbound[n],
                local_endpoint=ups[n].address,
            )
            for n in ("A", "B")
        ]
        boots.append(ads_bootstrap("caller-1", xds_address=xds, outbound_port=outbound))
        key = (("x-api-key", ACME_KEY),)
        try:
            with EnvoyProcess(boots[0]), EnvoyProcess(boots[1]), EnvoyProcess(boots[2]):
                caller, direct_a = Caller(outbound), Caller(inbound["A"])
                eventually(
                    lambda: {caller.who(key) for _ in range(6)} == {"A", "B"}, what="both hosts"
                )
                url = ("--admin", admin.url)
                r = _meshlm("fault", "add", "x", "--service", "llm", "--host", "127.0.0.1:1",
                            "--delay", "1s", *url)  # fmt: skip
                assert r.returncode == 1 and "faults.x.host" in r.stderr, r.stderr

                r = _meshlm("fault", "add", "slow-a", "--service", "llm", "--host", host_a,
                            "--delay", "1s", *url)  # fmt: skip
                # ACKed by A's own sidecar: the one that injects it.
                assert r.returncode == 0 and "runtime-A" in r.stdout, r.stdout + r.stderr
                assert (
                    f"slow-a: llm host {host_a}: delay 1s" in _meshlm("fault", "list", *url).stdout
                )
                served = [_timed(caller, key) for _ in range(12)]
                assert {w for w, _ in served} == {"A", "B"}, served
                assert all(s >= DELAYED_1S for w, s in served if w == "A"), served
                assert all(s < 0.9 for w, s in served if w == "B"), served

                # Authz before the fault: a key-less call to A is refused at once.
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as refused:
                    direct_a.who(timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
                assert time.monotonic() - t0 < 0.9
                assert _timed(direct_a, key)[1] >= DELAYED_1S  # keyed: delayed, served

                r = _meshlm("fault", "remove", "slow-a", *url)
                assert r.returncode == 0 and "runtime-A" in r.stdout, r.stdout + r.stderr
                served = [_timed(caller, key) for _ in range(12)]
                assert {w for w, _ in served} == {"A", "B"}, served
                assert all(s < 0.9 for _, s in served), served
                caller.close()
                direct_a.close()
        finally:
            admin.stop()
            cp.stop()
