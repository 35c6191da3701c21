"""The local scaler on real processes: `scale_out` starts `meshlm serve` (the real model) and its
inbound `meshlm sidecar`; added by EDS, the replica answers Generate calls through a caller
Envoy; `scale_in` stops both processes. On a mesh with identity the sidecar enrols with a join
token of the control plane's CA (a 0600 file, never on its command line) and serves mTLS."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh_common.ports import free_port
from model_runtime.serving.client import Client
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_identity_support import identity_sidecar, join_token_file, mode, short_dir
from tests.test_xds_support import eventually
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.slo.scaler import LocalScaler, control_plane_join_tokens


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = health_pb2.HealthCheckRequest()
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


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
    with build_server(mesh, debounce=0.02) as cp:
        scaler = LocalScaler(
            f"127.0.0.1:{cp.grpc_port}", serve_args=["--precision", "int4"], workdir=str(tmp_path)
        )
        endpoint = scaler.scale_out("llm", "v1")
        procs = list(scaler.procs[endpoint])
        try:
            # Added by EDS as soon as scale_out returns: the model must be loaded by then.
            runtime_port = int(procs[1].args[procs[1].args.index("--port") + 1])
            assert _health(runtime_port) == health_pb2.HealthCheckResponse.SERVING
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


def test_local_scaler_replica_of_an_identity_mesh_enrols_and_serves_over_mtls(tmp_path) -> None:
    # A service account of its own: the caller checks the replica's exact SPIFFE ID.
    llm = {"versions": {"v1": {"precision": "int4", "endpoints": []}}, "service_account": "ai/llm"}
    mesh = parse_mesh({"services": {"llm": llm}, "identity": {"trust_domain": "meshlm.local"}})
    d = short_dir()
    with build_server(mesh, debounce=0.02, identity_dir=str(d / "cp")) as cp:
        scaler = LocalScaler(
            f"127.0.0.1:{cp.grpc_port}", serve_args=["--precision", "int4"],
            workdir=str(tmp_path), join_tokens=control_plane_join_tokens(cp),
        )  # fmt: skip
        caller = None
        endpoint = scaler.scale_out("llm", "v1")
        argv = [str(a) for a in scaler.procs[endpoint][0].args]
        token_file = argv[argv.index("--join-token-file") + 1]
        identity_dir = argv[argv.index("--identity-dir") + 1]
        try:
            assert "--identity" in argv and mode(token_file) == 0o600
            assert json.loads(Path(token_file).read_text())["token"] not in " ".join(argv)
            assert cp.identity.tokens.count()["used"] == 1  # the sidecar enrolled with it
            assert cp.add_endpoint("llm", "v1", endpoint).ok
            port = free_port()
            token = join_token_file(cp, "default/caller", d)
            caller = identity_sidecar(cp, d, "caller", token, outbound_port=port)
            caller.sv.start()
            assert eventually(lambda: _generate(port), 60, "a Generate call answered")
            assert caller.stat("cluster.outbound|llm|v1.ssl.handshake") >= 1
        finally:
            if caller:
                caller.sv.stop()
            scaler.scale_in("llm", "v1", endpoint)
            shutil.rmtree(d, ignore_errors=True)
    # The spent token and the replica's private key go with it.
    assert not any(os.path.exists(p) for p in (token_file, identity_dir))
