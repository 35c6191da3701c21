"""Security review, as tests: admin endpoints bind to loopback by default; plaintext API keys
never show up in the control plane's dumps, sync status, CSDS, Envoy's config dump, stats or
logs (the control plane's at debug level, admin audit lines included);
the sealed-weights key is never written to disk. (Mutations need the admin token: see
tests/test_fuzz_admin.py; client identity headers are stripped: tests/test_authz_envoy.py.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import tempfile
from pathlib import Path

import grpc
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc

from mesh_common.ports import free_port
from meshlm import logs
from meshlm.commands import serve as cmd_serve
from meshlm.commands import sidecar as cmd_sidecar
from meshlm.commands import xds_server as cmd_xds
from model_runtime.loading import sealed
from model_runtime.serving.telemetry import MetricsServer, Telemetry
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import upstreams
from wasm_filters.policy import hash_key
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

KEY = "sec-plaintext-key-7c1e9d"
WRONG = "sec-wrong-key-0000"


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on `port` (Linux /proc/net/tcp{,6})."""
    out: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
# 127.0.0.1, ::1, ::ffff:127.0.0.1


def test_admin_endpoints_bind_to_loopback_by_default() -> None:
    with upstreams("v1") as ups:
        mesh = parse_mesh({"services": {"llm": {"versions": {"v1": {"endpoints": [
            ups["v1"].address]}}}}})  # fmt: skip
        cp = build_server(mesh).start()
        admin = AdminServer(cp, token="t" * 20).start()
        metrics = MetricsServer(Telemetry(), 0)
        try:
            port = free_port()
            boot = ads_bootstrap("sec", xds_address=("127.0.0.1", cp.grpc_port),
                                 outbound_port=port, admin_port=free_port())  # fmt: skip
            with EnvoyProcess(boot) as envoy:
                envoy_admin = int(envoy.admin_url.rsplit(":", 1)[1])
                for what, p in [("ADS", cp.grpc_port), ("control plane admin", admin.port),
                                ("runtime metrics", metrics.port),
                                ("Envoy admin", envoy_admin)]:  # fmt: skip
                    found = _listen_addresses(p)
                    assert found and found <= LOOPBACK, (what, found)
        finally:
            metrics.stop()
            admin.stop()
            cp.stop()
    # The CLI defaults: every listener a user does not name is on loopback.
    for mod, argv in [(cmd_serve, ["--port", "0"]), (cmd_xds, ["--mesh", "m.yaml"]),
                      (cmd_sidecar, ["--xds", "127.0.0.1:1"])]:  # fmt: skip
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        args = vars(p.parse_args(argv))
        for k, v in args.items():
            if k.endswith("host") and v is not None:
                assert v == "127.0.0.1", (mod.__name__, k, v)


def test_plaintext_keys_never_in_dumps_stats_or_logs(tmp_path) -> None:
    tenants = {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"]}}
    with upstreams("runtime") as ups:
        runtime = ups["runtime"].address
        mesh = parse_mesh(
            {"services": {"llm": {"versions": {"v1": {"endpoints": [runtime]}}}},
             "tenants": tenants}
        )  # fmt: skip
        # The control plane's log at its most verbose, as --log-format json writes it.
        logged = io.StringIO()
        handler = logging.StreamHandler(logged)
        handler.setFormatter(logs.JsonFormatter())
        root, level = logging.getLogger(), logging.getLogger().level
        root.addHandler(handler)
        root.setLevel(logging.DEBUG)
        cp = build_server(mesh, debounce=0.01).start()
        admin = AdminServer(cp, token="t" * 20).start()
        port = free_port()
        boot = ads_bootstrap("sec-inbound", xds_address=("127.0.0.1", cp.grpc_port),
                             service="llm", version="v1", inbound_port=port,
                             local_endpoint=runtime)  # fmt: skip
        try:
            with EnvoyProcess(boot) as envoy, grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary("/meshlm.inference.v1.Inference/Generate")
                for key in (KEY, WRONG, KEY):
                    with contextlib.suppress(grpc.RpcError):
                        call(b"", metadata=(("x-api-key", key),), timeout=10)
                texts = {
                    "control plane config_dump": json.dumps(cp.config_dump()),
                    "control plane syncz": json.dumps(cp.syncz()),
                    "Envoy /config_dump": envoy.admin_get("/config_dump?include_eds"),
                    "Envoy /stats": envoy.admin_get("/stats"),
                    "Envoy /clusters": envoy.admin_get("/clusters"),
                    "Envoy log": envoy.log_tail(100000),
                }
                import urllib.request

                for path in ("/debug/config_dump", "/debug/syncz"):
                    with urllib.request.urlopen(admin.url + path, timeout=10) as r:
                        texts[f"admin GET {path}"] = r.read().decode()
                with grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") as ads:
                    csds = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(ads)
                    texts["CSDS"] = str(csds.FetchClientStatus(csds_pb2.ClientStatusRequest()))
                change = urllib.request.Request(
                    admin.url + "/v1/services/llm/weights", data=b'{"v1": 100}', method="POST",
                    headers={"Authorization": "Bearer " + "t" * 20},
                )  # fmt: skip
                with urllib.request.urlopen(change, timeout=30) as r:
                    assert r.status == 200
        finally:
            admin.stop()
            cp.stop()
            root.removeHandler(handler)
            root.setLevel(level)
        texts["control plane log"] = logged.getvalue()
        assert '"event": "admin"' in texts["control plane log"]  # the audit line is there
        assert "t" * 20 not in texts["control plane log"]  # nor the admin token
    for where, text in texts.items():
        for secret in (KEY, WRONG):
            assert secret not in text, f"{secret} leaked into {where}"
    assert hash_key(KEY) in texts["control plane config_dump"]  # the dump is real


def _mtimes(dirs: list[Path]) -> dict[Path, int]:
    """Files under `dirs` and their mtimes; other processes' temp files may vanish meanwhile."""
    out = {}
    for d in dirs:
        for root, _, names in os.walk(d):  # os.walk skips directories that vanish
            for name in names:
                p = Path(root, name)
                with contextlib.suppress(OSError):
                    out[p] = p.stat().st_mtime_ns
    return out


def test_sealed_weights_key_never_written_to_disk(tmp_path) -> None:
    key = sealed.new_key()
    forms = [key, key.hex().encode(), __import__("base64").b64encode(key)]
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(4096))
    watch = [tmp_path, Path(tempfile.gettempdir())]
    before = _mtimes(watch)
    sealed.seal(src, tmp_path / "weights.sealed", key)
    data = sealed.unseal_to_memory(tmp_path / "weights.sealed", key)
    with sealed.memory_file(data) as path:
        assert Path(path).read_bytes() == src.read_bytes()
        assert path.startswith("/proc/self/fd/")  # memfd: no file on any disk
    changed = [p for p, t in _mtimes(watch).items() if before.get(p) != t]
    assert changed  # the sealed file itself
    for p in changed:
        try:
            blob = p.read_bytes()
        except OSError:
            continue  # another process's temp file, gone already
        assert not any(f in blob for f in forms), f"the weight key was written to {p}"
