"""`meshlm sidecar --register` as a real process: the host registers once its runtime answers
SERVING (and its Envoy holds its config), its health follows the runtime's grpc.health.v1, and
SIGTERM deregisters it before the listeners drain, so a loop of calls through a caller Envoy
loses none. And the sidecar's registration client over mTLS with its identity agent's
certificate: believed for its own service, refused for another's. In-process control plane on
real gRPC sockets, real Envoys, real gRPC upstreams with a health service for the runtime."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from mesh_common.ports import free_port
from meshlm.demo.procs import Proc
from sidecar.identity import IdentityAgent
from sidecar.registration import Registration
from tests.registration_support import reg_mesh, registered
from tests.test_identity_support import join_token_file, short_dir
from tests.test_xds_support import Caller, CallLoop, eventually, sidecar, upstreams
from xds_server.compose import build_server


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(timeout=10)


def test_sidecar_registers_follows_health_and_deregisters_before_draining(
    tmp_path: Path, procs: list[Proc]
) -> None:
    with upstreams("static", "r1", health=True) as ups:
        ups["r1"].set_serving(False)  # still starting: not registered yet
        mesh = reg_mesh([ups["static"].address])
        cp = build_server(mesh, debounce=0.02).start()
        envoy, port = sidecar(cp, "caller-1")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who() == "static", what="the static endpoint serves")
                inbound = free_port()
                argv = (
                    f"sidecar --xds 127.0.0.1:{cp.grpc_port} --service llm --version v1 "
                    f"--inbound-port {inbound} --local-endpoint {ups['r1'].address} "
                    f"--register 127.0.0.1:{inbound} --zone zone-a --node-id r1-sidecar"
                ).split()
                env = {"XDG_RUNTIME_DIR": str(short_dir())}
                sc = Proc.meshlm("sidecar", argv, tmp_path, env=env).start()
                procs.append(sc)
                address = f"127.0.0.1:{inbound}"
                eventually(lambda: "envoy ready" in sc.tail(50), 90, "the sidecar's envoy")
                assert address not in registered(cp), "registered before its runtime serves"
                ups["r1"].set_serving(True)
                eventually(lambda: address in registered(cp), 30, "the host registered")
                row = registered(cp)[address]
                assert (row["node"], row["zone"], row["health"]) == (
                    "r1-sidecar", "zone-a", "SERVING",
                )  # fmt: skip
                eventually(lambda: "r1" in {caller.who() for _ in range(10)}, 30, "calls reach r1")
                # The runtime stops serving, then serves again: the registration follows.
                ups["r1"].set_serving(False)
                eventually(
                    lambda: registered(cp)[address]["health"] == "NOT_SERVING", 30, "NOT_SERVING"
                )
                ups["r1"].set_serving(True)
                eventually(lambda: registered(cp)[address]["health"] == "SERVING", 30, "SERVING")
                with CallLoop(port) as loop:
                    eventually(lambda: loop.served["r1"] >= 5, 30, "the loop reaches r1")
                    sc.popen.send_signal(signal.SIGTERM)
                    assert sc.popen.wait(30) == 0, sc.tail(30)
                    after = loop.total()
                    eventually(lambda: loop.total() >= after + 30, what="calls go on")
                assert loop.failures == [], loop.failures[:3]
                assert registered(cp) == {}
                log = sc.log_path.read_text()
                assert log.index(f"deregistered {address}") < log.index("draining"), log
                caller.close()
        finally:
            cp.stop()


def test_registration_over_mtls_is_believed_for_its_own_service_only() -> None:
    where = short_dir()
    with build_server(reg_mesh(identity=True), debounce=0.02, identity_dir=str(where)) as cp:
        clients, agents = [], []
        try:
            for sa, address in (("default/llm", "127.0.0.2:9100"), ("default/x", "127.0.0.3:9100")):
                events: list[str] = []
                name = sa.split("/")[1]
                token = join_token_file(cp, sa, where)
                agent = IdentityAgent(where / name, join_token_file=token).start()
                agents.append(agent)
                assert agent.wait_ready(30), "the agent got a certificate"
                client = Registration(
                    name, address, "llm", "v1", [("127.0.0.1", cp.grpc_port)], lambda: True,
                    identity=agent, poll_interval=0.05, backoff=(0.1, 0.5),
                    on_event=events.append,
                )  # fmt: skip
                clients.append((client.start(), events))
            eventually(lambda: "127.0.0.2:9100" in registered(cp), 30, "llm's host registered")
            assert registered(cp)["127.0.0.2:9100"]["spiffe_id"].endswith("/ns/default/sa/llm")
            _, events = clients[1]
            eventually(lambda: any("PERMISSION_DENIED" in e for e in events), 30, "refused")
            assert "127.0.0.3:9100" not in registered(cp)
            assert grpc.StatusCode.PERMISSION_DENIED.name in events[-1]
        finally:
            for c, _ in clients:
                c.stop()
            for a in agents:
                a.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--register 127.0.0.1:7001", "--register needs --service, --version and --inbound-port"),
        ("--weight 2", "--weight needs --register"),
        (
            "--service llm --version v1 --inbound-port 7001 --local-endpoint 127.0.0.1:1 "
            "--register 127.0.0.1:7002",
            "--register: port 7002 is not --inbound-port 7001",
        ),
        (
            "--service llm --version v1 --inbound-port 7001 --local-endpoint 127.0.0.1:1 "
            "--register 10.0.0.5:7001",
            "--register: 10.0.0.5 is not where the inbound listener binds (--listen-host "
            "127.0.0.1)",
        ),
        (
            "--service llm --version v1 --inbound-port 7001 --local-endpoint 127.0.0.1:1 "
            "--register 127.0.0.1:7001 --weight 0",
            "--weight: expected 1..128, got 0",
        ),
    ],
)
def test_register_flags_are_checked_before_anything_starts(flags: str, message: str) -> None:
    cmd = [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds", "127.0.0.1:1", *flags.split()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
