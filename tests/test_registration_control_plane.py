"""Workload registration refuses what it must not believe or keep: bad input (the status names the
field), a plaintext control plane without the mesh's opt-in, an impostor on an identity mesh
(another service's certificate), a loopback address on a multi-host mesh, a duplicate address, and
registrations past the mesh's caps; each refusal is a log line with the node id and SPIFFE ID.
And what the control plane keeps: a reconnect within the grace period, `meshlm status`. Real
control plane on loopback, real gRPC streams (and real certificates of its mesh CA)."""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from meshlm.admin_client import AdminClient
from meshlm.commands import status as cmd_status
from tests.registration_support import RawStream, reg_mesh, register_body, registered
from tests.test_ads_mtls import _channel as mtls_channel
from tests.test_xds_support import eventually
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def cp():
    with build_server(reg_mesh(["127.0.0.9:9000"], max_per_service=2), debounce=0.02) as cp:
        yield cp


@pytest.mark.parametrize(
    ("message", "code", "field"),
    [
        (b"{not json", INVALID, "message:"),
        ({"register": {}, "health": "SERVING"}, INVALID, "message:"),
        ({"hello": {}}, INVALID, "message.hello: unknown"),
        (register_body("localhost:9100"), INVALID, "register.address:"),
        (register_body("127.0.0.2"), INVALID, "register.address:"),
        (register_body("127.0.0.2:0"), INVALID, "register.address:"),
        (register_body("0.0.0.0:9100"), INVALID, "register.address:"),
        (register_body("127.0.0.2:9100", node="a b"), INVALID, "register.node_id:"),
        (register_body("127.0.0.2:9100", service="nope"), INVALID, "register.service: unknown"),
        (register_body("127.0.0.2:9100", version="v9"), INVALID, "register.version: unknown"),
        (register_body("127.0.0.2:9100", zone="a/b"), INVALID, "register.zone:"),
        (register_body("127.0.0.2:9100", weight=0), INVALID, "register.weight:"),
        (register_body("127.0.0.2:9100", weight=True), INVALID, "register.weight:"),
        (register_body("127.0.0.2:9100", health="UP"), INVALID, "register.health:"),
        (register_body("127.0.0.2:9100", port=1), INVALID, "register.port: unknown field"),
        ({"health": "SERVING"}, grpc.StatusCode.FAILED_PRECONDITION, "message: the first"),
    ],
)
def test_bad_registration_is_refused_naming_the_field(cp, caplog, message, code, field) -> None:
    caplog.set_level(logging.WARNING, "meshlm.registry")
    got, details = RawStream(cp).send(message).status()
    assert got == code and details.startswith(field), (got, details)
    assert registered(cp) == {}
    assert any("registration refused" in r.getMessage() for r in caplog.records)


def test_a_second_register_on_one_stream_is_refused(cp) -> None:
    s = RawStream(cp).send(register_body("127.0.0.2:9100"))
    assert "registered" in s.recv()
    code, details = s.send(register_body("127.0.0.3:9100")).status()
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "one host per stream" in details
    assert "127.0.0.3:9100" not in registered(cp)


def test_duplicate_addresses_are_refused(cp, caplog) -> None:
    caplog.set_level(logging.WARNING, "meshlm.registry")
    # The mesh file's own endpoint.
    code, details = RawStream(cp).send(register_body("127.0.0.9:9000")).status()
    assert code == grpc.StatusCode.ALREADY_EXISTS, details
    assert details.startswith("register.address:") and "services.llm.versions.v1" in details
    # A live host's, by another node.
    first = RawStream(cp).send(register_body("127.0.0.2:9100", node="first"))
    assert "registered" in first.recv()
    code, details = RawStream(cp).send(register_body("127.0.0.2:9100", node="other")).status()
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'first'" in details, details
    line = next(r.getMessage() for r in caplog.records if "'other'" in r.getMessage())
    assert "no identity (plaintext port)" in line
    assert registered(cp)["127.0.0.2:9100"]["node"] == "first"


def test_registrations_past_the_cap_are_refused_and_memory_stays_bounded(cp) -> None:
    held = []
    for i in range(2):
        s = RawStream(cp).send(register_body(f"127.0.0.{10 + i}:9100", node=f"n{i}"))
        assert "registered" in s.recv()
        held.append(s)
    for i in range(5):  # a flood: every one refused, nothing kept
        code, details = (
            RawStream(cp).send(register_body(f"127.0.1.{i}:9100", node=f"x{i}")).status()
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "control_plane.registration.max_per_service" in details
    assert len(registered(cp)) == 2
    assert cp.registry.refused == 5


def test_total_cap_counts_every_service() -> None:
    with build_server(reg_mesh(max_total=1), debounce=0.02) as cp:
        s = RawStream(cp).send(register_body("127.0.0.2:9100"))
        assert "registered" in s.recv()
        code, details = RawStream(cp).send(register_body("127.0.0.3:9100", node="n2")).status()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "control_plane.registration.max_total" in details


def test_loopback_address_is_refused_on_a_multi_host_mesh() -> None:
    with build_server(reg_mesh(multi_host=True), debounce=0.02) as cp:
        code, details = RawStream(cp).send(register_body("127.0.0.2:9100")).status()
        assert code == INVALID and details.startswith("register.address:"), details
        assert "multi_host" in details
        s = RawStream(cp).send(register_body("10.1.2.3:9100"))
        assert "registered" in s.recv()


def test_plaintext_control_plane_refuses_registration_without_the_opt_in(caplog) -> None:
    caplog.set_level(logging.WARNING, "meshlm.registry")
    for mesh in (reg_mesh(enabled=None), reg_mesh(enabled=False)):
        with build_server(mesh, debounce=0.02) as cp:
            code, details = RawStream(cp).send(register_body("127.0.0.2:9100")).status()
            assert code == grpc.StatusCode.FAILED_PRECONDITION, details
            assert "control_plane.registration.enabled" in details
            assert registered(cp) == {}
    assert any("'n1'" in r.getMessage() for r in caplog.records)


def test_identity_mesh_believes_a_registration_only_for_its_certificates_service(caplog) -> None:
    caplog.set_level(logging.WARNING, "meshlm.registry")
    llm = "spiffe://meshlm.local/ns/default/sa/llm"
    other = "spiffe://meshlm.local/ns/default/sa/other"
    with build_server(reg_mesh(identity=True), debounce=0.02) as cp:
        # On by default where the port is mTLS; another service's certificate is refused.
        impostor = RawStream(channel=mtls_channel(cp, other))
        code, details = impostor.send(register_body("127.0.0.2:9100", node="imp")).status()
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert details.startswith("register.service:") and other in details
        line = next(r.getMessage() for r in caplog.records if "'imp'" in r.getMessage())
        assert other in line and "PERMISSION_DENIED" in line
        assert registered(cp) == {}
        # The service's own workload is believed, and its SPIFFE ID shown.
        own = RawStream(channel=mtls_channel(cp, llm)).send(register_body("127.0.0.2:9100"))
        assert "registered" in own.recv()
        assert registered(cp)["127.0.0.2:9100"]["spiffe_id"] == llm
        # A plaintext client does not get as far as the service.
        plain = RawStream(cp).send(register_body("127.0.0.3:9100"))
        assert plain.status()[0] == grpc.StatusCode.UNAVAILABLE


def test_status_lists_registered_hosts(capsys) -> None:
    """`meshlm status` (through the admin API's /debug/syncz): address, service/version, zone,
    since, health, node."""
    with build_server(reg_mesh(), debounce=0.02) as cp:
        admin = AdminServer(cp, token="t" * 32).start()
        try:
            s = RawStream(cp).send(register_body("127.0.0.2:9100", node="r1-node", zone="z1"))
            assert "registered" in s.recv()
            s.send({"health": "NOT_SERVING"})
            assert s.recv()["health"]["health"] == "NOT_SERVING"
            assert cmd_status.show(AdminClient(admin.url), as_json=False) == 0
            out = capsys.readouterr().out
            line = next(ln for ln in out.splitlines() if ln.startswith("127.0.0.2:9100"))
            since = registered(cp)["127.0.0.2:9100"]["since_iso"]
            assert line.split() == [
                "127.0.0.2:9100",
                "llm/v1",
                "z1",
                since,
                "NOT_SERVING",
                "r1-node",
            ]
        finally:
            admin.stop()


def test_a_reconnect_within_the_grace_period_keeps_the_host() -> None:
    with build_server(reg_mesh(grace="1s"), debounce=0.02) as cp:
        first = RawStream(cp).send(register_body("127.0.0.2:9100"))
        assert "registered" in first.recv()
        first.drop()
        eventually(lambda: registered(cp)["127.0.0.2:9100"]["stream"] == "lost", what="lost")
        # The same node takes it back; the first stream's grace period ends without effect.
        again = RawStream(cp).send(register_body("127.0.0.2:9100"))
        assert "registered" in again.recv()
        assert registered(cp)["127.0.0.2:9100"]["stream"] == "open"
        time.sleep(1.5)
        assert registered(cp)["127.0.0.2:9100"]["stream"] == "open"
        # A deregistration removes it at once, and the stream ends OK.
        assert "deregistered" in again.send({"deregister": {}}).recv()
        assert again.status() == (grpc.StatusCode.OK, "")
        assert registered(cp) == {}


def test_a_refused_first_message_is_logged_with_the_node_it_names(caplog) -> None:
    """A registration refused for its address still names its node in the log line, so an
    operator can find the host that sent it."""
    caplog.set_level(logging.WARNING, "meshlm.registry")
    with build_server(reg_mesh(multi_host=True), debounce=0.02) as cp:
        code, _ = RawStream(cp).send(register_body("127.0.0.2:9100", node="badhost-7")).status()
        assert code == INVALID
    lines = [r.getMessage() for r in caplog.records if "registration refused" in r.getMessage()]
    assert lines and "'badhost-7'" in lines[-1], lines
