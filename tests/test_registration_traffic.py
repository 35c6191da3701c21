"""A version whose hosts registered themselves can take traffic: `meshlm status` (GET /traffic)
does not say its traffic has nowhere to go while a registered host serves, and the weights API
does not refuse traffic to it as to a version with no endpoint; once its registered hosts all
answer NOT_SERVING, both warn, naming that. Real control plane and admin API on loopback, real
registration streams."""

from __future__ import annotations

from meshlm.admin_client import AdminClient
from meshlm.commands import status as cmd_status
from tests.registration_support import RawStream, reg_mesh, register_body
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server

TOKEN = "t" * 32


def _mesh():
    """llm: v1 and v2, neither with a static endpoint, all traffic on v1."""
    versions = {"v1": {"endpoints": []}, "v2": {"endpoints": []}}
    return reg_mesh(service={"versions": versions, "route": {"weights": {"v1": 100, "v2": 0}}})


def _stranded(admin: AdminClient) -> list[dict]:
    status, body = admin.request("GET", "/traffic")
    assert status == 200, body
    return body["stranded"]


def _weights(admin: AdminClient, v1: int, v2: int) -> tuple[int, dict]:
    return admin.request("POST", "/v1/services/llm/weights?timeout=10", {"v1": v1, "v2": v2})


def test_registered_hosts_take_traffic_for_status_and_the_weights_api(capsys) -> None:
    with build_server(_mesh(), debounce=0.02) as cp:
        server = AdminServer(cp, token=TOKEN).start()
        admin = AdminClient(server.url, token=TOKEN)
        try:
            # No host at all: stranded, refused, as before.
            assert [s["version"] for s in _stranded(admin)] == ["v1"]
            assert _weights(admin, 90, 10)[0] == 409

            v1 = RawStream(cp).send(register_body("127.0.0.2:9101", node="v1-host"))
            assert "registered" in v1.recv()
            v2 = RawStream(cp).send(register_body("127.0.0.3:9102", node="v2-host", version="v2"))
            assert "registered" in v2.recv()
            assert _stranded(admin) == []
            assert cmd_status.show(AdminClient(server.url), as_json=False) == 0
            assert "nowhere to go" not in capsys.readouterr().out
            status, reply = _weights(admin, 90, 10)
            assert status == 200 and not reply.get("warnings"), reply
            assert cp.mesh.services["llm"].route.weights["v2"] == 10

            # Every registered host of v2 NOT_SERVING: a warning naming it, not a refusal.
            v2.send({"health": "NOT_SERVING"})
            assert v2.recv()["health"]["health"] == "NOT_SERVING"
            (stranded,) = _stranded(admin)
            assert stranded["version"] == "v2" and not stranded["no_endpoint"]
            assert "NOT_SERVING" in stranded["message"], stranded
            status, reply = _weights(admin, 80, 20)
            assert status == 200 and "NOT_SERVING" in " ".join(reply["warnings"]), reply
        finally:
            server.stop()
