"""Sidecar identity, change tracking and bounded state over real ADS streams (issue 9, defects 6
and 7, recovered NACKs of 13): duplicate node ids, lagging sidecars, waits without the mutation
lock, timeout validation, departed sidecars, metadata and table limits, unknown type URLs,
/debug/syncz off the ADS lock, NACKs cleared by a later ACK."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from mesh_common import type_urls as t
from meshlm.commands.sidecar import _default_node_id
from meshlm.commands.status import render
from tests.test_xds_support import AdsClient, eventually, sotw
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import MeshError, parse_mesh
from xds_server.server import XdsServer
from xds_server.xds.node import NodeInfo
from xds_server.xds.sync import MAX_TRACKERS, Limits

V1, V2 = "127.0.0.1:50051", "127.0.0.1:50052"


def mesh(*versions: str, lagging_after: str = "30s", **weights: int):
    eps = {"v1": V1, "v2": V2, "v3": "127.0.0.1:50053"}
    return parse_mesh(
        {
            "control_plane": {"lagging_after": lagging_after},
            "services": {
                "llm": {
                    "versions": {v: {"endpoints": [eps[v]]} for v in versions},
                    "route": {"weights": weights or {versions[0]: 100}},
                }
            },
        }
    )


@pytest.fixture
def cp() -> Iterator[XdsServer]:
    plane = build_server(mesh("v1", "v2"), debounce=0.02).start()
    try:
        yield plane
    finally:
        plane.stop()


def boot(c: AdsClient, cp: XdsServer, node: str) -> None:
    """Subscribe like Envoy (CDS, EDS, LDS, RDS) on an auto-ACKing client; wait for the ACKs."""
    c.send(sotw(t.CLUSTER))
    c.send(sotw(t.ENDPOINT, ["outbound|llm|v1", "outbound|llm|v2"]))
    c.send(sotw(t.LISTENER))
    c.send(sotw(t.ROUTE, ["outbound"]))
    eventually(
        lambda: cp.sync.state(node, cp.cache.generation)[0] == "acked", 10, f"{node} ACKed all"
    )


# -- defect 6: identity ---------------------------------------------------------------------------


def test_a_second_stream_with_a_live_node_id_is_rejected_and_its_end_keeps_the_holder(
    cp: XdsServer,
) -> None:
    holder = AdsClient(cp.grpc_port, "n1", auto_ack=True)
    dup = AdsClient(cp.grpc_port, "n1")
    try:
        boot(holder, cp, "n1")
        dup.send(sotw(t.CLUSTER))
        code, details = dup.closed_with()
        assert code == grpc.StatusCode.ALREADY_EXISTS
        assert "'n1' is already connected" in details
        dup.close()
        syncz = cp.syncz()
        assert syncz["nodes"]["n1"]["connected"]
        assert syncz["rejected"][-1]["code"] == "ALREADY_EXISTS"
        # The holder is still the node: a change waits for it, and it gets it.
        result = cp.update_mesh(mesh("v1", "v2", "v3"), timeout=10)
        assert result.ok and result.acked == ["n1"], result
    finally:
        holder.close()
        dup.close()


def test_sidecars_get_unique_node_ids_by_default() -> None:
    def args(**kw: object) -> argparse.Namespace:
        base = {"service": None, "version": None, "inbound_port": None, "outbound_port": None}
        return argparse.Namespace(**{**base, **kw})

    a = _default_node_id(args(outbound_port=15001))
    b = _default_node_id(args(outbound_port=15002))
    inbound = _default_node_id(args(service="llm", version="v1", inbound_port=15101))
    assert len({a, b, inbound}) == 3
    assert a == f"caller-{socket.gethostname()}-15001"  # stable across restarts (LKG key)
    assert inbound.startswith("llm-v1-")


# -- defect 6: change tracking --------------------------------------------------------------------


def test_a_never_acking_sidecar_is_reported_lagging_and_left_out_of_the_quorum() -> None:
    plane = build_server(mesh("v1", "v2", lagging_after="1s"), debounce=0.02).start()
    good = AdsClient(plane.grpc_port, "good", auto_ack=True)
    stuck = AdsClient(plane.grpc_port, "stuck")
    try:
        boot(good, plane, "good")
        stuck.send(sotw(t.CLUSTER))
        stuck.recv()  # and never ACK
        result = plane.set_weights("llm", {"v1": 50, "v2": 50}, timeout=5)
        assert result.ok, result
        assert result.acked == ["good"] and result.lagging == ["stuck"] and not result.missing
        syncz = plane.syncz()
        assert syncz["lagging"] == ["stuck"]
        assert syncz["nodes"]["stuck"]["lagging"] and not syncz["nodes"]["good"]["lagging"]
        assert syncz["nodes"]["stuck"]["behind_since"]
        assert "stuck (lagging)" in render(syncz) and "good (lagging)" not in render(syncz)
    finally:
        good.close()
        stuck.close()
        plane.stop()


def test_lagging_after_must_be_positive() -> None:
    with pytest.raises(MeshError, match=r"control_plane\.lagging_after: must be more than 0s"):
        mesh("v1", lagging_after="0s")


def test_a_waiting_change_does_not_block_the_next_one(cp: XdsServer) -> None:
    stuck = AdsClient(cp.grpc_port, "stuck")
    try:
        stuck.send(sotw(t.CLUSTER))
        stuck.recv()  # never ACKs: the first change waits for it
        first: list = []
        waiting = threading.Thread(
            target=lambda: first.append(cp.set_weights("llm", {"v1": 90, "v2": 10}, timeout=8))
        )
        waiting.start()
        eventually(lambda: cp.cache.generation == 1, 5, "the first change staged")
        second = cp.set_weights("llm", {"v1": 80, "v2": 20}, timeout=0)
        assert waiting.is_alive() and not first, "the second change waited for the first"
        assert second.version.endswith(".2")
        stuck.close()  # the first wait ends as its only sidecar leaves
        waiting.join(10)
        assert first and first[0].missing == ["stuck"]
    finally:
        stuck.close()


@pytest.mark.parametrize("timeout", ["inf", "nan", "-1", "1e9"])
def test_a_bad_timeout_is_400_and_stages_nothing(cp: XdsServer, timeout: str) -> None:
    before = dict(cp.mesh.services["llm"].route.weights)
    admin = AdminServer(cp, token="t0ken").start()
    try:
        req = urllib.request.Request(
            f"{admin.url}/v1/services/llm/weights?timeout={timeout}",
            data=json.dumps({"v1": 50, "v2": 50}).encode(),
            headers={"Authorization": "Bearer t0ken"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        body = json.loads(e.value.read())
        assert "timeout" in body["error"], body
        assert cp.cache.generation == 0
        assert cp.mesh.services["llm"].route.weights == before
    finally:
        admin.stop()
    with pytest.raises(ValueError, match="timeout: must be 0 to 600 seconds"):
        cp.update_mesh(mesh("v1"), timeout=float("inf"))
    assert cp.cache.generation == 0


def test_a_departed_sidecars_group_does_not_veto_removing_its_version() -> None:
    plane = build_server(mesh("v1", "v2"), debounce=0.02, limits=Limits(forget_after=0.5)).start()
    inbound = {
        "meshlm.service": "llm",
        "meshlm.version": "v2",
        "meshlm.inbound_port": 15102,
        "meshlm.local_endpoint": V2,
    }
    v2 = AdsClient(plane.grpc_port, "llm-v2", metadata=inbound)
    try:
        v2.send(sotw(t.CLUSTER))
        v2.recv()
        v2_group = NodeInfo.from_metadata(inbound)
        assert v2_group in plane.cache.groups()
        # While it is connected, its group still vetoes a mesh it cannot take.
        with pytest.raises(ValueError, match="unknown version 'v2'"):
            plane.update_mesh(mesh("v1"), timeout=0)
        v2.close()
        eventually(lambda: not plane.syncz()["nodes"]["llm-v2"]["connected"], 5, "v2 gone")
        result = plane.update_mesh(mesh("v1"), timeout=0)  # no ValueError any more
        assert "llm-v2" not in result.missing
        assert v2_group not in plane.cache.groups()
        # After forget_after the departed sidecar leaves the status too.
        eventually(lambda: "llm-v2" not in plane.syncz()["nodes"], 5, "v2 forgotten")
    finally:
        v2.close()
        plane.stop()


# -- defect 7: bounded state ----------------------------------------------------------------------


def test_oversized_or_malformed_metadata_is_invalid_argument_naming_the_limit(
    cp: XdsServer,
) -> None:
    big = AdsClient(
        cp.grpc_port, "big", metadata={"meshlm.outbound_port": 15001, "junk": "x" * 20_000}
    )
    bad_port = AdsClient(cp.grpc_port, "bad-port", metadata={"meshlm.outbound_port": "http"})
    try:
        big.send(sotw(t.CLUSTER))
        code, details = big.closed_with()
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "node.metadata is" in details and "max_metadata_bytes" in details
        bad_port.send(sotw(t.CLUSTER))
        code, details = bad_port.closed_with()
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "meshlm.outbound_port" in details
        assert not {"big", "bad-port"} & set(cp.syncz()["nodes"])
    finally:
        big.close()
        bad_port.close()


def test_the_node_table_is_bounded_and_departed_nodes_make_room() -> None:
    plane = build_server(mesh("v1", "v2"), debounce=0.02, limits=Limits(max_nodes=3)).start()
    clients: list[AdsClient] = []
    try:
        for i in range(3):  # come and go
            c = AdsClient(plane.grpc_port, f"gone-{i}")
            c.send(sotw(t.CLUSTER))
            c.recv()
            c.close()
        eventually(lambda: not any(n["connected"] for n in plane.syncz()["nodes"].values()), 5)
        for i in range(3):  # take their places
            c = AdsClient(plane.grpc_port, f"live-{i}")
            clients.append(c)
            c.send(sotw(t.CLUSTER))
            c.recv()
        assert set(plane.syncz()["nodes"]) == {"live-0", "live-1", "live-2"}
        extra = AdsClient(plane.grpc_port, "one-too-many")
        clients.append(extra)
        extra.send(sotw(t.CLUSTER))
        code, details = extra.closed_with()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_nodes" in details
        assert len(plane.syncz()["nodes"]) == 3
    finally:
        for c in clients:
            c.close()
        plane.stop()


def test_unknown_type_urls_get_an_empty_answer_and_are_not_kept(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "n1")
    try:
        c.send(sotw(t.CLUSTER))
        c.recv()
        made_up = [f"type.googleapis.com/made.up.T{i}" for i in range(50)]
        for tu in made_up:
            c.send(sotw(tu, ["x"]))
            r = c.recv()
            assert r.type_url == tu and not r.resources
            c.send(sotw(tu, ["x"], nonce="no-such-nonce"))  # an ACK of nothing: ignored
        c.assert_quiet(0.3)
        assert set(cp.syncz()["nodes"]["n1"]["types"]) == {"CDS"}
    finally:
        c.close()


def test_syncz_is_built_off_the_lock_ads_needs(cp: XdsServer) -> None:
    # Many sidecars with much metadata (registered directly: this is about the lock, not the
    # limits): a status that takes a second or more to build.
    md = {f"meshlm.k{j}": "v" * 20 for j in range(500)}
    for i in range(1000):
        cp.sync.connect(f"bulk-{i}", NodeInfo(outbound_port=20000 + i), "sotw", dict(md))
    c = AdsClient(cp.grpc_port, "n1")
    try:
        c.send(sotw(t.CLUSTER))
        cds = c.recv()
        built = threading.Event()
        reader = threading.Thread(target=lambda: (cp.syncz(), built.set()))
        reader.start()
        # While the status is being built, ADS goes on: an ACK is recorded, a request answered.
        c.send(sotw(t.CLUSTER, version=cds.version_info, nonce=cds.nonce))
        c.send(sotw(t.LISTENER))
        assert c.recv().type_url == t.LISTENER
        assert not built.is_set(), "ADS waited for /debug/syncz"
        reader.join(60)
        assert built.is_set()
    finally:
        c.close()


# -- defect 13: recovered NACKs -------------------------------------------------------------------


def test_a_nack_is_cleared_once_a_later_version_is_acked(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "n1")
    try:
        c.send(sotw(t.CLUSTER))
        r1 = c.recv()
        c.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r1.nonce))
        cp.update_mesh(mesh("v1", "v2", "v3"), timeout=0)
        r2 = c.recv()
        c.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r2.nonce, error="bad cluster"))
        eventually(lambda: cp.syncz()["nodes"]["n1"]["types"]["CDS"]["nack_error"], 5)
        assert "NACK" in render(cp.syncz())
        cp.update_mesh(mesh("v1", "v2"), timeout=0)
        r3 = c.recv()
        c.send(sotw(t.CLUSTER, version=r3.version_info, nonce=r3.nonce))
        eventually(
            lambda: cp.syncz()["nodes"]["n1"]["types"]["CDS"]["acked_version"] == r3.version_info,
            5,
        )
        cds = cp.syncz()["nodes"]["n1"]["types"]["CDS"]
        assert cds["nack_error"] == "" and cds["nack_version"] == ""
        assert r2.version_info in cds["recovered"] and "bad cluster" in cds["recovered"]
        assert "NACK" not in render(cp.syncz())  # meshlm status shows no stale error
    finally:
        c.close()


def test_a_burst_of_changes_converges_on_the_acks_of_its_last(cp: XdsServer) -> None:
    """Endpoint churn stages many changes before one push: at most MAX_TRACKERS of them are
    timed, and the ACKs of the newest settle every older one (holding a generation holds the
    ones before it), so none is left waiting and each is timed once."""
    c = AdsClient(cp.grpc_port, "burst", auto_ack=True)
    try:
        boot(c, cp, "burst")
        before = cp.syncz()["convergence"]["count"]
        for k in range(3 * MAX_TRACKERS):
            cp.add_endpoint("llm", "v1", f"127.0.0.3:{52000 + k}", timeout=0)
            assert len(cp.sync._trackers) <= MAX_TRACKERS
        eventually(lambda: cp.sync.state("burst", cp.cache.generation)[0] == "acked", 10)
        eventually(lambda: not cp.sync._trackers, 10, "every timed change converged")
        timed = cp.syncz()["convergence"]["count"] - before
        assert 1 <= timed <= MAX_TRACKERS
    finally:
        c.close()
