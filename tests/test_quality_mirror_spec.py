"""The quality gate's mirror mode (issue 18) without processes: the spec (messages naming the
field, persisted whole), the Envoy resources it asks for (a shadow cluster with a circuit
breaker, a mirror policy only on the routes of safe-marked calls, a caller's `-shadow` authority
refused, `x-meshlm-shadow` set only for a shadow at the inbound sidecar), and the controller
(mirror on during steps, off at promotion or rollback; the slow measurement out of its lock).
Real Envoys and runtimes: tests/test_quality_mirror.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_pb2,
)

from mesh_common import type_urls as t
from tests.test_rollout_controller import FakeApplyResult, FakeControlPlane, FakeGrpcCounts
from xds_server.compose import build_server
from xds_server.mesh import MeshError, Mirror, parse_mesh
from xds_server.mesh.rollout_spec import RolloutSpecError, parse_rollout
from xds_server.replica.replication import desired_mesh, live_doc
from xds_server.resources.build import build_resources
from xds_server.rollout.api import spec_from_mesh
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.gates.sources import Sources
from xds_server.rollout.quality import MirrorSource
from xds_server.rollout.sources import configured_sources
from xds_server.rollout.verdict import FAIL, PASS, Verdict
from xds_server.xds.node import NodeInfo

BASE = {"stable": "v1", "canary": "v2"}
MIRROR = {"mode": "mirror", "mirror_percent": 25, "min_samples": 3, "max_logprob_drift": 0.1}


def mesh_doc(quality: dict | None = None) -> dict:
    doc: dict[str, Any] = {
        "services": {
            "llm": {
                "versions": {
                    "v1": {"endpoints": ["127.0.0.1:1"], "metrics_urls": ["http://127.0.0.1:3"]},
                    "v2": {"endpoints": ["127.0.0.1:2"], "metrics_urls": ["http://127.0.0.1:4"]},
                },
                "route": {"weights": {"v1": 90, "v2": 10}},
            }
        },
    }
    if quality is not None:
        doc["rollouts"] = {"llm": {**BASE, "steps": [50, 100], "quality": quality}}
    return doc


def test_a_mirror_gate_needs_no_prompts_and_is_kept_whole() -> None:
    s = parse_rollout("llm", {**BASE, "quality": MIRROR})
    q = s.quality
    assert (q.mode, q.mirror_percent, q.min_samples, q.max_logprob_drift) == ("mirror", 25, 3, 0.1)
    assert q.prompts == () and q.replay_via == ""
    assert q.to_dict() == {**MIRROR, "max_token_disagreement": 0.05}
    again = parse_rollout("llm", json.loads(json.dumps(s.to_dict())))
    assert again == s
    from_file = parse_rollout("llm", spec_from_mesh(parse_mesh(mesh_doc(MIRROR)), "llm"))
    assert from_file.quality == q
    src = configured_sources(build_server(parse_mesh(mesh_doc())))(s)
    assert isinstance(src.quality, MirrorSource)


@pytest.mark.parametrize(
    ("quality", "field"),
    [
        ({"mode": "shadow"}, "quality.mode"),
        ({"prompts": ["a"]}, "quality.prompts"),  # a replay field
        ({"replay_via": "127.0.0.1:1"}, "quality.replay_via"),
        ({"mirror_percent": 0}, "quality.mirror_percent"),
        ({"mirror_percent": 101}, "quality.mirror_percent"),
        ({"mirror_percent": "10%"}, "quality.mirror_percent"),
        ({"min_samples": 0}, "quality.min_samples"),
        ({"max_token_disagreement": "150%"}, "quality.max_token_disagreement"),
    ],
)
def test_a_bad_mirror_block_names_its_field(quality: dict, field: str) -> None:
    with pytest.raises(RolloutSpecError) as e:
        parse_rollout("llm", {**BASE, "quality": {**MIRROR, **quality}})
    assert str(e.value).startswith(f"rollouts.llm.{field}"), e.value


def caller(mirror: Mirror | None) -> dict:
    m = parse_mesh(mesh_doc()).with_mirror("llm", mirror)
    return build_resources(m, NodeInfo(outbound_port=15001))


def test_mirroring_copies_only_safe_marked_calls_to_a_shadow_cluster_with_a_breaker() -> None:
    res = caller(Mirror("v2", 12.5))
    vhost = res[t.ROUTE]["outbound"].virtual_hosts[0]
    names = [r.name for r in vhost.routes]
    assert names == ["llm-orca-refused", "llm-canary-always", "llm-canary-never-mirror",
                     "llm-canary-never", "llm-weighted-mirror", "llm-weighted"]  # fmt: skip
    for r in vhost.routes[1:]:
        policies = list(r.route.request_mirror_policies)
        if not r.name.endswith("-mirror"):
            assert not policies and "x-meshlm-mirror" not in [h.name for h in r.match.headers]
            continue
        marker = [h for h in r.match.headers if h.name == "x-meshlm-mirror"]
        assert [h.string_match.exact for h in marker] == ["safe"]
        assert [p.cluster for p in policies] == ["outbound|llm|v2|shadow"]
        pct = policies[0].runtime_fraction.default_value
        assert pct.numerator / 1_000_000 == 0.125
    shadow = res[t.CLUSTER]["outbound|llm|v2|shadow"]
    limits = shadow.circuit_breakers.thresholds[0]
    assert limits.max_requests.value > 0 and limits.max_pending_requests.value > 0
    assert not shadow.health_checks
    ep = res[t.ENDPOINT]["outbound|llm|v2|shadow"].endpoints[0].lb_endpoints[0]
    assert ep.endpoint.address.socket_address.port_value == 2  # the canary's hosts
    none = caller(None)
    assert "outbound|llm|v2|shadow" not in none[t.CLUSTER]
    assert all(not r.route.request_mirror_policies
               for r in none[t.ROUTE]["outbound"].virtual_hosts[0].routes)  # fmt: skip


def test_a_callers_shadow_authority_is_refused_and_only_a_shadow_is_marked_inbound() -> None:
    forged = caller(None)[t.ROUTE]["outbound"].virtual_hosts[-1]
    assert list(forged.domains) == ["*"]
    route = forged.routes[0]  # before the default service's routes and the 404
    assert route.direct_response.status == 403
    assert "-shadow" in route.direct_response.body.inline_string
    mirrored = parse_mesh(mesh_doc()).with_mirror("llm", Mirror("v2", 10))

    def inbound(mesh, version: str):
        node = NodeInfo(
            service="llm", version=version, inbound_port=9, local_endpoint="127.0.0.1:5"
        )
        return build_resources(mesh, node)

    # no copy due (no mirror, or one to another version): a -shadow authority is refused
    for mesh, version in ((parse_mesh(mesh_doc()), "v2"), (mirrored, "v1")):
        routes = inbound(mesh, version)[t.ROUTE][f"inbound|llm|{version}"].virtual_hosts[0].routes
        refusal = [r for r in routes if r.name.endswith("-shadow")]
        assert [r.name for r in refusal] == [f"llm-{version}-forged-shadow"]
        assert refusal[0].direct_response.status == 403
        assert all(not r.request_headers_to_add for r in routes)
    res = inbound(mirrored, "v2")
    routes = res[t.ROUTE]["inbound|llm|v2"].virtual_hosts[0].routes
    shadows = [r for r in routes if r.name.endswith("-shadow")]
    assert [r.name for r in shadows] == ["llm-v2-local-shadow"]
    assert [h.name for h in shadows[0].match.headers] == [":authority"]
    added = [(h.header.key, h.header.value) for h in shadows[0].request_headers_to_add]
    assert added == [("x-meshlm-shadow", "1")]
    assert all(not r.request_headers_to_add for r in routes if r not in shadows)
    hcm = hcm_pb2.HttpConnectionManager()
    res[t.LISTENER]["inbound|llm|v2"].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    early = early_pb2.HeaderMutation()
    hcm.early_header_mutation_extensions[0].typed_config.Unpack(early)
    assert "x-meshlm-shadow" in [mu.remove for mu in early.mutations]


class MirroringControlPlane(FakeControlPlane):
    """FakeControlPlane that also records the mirror it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.mirrors: list[Mirror | None] = []

    def set_mirror(self, service: str, mirror: Mirror | None, *, timeout: float) -> Any:
        self.mirrors.append(mirror)
        return FakeApplyResult(True)


class FakeQuality:
    """A quality source whose verdict waits for `release` (a slow replay or join)."""

    def __init__(self, outcome: str = PASS) -> None:
        self.outcome = outcome
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()
        self.begun = 0

    def begin(self) -> None:
        self.begun += 1

    def verdict(self) -> Verdict:
        self.entered.set()
        assert self.release.wait(30)
        return Verdict(self.outcome, f"quality {self.outcome}", {"quality": {"samples": 3}})


def controller(tmp_path: Path, quality: FakeQuality) -> tuple[Any, FakeGrpcCounts, Any]:
    cp, counts = MirroringControlPlane(), FakeGrpcCounts()
    c = RolloutController(
        cp, str(tmp_path / "r.json"), lambda spec: Sources(counts, quality=quality),
        autorun=False,
    )  # fmt: skip
    return cp, counts, c


SPEC = {"service": "llm", **BASE, "steps": [10, 50], "interval": "1s", "threshold": 1,
        "gates": {"min_requests": 1}, "quality": MIRROR}  # fmt: skip


@pytest.mark.parametrize("outcome", [PASS, FAIL])
def test_the_mirror_runs_during_steps_only(tmp_path: Path, outcome: str) -> None:
    q = FakeQuality(outcome)
    cp, counts, c = controller(tmp_path, q)
    c.start(SPEC)
    assert cp.mirrors == [Mirror("v2", 25.0)] and q.begun == 1
    for _ in range(2):
        counts.add(ok=5)
        c.tick("llm", force=True)
    st = c.status("llm")
    assert st["state"] == ("Succeeded" if outcome == PASS else "RolledBack")
    on = Mirror("v2", 25.0)
    # on for each step, removed once the rollout ended, either way
    assert cp.mirrors == ([on, on, None] if outcome == PASS else [on, None])


def test_a_slow_quality_verdict_holds_no_lock_and_a_pause_meanwhile_discards_it(
    tmp_path: Path,
) -> None:
    q = FakeQuality(FAIL)
    _, counts, c = controller(tmp_path, q)
    c.start(SPEC)
    counts.add(ok=5)
    q.release.clear()
    q.entered.clear()
    ticking = threading.Thread(target=c.tick, args=("llm",), kwargs={"force": True})
    ticking.start()
    try:
        assert q.entered.wait(10)  # the verdict is being computed
        paused: list[dict] = []
        pausing = threading.Thread(target=lambda: paused.append(c.pause("llm")), daemon=True)
        pausing.start()
        pausing.join(10)
        assert paused and paused[0]["state"] == "Paused"  # before the verdict came
    finally:
        q.release.set()
        ticking.join(30)
    st = c.status("llm")
    assert st["state"] == "Paused" and st["analyses"] == []  # the stale FAIL was not applied
    c.resume("llm")
    counts.add(ok=5)
    c.tick("llm", force=True)
    assert c.status("llm")["state"] == "RolledBack"


def test_the_mirror_is_live_state_kept_by_a_new_mesh_file_and_by_replicas() -> None:
    doc = mesh_doc()
    cp = build_server(parse_mesh(doc))
    cp.set_mirror("llm", Mirror("v2", 10), timeout=1)
    cp.apply_mesh(parse_mesh(doc), timeout=1)  # the operator's file does not say: kept
    svc = cp.mesh.services["llm"]
    assert svc.route.mirror == Mirror("v2", 10.0)
    # replicas keep it in live/<service> (xds_server/replica/replication.py)
    again = desired_mesh(doc, {"llm": json.loads(json.dumps(live_doc(svc)))})
    assert again.services["llm"].route.mirror == Mirror("v2", 10.0)
    with pytest.raises(MeshError, match=r"route\.mirror\.version: unknown version 'v9'"):
        cp.mesh.with_mirror("llm", Mirror("v9", 10))
    cp.set_mirror("llm", None, timeout=1)
    assert cp.mesh.services["llm"].route.mirror is None


def test_a_service_named_like_a_shadow_is_refused() -> None:
    doc = mesh_doc()
    doc["services"]["llm-shadow"] = doc["services"].pop("llm")
    with pytest.raises(MeshError, match=r"^services\.llm-shadow: a service name must not end"):
        parse_mesh(doc)
