"""The dashboard's state and event stream without a browser (issue 16 item 5): a control plane
and its admin server in this process, sidecars as hand-driven ADS streams. A NACK shows in the
sidecar's row; the event streams are bounded and end when the admin server stops."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator

import pytest

from mesh_common import type_urls as t
from tests.test_xds_support import AdsClient, eventually, sotw
from xds_server.admin.api import AdminServer
from xds_server.admin.dashboard.service import MAX_SUBSCRIBERS
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

TOKEN = "dashboard-state-token"


def _mesh(*versions: str):
    eps = {v: f"127.0.0.1:{9 + i}" for i, v in enumerate(versions)}
    return parse_mesh({"services": {"llm": {
        "versions": {v: {"endpoints": [eps[v]]} for v in versions},
        "route": {"weights": {"v1": 100, **{v: 0 for v in versions[1:]}}},
    }}})  # fmt: skip


@pytest.fixture
def plane() -> Iterator[tuple[XdsServer, AdminServer]]:
    cp = build_server(_mesh("v1", "v2"), debounce=0.02).start()
    admin = AdminServer(cp, token=TOKEN).start()
    try:
        yield cp, admin
    finally:
        admin.stop()
        cp.stop()


def _state(admin: AdminServer) -> dict:
    with urllib.request.urlopen(admin.url + "/dashboard/state", timeout=5) as r:
        return json.load(r)


def _open_stream(admin: AdminServer) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", admin.port), timeout=5)
    s.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: 127.0.0.1:{admin.port}\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    return s, buf


def test_a_nack_shows_in_the_sidecars_row(plane) -> None:
    cp, admin = plane
    nacking = AdsClient(cp.grpc_port, "n2")
    try:
        nacking.send(sotw(t.CLUSTER))
        r1 = nacking.recv()
        nacking.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r1.nonce))
        cp.update_mesh(_mesh("v1", "v2", "v3"), timeout=0)
        r2 = nacking.recv()
        nacking.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r2.nonce, error="bad v3"))
        row = eventually(
            lambda: [s for s in _state(admin)["sidecars"] if s["types"]["CDS"]["nack"]], 5
        )[0]
    finally:
        nacking.close()
    assert row["id"] == "n2"
    assert row["types"]["CDS"] == {
        "acked": r1.version_info,
        "nack": r2.version_info,
        "nack_error": "bad v3",
    }


def test_streams_are_bounded_and_end_when_the_admin_server_stops(plane) -> None:
    _, admin = plane
    streams = [_open_stream(admin) for _ in range(MAX_SUBSCRIBERS)]
    try:
        assert all(head.startswith(b"HTTP/1.1 200") for _, head in streams)
        extra, reply = _open_stream(admin)
        while chunk := extra.recv(65536):  # the body, then the server closes
            reply += chunk
        extra.close()
        assert reply.startswith(b"HTTP/1.1 503") and b"dashboards at once" in reply, reply
        admin.stop()
        for s, _ in streams:  # each stream's end: EOF, not a hang
            while s.recv(65536):
                pass
    finally:
        for s, _ in streams:
            s.close()


def test_the_page_carries_its_first_state_and_a_sidecars_text_cannot_close_the_block(
    plane,
) -> None:
    """`GET /dashboard/` holds the state as JSON in a data block; a NACK error (a sidecar's
    words) that closes it and opens a script stays text inside it."""
    cp, admin = plane
    hostile = "</script><script>alert(1)</script><!--"
    nacking = AdsClient(cp.grpc_port, "n3")
    try:
        nacking.send(sotw(t.CLUSTER))
        r1 = nacking.recv()
        nacking.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r1.nonce))
        cp.update_mesh(_mesh("v1", "v2", "v3"), timeout=0)
        r2 = nacking.recv()
        nacking.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r2.nonce, error=hostile))
        eventually(lambda: any(s["types"]["CDS"]["nack"] for s in _state(admin)["sidecars"]), 5)
        with urllib.request.urlopen(admin.url + "/dashboard/", timeout=5) as r:
            page = r.read().decode()
    finally:
        nacking.close()
    _, _, rest = page.partition('<script type="application/json" id="first-state">')
    block, _, tail = rest.partition("</script>")
    assert "<" not in block and "alert" not in tail, page  # the block ends where the page says
    doc = json.loads(block)
    assert [s["types"]["CDS"]["nack_error"] for s in doc["sidecars"]] == [hostile]
    assert set(doc["services"]["llm"]["versions"]) == {"v1", "v2", "v3"}
