"""The local scaler on real processes: `scale_out` starts `meshlm serve` (the real model) and its
inbound `meshlm sidecar`; added by EDS, the replica answers Generate calls through a caller
Envoy; `scale_in` stops both processes."""

from __future__ import annotations

import json
import urllib.request

from model_runtime.client import Client
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from sidecar.ports import free_port
from tests.test_xds_support import eventually
from xds_server.control_plane import ControlPlane
from xds_server.mesh import parse_mesh
from xds_server.scaler import LocalScaler


def _generate(port: int) -> str:
    with Client(f"127.0.0.1:{port}", authority="llm") as c:
        chunks = list(
            c.generate(messages=[{"role": "user", "content": "Say hi."}], max_new_tokens=2,
                       timeout=30)
        )  # fmt: skip
    return "".join(ch.text_delta for ch in chunks)


def test_local_scaler_replica_serves_through_the_mesh_and_is_stopped(tmp_path) -> None:
    mesh = parse_mesh(
        {"services": {"llm": {"versions": {"v1": {"precision": "int4", "endpoints": []}}}}}
    )
    with ControlPlane(mesh, debounce=0.02) as cp:
        scaler = LocalScaler(
            f"127.0.0.1:{cp.grpc_port}", serve_args=["--precision", "int4"], workdir=str(tmp_path)
        )
        endpoint = scaler.scale_out("llm", "v1")
        procs = list(scaler.procs[endpoint])
        try:
            assert cp.add_endpoint("llm", "v1", endpoint).ok
            port = free_port()
            boot = ads_bootstrap("caller", xds_address=("127.0.0.1", cp.grpc_port),
                                 outbound_port=port)  # fmt: skip
            with EnvoyProcess(boot):
                assert eventually(lambda: _generate(port), 60, "a Generate call answered")
            # The SLO loop reads the new runtime's TTFT there (issue 12 follow-up, gap b).
            with urllib.request.urlopen(scaler.metrics_url(endpoint), timeout=5) as r:
                assert json.loads(r.read())["ttft_ms"]["count"] >= 1
        finally:
            scaler.scale_in("llm", "v1", endpoint)
        assert all(p.poll() is not None for p in procs)
        assert endpoint not in scaler.procs and scaler.metrics_url(endpoint) is None
