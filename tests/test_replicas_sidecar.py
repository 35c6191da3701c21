"""`meshlm sidecar --xds A,B` with a last-known-good config (issue 15): the supervisor decides
between a last-known-good boot and ADS from any replica that answers, not only the first one
listed. With A down and B up it boots onto ADS and follows B; with both down it boots the
last-known-good config, and hot-restarts onto ADS once B (still not A) comes back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from mesh_common.ports import free_port
from mesh_common.process_group import stop_group
from sidecar.lkg import LastKnownGood
from tests.test_sidecar_supervisor import _envoy_children, _gone, _meshlm_sidecar
from tests.test_xds_support import Caller, eventually, llm_mesh, upstreams
from xds_server.compose import build_server


def test_sidecar_follows_ads_from_the_second_replica_when_the_first_is_down(tmp_path) -> None:
    lkg, node, port = tmp_path / "lkg.json", "caller-rep", free_port()
    dead, live = free_port(), free_port()  # nothing ever listens on `dead`
    args = ("--node-id", node, "--outbound-port", str(port), "--lkg-file", str(lkg))
    with upstreams("v1", "v2") as ups:
        cp = build_server(llm_mesh(ups, weights={"v1": 100, "v2": 0}), debounce=0.02)
        cp.start(grpc_port=live)
        sidecar = None
        try:
            # A last-known-good config that routes to v1, from a sidecar on replica B alone.
            sidecar = _meshlm_sidecar("--xds", f"127.0.0.1:{live}", *args, log=tmp_path / "a.log")
            caller = Caller(port)
            assert eventually(lambda: caller.who() == "v1", 60, what="routed via ADS")
            eventually(lambda: LastKnownGood(lkg).get(node) is not None, what="lkg stored")
            stop_group(sidecar)
            cp.set_weights("llm", {"v1": 0, "v2": 100})

            # A listed first and down, B up: ADS (v2), not the last-known-good config (v1).
            log = tmp_path / "b.log"
            sidecar = _meshlm_sidecar("--xds", f"127.0.0.1:{dead},127.0.0.1:{live}", *args,
                                      log=log)  # fmt: skip
            assert eventually(lambda: caller.who() == "v2", 60, what=f"follows B: {_tail(log)}")
            assert "envoy ready (ads)" in log.read_text(), _tail(log)
            assert "envoy ready (lkg)" not in log.read_text(), _tail(log)

            # Both down, Envoy crashes: last-known-good (v2); B back: onto ADS again (v1).
            cp.stop()
            (envoy,) = _envoy_children(sidecar.pid)
            _crash(envoy)
            eventually(lambda: "envoy ready (lkg)" in log.read_text(), 60, what=_tail(log))
            assert [caller.who() for _ in range(5)] == ["v2"] * 5
            cp = build_server(llm_mesh(ups, weights={"v1": 100, "v2": 0}), debounce=0.02)
            cp.start(grpc_port=live)
            assert eventually(lambda: caller.who() == "v1", 60, what=f"back on B: {_tail(log)}")
            assert "hot restart from last-known-good onto ADS" in log.read_text(), _tail(log)
            caller.close()
        finally:
            if sidecar is not None:
                stop_group(sidecar)
            cp.stop()


def _crash(pid: int) -> None:
    """SIGKILL one process (an Envoy crash) and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: _gone(pid), 10, what=f"envoy {pid} gone")


def _tail(log: Path) -> str:
    return log.read_text()[-1500:]
