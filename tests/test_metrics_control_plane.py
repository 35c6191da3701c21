"""The control plane's `GET /metrics` on the admin port (issue 16): Prometheus text that promtool
accepts, istiod's metrics under our prefix (pushes and NACKs by type, a convergence histogram with
cumulative buckets, connected sidecars), rollout state, step, weight and gate readings, SLO-loop
actions and quarantined classes. Over real ADS streams; over HTTPS on a real `meshlm xds-server`
whose mesh has identity."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from tests.promtool_support import check_metrics, scrape
from tests.test_admin_https import _start
from tests.test_admin_token import MESH
from tests.test_rollout_controller import FakeGrpcCounts
from tests.test_xds_support import AdsClient, eventually, sotw
from tests.test_xds_sync import boot
from xds_server.admin.api import AdminServer
from xds_server.admin.metrics import ControlPlaneMetrics
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.gates.sources import Sources
from xds_server.server import XdsServer
from xds_server.slo.loop import SloLoops

TOKEN = "t0ken-of-the-admin-api"


def _mesh(*versions: str):
    eps = {"v1": "127.0.0.1:50051", "v2": "127.0.0.1:50052", "v3": "127.0.0.1:50053"}
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {v: {"endpoints": [eps[v]]} for v in versions},
                    "route": {"weights": {"v1": 100, **{v: 0 for v in versions[1:]}}},
                    "slo": {
                        "ttft_p99": "500ms",
                        "interval": "1s",
                        "actions": ["shed"],
                    },
                }
            }
        }
    )


@pytest.fixture
def plane() -> Iterator[tuple[XdsServer, AdminServer]]:
    cp = build_server(_mesh("v1", "v2"), debounce=0.02).start()
    admin = AdminServer(cp, token=TOKEN).start()
    try:
        yield cp, admin
    finally:
        admin.stop()
        cp.stop()


def _families(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _samples(fam, suffix: str = "") -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == fam.name + suffix
    }


def _scrape(admin: AdminServer, context: ssl.SSLContext | None = None) -> dict:
    content_type, body = scrape(admin.url + "/metrics", context)
    assert content_type.startswith("text/plain; version=0.0.4")
    check_metrics(body)
    assert TOKEN.encode() not in body
    return _families(body)


def test_xds_pushes_rejects_convergence_and_sidecars(plane) -> None:
    cp, admin = plane
    acking = AdsClient(cp.grpc_port, "n1", auto_ack=True)
    nacking = AdsClient(cp.grpc_port, "n2")
    try:
        boot(acking, cp, "n1")  # subscribes every type, ACKs each
        assert cp.set_weights("llm", {"v1": 90, "v2": 10}, timeout=10).ok  # converged
        nacking.send(sotw(t.CLUSTER))
        r1 = nacking.recv()
        nacking.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r1.nonce))
        cp.update_mesh(_mesh("v1", "v2", "v3"), timeout=0)
        r2 = nacking.recv()
        nacking.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r2.nonce, error="bad"))
        eventually(lambda: cp.syncz()["nodes"]["n2"]["types"]["CDS"]["nack_error"], 5)
        fams = _scrape(admin)
    finally:
        acking.close()
        nacking.close()
    pushes = _samples(fams["meshlm_xds_pushes"], "_total")
    assert pushes[(("type", "cds"),)] >= 4  # n1: three versions, n2: two
    assert pushes[(("type", "ecds"),)] == 0  # every type has a series from the start
    rejects = _samples(fams["meshlm_xds_rejects"], "_total")
    assert rejects[(("type", "cds"),)] == 1 and rejects[(("type", "eds"),)] == 0
    assert _samples(fams["meshlm_xds_connected_sidecars"])[()] == 2
    conv = fams["meshlm_proxy_convergence_time_seconds"]
    buckets = [v for k, v in sorted(_samples(conv, "_bucket").items(), key=_le)]
    assert buckets == sorted(buckets), "convergence buckets must be cumulative"
    assert buckets[-1] == _samples(conv, "_count")[()] >= 1


def _le(item: tuple) -> float:
    return float(dict(item[0])["le"])


def test_rollout_and_slo_metrics(plane, tmp_path: Path) -> None:
    cp, _ = plane  # its own admin server below reads the rollouts and SLO loops
    sidecar = AdsClient(cp.grpc_port, "n1", auto_ack=True)
    counts = FakeGrpcCounts()  # a caller sidecar's counters, stood in
    rollouts = RolloutController(
        cp, str(tmp_path / "r.json"), lambda spec: Sources(counts), autorun=False
    )
    slo = SloLoops(cp)  # not started: its status is what is read
    try:
        boot(sidecar, cp, "n1")
        spec = {"service": "llm", "stable": "v1", "canary": "v2", "steps": [10, 50, 100],
                "interval": "1s", "threshold": 2, "gates": {"min_requests": 20}}  # fmt: skip
        rollouts.start(spec)
        counts.add(ok=30)
        rollouts.tick("llm", force=True)
        assert rollouts.status("llm")["canary_weight"] == 50
        metrics = ControlPlaneMetrics(cp, lambda: (rollouts, slo))
        running = AdminServer(cp, token=TOKEN, metrics=metrics).start()
        try:
            fams = _scrape(running)
        finally:
            running.stop()
    finally:
        rollouts.close()
        slo.stop()
        sidecar.close()
    state = _samples(fams["meshlm_rollout_state"])
    assert state[(("service", "llm"), ("state", "Progressing"))] == 1
    assert sum(state.values()) == 1
    llm = (("service", "llm"),)
    assert _samples(fams["meshlm_rollout_step"])[llm] == 1
    assert _samples(fams["meshlm_rollout_canary_weight_percent"])[llm] == 50
    assert _samples(fams["meshlm_rollout_gate_success_rate_percent"])[llm] == 100
    assert _samples(fams["meshlm_rollout_gate_requests"])[llm] == 30
    assert _samples(fams["meshlm_slo_level"])[llm] == 0
    actions = _samples(fams["meshlm_slo_action_in_force"])
    assert actions == {(("action", "shed"), ("service", "llm")): 0}


def test_quarantined_classes_are_counted_never_named(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from tests.test_isolation_envoy import the_mesh

    key = "0123456789abcdef"  # a request class (a prompt's fingerprint): not a label value
    cp = build_server(the_mesh(SimpleNamespace(port=9), SimpleNamespace(port=10)))
    admin = AdminServer(cp, token=TOKEN).start()
    try:
        cp.isolation.pin("llm", key)
        _, body = scrape(admin.url + "/metrics")
        check_metrics(body)
    finally:
        admin.stop()
    fams = _families(body)
    assert _samples(fams["meshlm_isolation_quarantined_classes"])[(("service", "llm"),)] == 1
    assert key.encode() not in body


def test_metrics_over_https_on_a_mesh_with_identity(tmp_path: Path) -> None:
    """No token (as every GET), the admin port's own certificate; promtool accepts it."""
    ports = {"ca_port": free_port(), "ca_mtls_port": free_port()}
    running = _start(tmp_path, {**MESH, "identity": {"cert_ttl": "10m"}, "control_plane": ports})
    try:
        ctx = ssl.create_default_context(cafile=str(running.ca_file))
        content_type, body = scrape(running.url + "/metrics", ctx)
        assert content_type.startswith("text/plain; version=0.0.4")
        check_metrics(body)
        fams = _families(body)
        assert _samples(fams["meshlm_xds_connected_sidecars"])[()] == 0
        assert "meshlm_rollout_state" in fams and "meshlm_slo_level" in fams  # wired in
    finally:
        running.xds.stop()
