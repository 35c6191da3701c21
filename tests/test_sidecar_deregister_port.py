"""`meshlm sidecar --register ... --deregister-port P` as a real process: `POST /deregister` on
127.0.0.1:P takes the host out of its callers' pools and answers once they hold it, while the
sidecar keeps running, so its runtime can then drain behind a live inbound listener (the order a
Kubernetes preStop hook on the runtime gives); a loop of calls through a caller Envoy loses
none, and SIGTERM afterwards stops the sidecar without a second deregistration. In-process
control plane on real gRPC sockets, real Envoys, real gRPC upstreams with a health service."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mesh_common.ports import free_port
from meshlm.demo.procs import Proc
from tests.registration_support import reg_mesh, registered
from tests.test_identity_support import short_dir
from tests.test_xds_support import Caller, CallLoop, eventually, sidecar, upstreams
from xds_server.compose import build_server


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(timeout=10)


def _post(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="POST", data=b"")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_post_deregister_takes_the_host_out_and_the_sidecar_keeps_serving(
    tmp_path: Path, procs: list[Proc]
) -> None:
    with upstreams("static", "r1", health=True) as ups:
        cp = build_server(reg_mesh([ups["static"].address]), debounce=0.02).start()
        envoy, port = sidecar(cp, "caller-1")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who() == "static", what="the static endpoint serves")
                inbound, hook = free_port(), free_port()
                argv = (
                    f"sidecar --xds 127.0.0.1:{cp.grpc_port} --service llm --version v1 "
                    f"--inbound-port {inbound} --local-endpoint {ups['r1'].address} "
                    f"--register 127.0.0.1:{inbound} --deregister-port {hook} "
                    "--node-id r1-sidecar"
                ).split()
                env = {"XDG_RUNTIME_DIR": str(short_dir())}
                sc = Proc.meshlm("sidecar", argv, tmp_path, env=env).start()
                procs.append(sc)
                address = f"127.0.0.1:{inbound}"
                eventually(lambda: address in registered(cp), 90, "the host registered")
                url = f"http://127.0.0.1:{hook}/deregister"
                assert _post(f"http://127.0.0.1:{hook}/other")[0] == 404
                with CallLoop(port) as loop:
                    eventually(lambda: loop.served["r1"] >= 5, 30, "the loop reaches r1")
                    # The hook's client, as a preStop hook runs it.
                    hook_cmd = [sys.executable, "-m", "sidecar.deregister_port", str(hook)]
                    r = subprocess.run(hook_cmd, capture_output=True, text=True, timeout=60)
                    assert r.returncode == 0, r.stderr
                    body = json.loads(r.stdout)
                    assert body == {"deregistered": True, "was_registered": True}, body
                    # Out of the pool once the answer came, with the sidecar still up.
                    assert address not in registered(cp)
                    assert sc.popen.poll() is None, sc.tail(30)
                    # A call sent before the callers held the removal may still finish there;
                    # after those, none goes to the host.
                    after = loop.total()
                    eventually(lambda: loop.total() >= after + 5, what="calls go on")
                    served, after = loop.served["r1"], loop.total()
                    eventually(lambda: loop.total() >= after + 30, what="calls go on")
                    assert loop.served["r1"] == served
                assert loop.failures == [], loop.failures[:3]
                # Its runtime would drain now; the listener still answers until SIGTERM.
                assert _post(url) == (200, {"deregistered": False, "was_registered": False})
                sc.popen.send_signal(signal.SIGTERM)
                assert sc.popen.wait(30) == 0, sc.tail(30)
                log = sc.log_path.read_text()
                assert log.count(f"deregistered {address}") == 1, log
                caller.close()
        finally:
            cp.stop()


def test_deregister_port_needs_register() -> None:
    cmd = [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds", "127.0.0.1:1",
           "--outbound-port", "15001", "--deregister-port", "15020"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--deregister-port needs --register" in r.stderr, r.stderr
