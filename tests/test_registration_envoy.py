"""Workload registration against a real caller Envoy: a registered host joins the caller's EDS and
takes calls, follows its health, leaves before it closes (no call lost), is removed a grace period
after it vanishes, and registers again after a control-plane restart. In-process control plane
on real gRPC sockets; real gRPC upstreams stand for the registered hosts (the runtime is not the
subject here); the sidecar's registration client (sidecar/registration.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.registration import Registration, RuntimeHealth
from tests.registration_support import RawStream, reg_mesh, register_body, registered
from tests.test_xds_support import Caller, CallLoop, eventually, sidecar, upstreams
from xds_server.compose import build_server
from xds_server.mesh import Endpoint
from xds_server.registry.request import Register
from xds_server.server import XdsServer
from xds_server.xds.snapshot import make_version


class Health:
    """A host's health as its sidecar sees it, set by the test."""

    def __init__(self) -> None:
        self.serving = True

    def __call__(self) -> bool:
        return self.serving


def _client(cp: XdsServer, address: str, node: str, health: Health, **kw) -> Registration:
    return Registration(
        node, address, "llm", "v1", [("127.0.0.1", cp.grpc_port)], health,
        poll_interval=0.05, backoff=(0.05, 0.5), **kw,
    )  # fmt: skip


def _eds_hosts(envoy) -> dict[str, str]:
    """address -> health flags of outbound|llm|v1's hosts, as the caller's Envoy holds them."""
    return envoy.host_health("outbound|llm|v1")


@contextlib.contextmanager
def _env(**service: Any) -> Iterator[dict]:
    """A static host and two to register (each with grpc.health.v1), a control plane whose mesh
    takes registrations (`service`: llm's further fields) and a caller Envoy."""
    with upstreams("static", "r1", "r2", health=True) as ups:
        static = ups.pop("static")
        mesh = reg_mesh([static.address], grace="2s", service=service)
        cp = build_server(mesh, debounce=0.02).start()
        envoy, port = sidecar(cp, "caller-1")
        clients: list[Registration] = []
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who() == "static", what="the static endpoint serves")
                yield {
                    "cp": cp, "envoy": envoy, "port": port, "caller": caller, "ups": ups,
                    "clients": clients, "mesh": mesh,
                }  # fmt: skip
                caller.close()
        finally:
            for c in clients:
                c.stop()
            cp.stop()


@pytest.fixture
def env() -> Iterator[dict]:
    with _env() as e:
        yield e


def test_registered_host_joins_the_callers_eds_and_follows_its_health(env) -> None:
    cp, envoy, caller, ups = env["cp"], env["envoy"], env["caller"], env["ups"]
    h1, h2 = Health(), Health()
    env["clients"] += [
        _client(cp, ups["r1"].address, "r1-node", h1, zone="zone-a").start(),
        _client(cp, ups["r2"].address, "r2-node", h2, weight=3).start(),
    ]
    eventually(lambda: len(registered(cp)) == 2, what="both hosts registered")
    row = registered(cp)[ups["r1"].address]
    assert (row["service"], row["version"], row["zone"], row["health"]) == (
        "llm", "v1", "zone-a", "SERVING",
    )  # fmt: skip
    assert row["node"] == "r1-node" and row["stream"] == "open" and row["since"] <= time.time()
    assert registered(cp)[ups["r2"].address]["weight"] == 3
    eventually(lambda: len(_eds_hosts(envoy)) == 3, what="the caller's EDS has every host")
    seen = {caller.who() for _ in range(60)}
    assert seen == {"static", "r1", "r2"}, seen
    # r2's runtime stops serving: it stays registered, unhealthy in EDS, and takes no call.
    h2.serving = False
    eventually(
        lambda: "failed_eds_health" in _eds_hosts(envoy).get(ups["r2"].address, ""),
        what="r2 unhealthy in the caller's EDS",
    )
    assert registered(cp)[ups["r2"].address]["health"] == "NOT_SERVING"
    assert "r2" not in {caller.who() for _ in range(40)}
    h2.serving = True
    eventually(lambda: _eds_hosts(envoy)[ups["r2"].address] == "healthy", what="r2 back")


# With active health checks Envoy would keep a removed host that still passes them.
@pytest.mark.parametrize("checks", [{}, {"health_check": {"interval": "0.5s"}}])
def test_deregistration_before_draining_loses_no_call(checks: dict) -> None:
    with _env(**checks) as env:
        cp, envoy, ups = env["cp"], env["envoy"], env["ups"]
        client = _client(cp, ups["r1"].address, "r1-node", Health()).start()
        env["clients"].append(client)
        eventually(lambda: ups["r1"].address in _eds_hosts(envoy), what="r1 in the caller's EDS")
        with CallLoop(env["port"]) as loop:
            eventually(lambda: loop.served["r1"] >= 5, what="calls reach r1")
            assert client.deregister(timeout=10), "the control plane answered the deregistration"
            # What a draining sidecar does next: its listener closes and the calls it holds
            # finish. No retries in this mesh, so a call still sent there would fail.
            ups["r1"].server.stop(grace=5).wait()
            after = loop.total()
            eventually(lambda: loop.total() >= after + 30, what="calls go on")
        assert loop.failures == [], loop.failures[:3]
        assert registered(cp) == {}
        assert ups["r1"].address not in _eds_hosts(envoy)


def test_vanished_host_is_removed_after_the_grace_period(env) -> None:
    cp, envoy, ups = env["cp"], env["envoy"], env["ups"]
    stream = RawStream(cp).send(register_body(ups["r1"].address, node="gone"))
    assert "registered" in stream.recv()
    eventually(lambda: ups["r1"].address in _eds_hosts(envoy), what="r1 in the caller's EDS")
    stream.drop()  # no deregistration: the host vanished
    eventually(
        lambda: registered(cp).get(ups["r1"].address, {}).get("stream") == "lost",
        what="the registration marked lost",
    )
    assert ups["r1"].address in _eds_hosts(envoy), "kept for the grace period"
    eventually(lambda: registered(cp) == {}, 20, "the registration expired")
    eventually(lambda: ups["r1"].address not in _eds_hosts(envoy), what="r1 out of EDS")


def test_host_registers_again_after_a_control_plane_restart(env) -> None:
    cp, envoy, caller, ups = env["cp"], env["envoy"], env["caller"], env["ups"]
    client = _client(cp, ups["r1"].address, "r1-node", Health()).start()
    env["clients"].append(client)
    eventually(lambda: ups["r1"].address in registered(cp), what="r1 registered")
    port = cp.grpc_port
    cp.stop()  # registrations live in its memory: the new one learns them again
    new = build_server(env["mesh"], debounce=0.02).start(grpc_port=port)
    try:
        eventually(lambda: ups["r1"].address in registered(new), 30, "r1 registered again")
        # The new control plane lists the host before its answer (sent once the callers ACK)
        # reaches the client.
        eventually(lambda: client.registrations == 2, what="the client answered again")
        eventually(lambda: ups["r1"].address in _eds_hosts(envoy), 30, "r1 in EDS again")
        eventually(lambda: "r1" in {caller.who() for _ in range(20)}, what="calls reach r1")
    finally:
        new.stop()


def test_a_registration_staged_by_another_change_is_still_waited_for(env) -> None:
    """Two changes race: the one that stages first carries the other's host too. The second
    must still wait for the callers' ACKs (a deregistration answered early would let its
    sidecar drain while callers still send to it)."""
    cp, ups = env["cp"], env["ups"]
    host = Register("r1-node", Endpoint("127.0.0.1", ups["r1"].port), "llm", "v1")
    cp.registry.add(host, token=10**6, spiffe_id=None, mesh=cp.mesh)
    cp.set_weights("llm", {"v1": 100}, timeout=0)  # stages the live mesh, the host included
    result = cp.push_registrations(timeout=20)
    assert result is not None and result.ok and result.acked == ["caller-1"], result
    assert result.version == make_version(cp.incarnation, cp.cache.generation)
    assert ups["r1"].address in _eds_hosts(env["envoy"])


def test_hosts_joining_at_once_share_stagings_and_each_answer_follows_the_callers_eds(
    env,
) -> None:
    """Thirty hosts register at once: restages coalesce (far fewer staged versions than hosts,
    not one push per host in series), and each host's answer arrives only once the caller's
    Envoy holds that host in its EDS."""
    cp, envoy = env["cp"], env["envoy"]
    n = 30
    names = [f"j{i}" for i in range(n)]
    in_eds_at_answer: dict[str, bool] = {}
    with upstreams(*names, health=True) as hosts:

        def answered(name: str, msg: str) -> None:
            if msg.startswith("registered") and name not in in_eds_at_answer:
                in_eds_at_answer[name] = hosts[name].address in _eds_hosts(envoy)

        gen0 = cp.cache.generation
        for name in names:
            client = _client(
                cp, hosts[name].address, f"{name}-node", Health(),
                on_event=lambda msg, name=name: answered(name, msg),
            )  # fmt: skip
            env["clients"].append(client.start())
        eventually(lambda: len(in_eds_at_answer) == n, timeout=60, what="every host answered")
        staged = cp.cache.generation - gen0
        assert staged < n // 2, f"{staged} versions staged for {n} joins"
        late = sorted(k for k, held in in_eds_at_answer.items() if not held)
        assert not late, f"answered before the caller's EDS held them: {late}"


def test_a_host_registers_as_soon_as_its_runtime_turns_serving_not_at_the_next_poll(env) -> None:
    """The runtime's grpc.health.v1 Watch stream wakes the registration client: with a poll
    interval far longer than the wait allowed, the host still registers, and joins the
    caller's EDS, promptly after its runtime turns SERVING."""
    cp, envoy, ups = env["cp"], env["envoy"], env["ups"]
    ups["r1"].set_serving(False)
    runtime = RuntimeHealth(ups["r1"].address)
    client = Registration(
        "r1-node", ups["r1"].address, "llm", "v1", [("127.0.0.1", cp.grpc_port)], runtime,
        poll_interval=60, backoff=(0.05, 0.5),
    )  # fmt: skip
    runtime.watch(client.wake)
    env["clients"].append(client.start())
    try:
        time.sleep(0.5)
        assert not client.registered
        ups["r1"].set_serving(True)
        eventually(lambda: client.registered, timeout=15, what="registered on SERVING")
        eventually(lambda: ups["r1"].address in _eds_hosts(envoy), what="in the caller's EDS")
    finally:
        client.stop()
        runtime.close()
