"""Locality-aware load balancing on a real caller Envoy: a caller in zone-a keeps its calls in
zone-a while zone-a is healthy, fails over in the service's `locality.failover` order when it is
not (registered health, and outlier detection when zone-a's host is partitioned off a network
of namespaces), and comes back when zone-a recovers; canary weights hold inside the zone.
In-process control plane on real gRPC sockets, hosts registered by the sidecar's registration
client (sidecar/registration.py), real gRPC upstreams standing for the runtimes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from mesh_common.process_group import stop_group
from meshlm.demo.hosts import HostNetwork
from sidecar.registration import Registration
from tests.test_xds_support import Caller, eventually, sidecar, upstreams
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

REPO = Path(__file__).resolve().parents[1]
FAILOVER = ["zone-c", "zone-b"]  # not the zones' name order, so the order is the spec's


def _mesh(versions: dict[str, int], **service: Any) -> Any:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {v: {} for v in versions},
                    "route": {"weights": versions},
                    "locality": {"failover": FAILOVER},
                    **service,
                }
            },
            "control_plane": {"registration": {"enabled": True}},
        }
    )


class _Hosts:
    """Registration clients, one per host, each with a health the test sets."""

    def __init__(self, cp: XdsServer) -> None:
        self.cp = cp
        self.serving: dict[str, bool] = {}
        self.clients: list[Registration] = []

    def add(self, name: str, address: str, zone: str, version: str = "v1") -> None:
        self.serving[name] = True
        self.clients.append(
            Registration(
                f"{name}-node", address, "llm", version, [("127.0.0.1", self.cp.grpc_port)],
                lambda: self.serving[name], zone=zone, poll_interval=0.05, backoff=(0.05, 0.5),
            ).start()
        )  # fmt: skip

    def stop(self) -> None:
        for c in self.clients:
            c.stop()


@contextlib.contextmanager
def _caller(mesh: Any, zone: str = "zone-a") -> Iterator[tuple[_Hosts, Caller]]:
    cp = build_server(mesh, debounce=0.02).start()
    hosts = _Hosts(cp)
    envoy, port = sidecar(cp, "caller-a", zone=zone)
    try:
        with envoy:
            caller = Caller(port)
            try:
                yield hosts, caller
            finally:
                caller.close()
    finally:
        hosts.stop()
        cp.stop()


def _sample(caller: Caller, n: int, timeout: float = 10) -> Counter:
    out: Counter = Counter()
    for _ in range(n):
        try:
            out[caller.who(timeout=timeout)] += 1
        except grpc.RpcError as e:
            out[e.code().name] += 1
    return out


def _until(caller: Caller, want: Callable[[str], bool], what: str) -> None:
    """Calls until 20 in a row answer as `want` says (bounded in time)."""

    last: list[Counter] = []

    def run() -> bool:
        last[:] = [_sample(caller, 20, timeout=3)]
        return all(want(k) for k in last[0])

    try:
        eventually(run, timeout=30, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the last 20 calls: {dict(last[0]) if last else {}}") from None


def test_a_caller_prefers_its_zone_fails_over_in_order_and_comes_back() -> None:
    with (
        upstreams("a1", "a2", "b1", "c1") as ups,
        _caller(_mesh({"v1": 100})) as (hosts, caller),
    ):
        for name, zone in (("a1", "zone-a"), ("a2", "zone-a"), ("b1", "zone-b"), ("c1", "zone-c")):
            hosts.add(name, ups[name].address, zone)
        _until(caller, lambda k: k in ("a1", "a2"), "calls stay in zone-a")
        got = _sample(caller, 200)
        in_zone = got["a1"] + got["a2"]
        assert in_zone >= 190, got  # >= 95 % while zone-a is healthy
        assert got["a1"] and got["a2"], got  # and spread over the zone's hosts
        # zone-a's hosts stop serving: the next zone of the failover order, not the other.
        hosts.serving["a1"] = hosts.serving["a2"] = False
        _until(caller, lambda k: k == "c1", "zone-a's calls fail over to zone-c")
        assert _sample(caller, 50) == Counter(c1=50)
        hosts.serving["c1"] = False  # and then to zone-b
        _until(caller, lambda k: k == "b1", "then to zone-b")
        # Failback: zone-a serves again and takes its calls back.
        hosts.serving["a1"] = hosts.serving["a2"] = True
        _until(caller, lambda k: k in ("a1", "a2"), "calls come back to zone-a")
        got = _sample(caller, 100)
        assert got["a1"] + got["a2"] >= 95, got


def test_a_caller_in_another_zone_gets_its_own_order() -> None:
    with (
        upstreams("a1", "b1", "c1") as ups,
        _caller(_mesh({"v1": 100}), zone="zone-b") as (hosts, caller),
    ):
        for name, zone in (("a1", "zone-a"), ("b1", "zone-b"), ("c1", "zone-c")):
            hosts.add(name, ups[name].address, zone)
        _until(caller, lambda k: k == "b1", "a zone-b caller keeps to zone-b")
        hosts.serving["b1"] = False
        _until(caller, lambda k: k == "c1", "and fails over to zone-c first")


def test_canary_weights_hold_inside_the_callers_zone() -> None:
    with (
        upstreams("a-v1", "a-v2", "b-v1", "b-v2") as ups,
        _caller(_mesh({"v1": 50, "v2": 50})) as (hosts, caller),
    ):
        for name in ups:
            zone, version = name.split("-")
            hosts.add(name, ups[name].address, f"zone-{zone}", version)
        _until(caller, lambda k: k in ("a-v1", "a-v2"), "both versions' calls in zone-a")
        got = _sample(caller, 200)
        assert got["a-v1"] + got["a-v2"] == 200, got
        # 50/50 over 200 calls: 70..130 is more than four standard deviations either side.
        assert 70 <= got["a-v2"] <= 130, got


def test_a_retry_leaves_a_zone_whose_only_host_fails_for_the_next_zone() -> None:
    # No outlier detection and a registration that still says SERVING: only the retry can
    # leave zone-a's one host, which refuses connections (a host whose server died).
    mesh = _mesh({"v1": 100}, retry_policy={"retry_on": "connect-failure", "num_retries": 2})
    with upstreams("a1", "b1", "c1") as ups, _caller(mesh) as (hosts, caller):
        for name, zone in (("a1", "zone-a"), ("b1", "zone-b"), ("c1", "zone-c")):
            hosts.add(name, ups[name].address, zone)
        _until(caller, lambda k: k == "a1", "calls stay in zone-a")
        ups["a1"].stop()
        # Every call is answered, by the first zone of the failover order.
        assert _sample(caller, 30) == Counter(c1=30)


# A gRPC server on every address of its host (a namespace), answering any call with its name.
UPSTREAM = textwrap.dedent(
    """
    import sys, threading
    from concurrent import futures
    import grpc
    name = sys.argv[1].encode()
    class Who(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: name)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((Who(),))
    print(server.add_insecure_port("0.0.0.0:7000"), flush=True)
    server.start()
    threading.Event().wait()
    """
)


def test_a_partitioned_zone_fails_over_by_outlier_detection_and_comes_back() -> None:
    mesh = _mesh(
        {"v1": 100},
        outlier_detection={
            "consecutive_5xx": 2,
            "interval": "0.5s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        },
        connect_timeout="0.5s",
        # A partitioned host's open connection never answers: the try's timeout is the failure
        # outlier detection counts (a cancelled call would count for nothing).
        retry_policy={"num_retries": 1, "per_try_timeout": "0.5s"},
    )
    with HostNetwork(["a1", "b1", "c1"]) as net:
        procs = [
            net.popen(h, [sys.executable, "-c", UPSTREAM, h], stdout=subprocess.PIPE, cwd=REPO)
            for h in ("a1", "b1", "c1")
        ]
        try:
            for p in procs:
                assert p.stdout is not None and int(p.stdout.readline()) == 7000
            with _caller(mesh) as (hosts, caller):
                for h, zone in (("a1", "zone-a"), ("b1", "zone-b"), ("c1", "zone-c")):
                    hosts.add(h, f"{net[h].address}:7000", zone)
                _until(caller, lambda k: k == "a1", "calls stay in zone-a")
                net.partition("a1")  # its registration still says healthy: outlier detection
                _until(caller, lambda k: k == "c1", "zone-a's calls fail over to zone-c")
                net.heal("a1")
                _until(caller, lambda k: k == "a1", "calls come back to zone-a")
        finally:
            for p in procs:
                stop_group(p)
