"""What a first user reads when a part of the mesh is down: the CLI names the admin address
without guessing its scheme and says what to check; a sidecar whose renewal fails says how long
its certificate holds and what happens after. Real control plane, real CA, real sockets."""

from __future__ import annotations

import shutil
import time

import pytest

from mesh_common.ports import free_port
from meshlm.admin_client import AdminClient, AdminError
from sidecar.identity import IdentityAgent
from tests.test_identity_support import identity_mesh, join_token_file, short_dir
from xds_server.compose import build_server


def test_cli_with_no_control_plane_names_the_port_and_what_to_check() -> None:
    port = free_port()  # nothing listens there
    guessed = AdminClient(f"http://127.0.0.1:{port}", guessed=True)
    with pytest.raises(AdminError) as e:
        guessed.request("GET", "/v1/status", timeout=5)
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "http://" not in msg.split("Another")[0], msg
    assert "Is `meshlm xds-server` running?" in msg and "--admin https://127.0.0.1:PORT" in msg
    explicit = AdminClient(f"http://127.0.0.1:{port}")
    with pytest.raises(AdminError) as e:
        explicit.request("GET", "/v1/status", timeout=5)
    assert f"http://127.0.0.1:{port}" in str(e.value)
    assert "is `meshlm xds-server` running there" in str(e.value)


def test_failed_renewal_says_until_when_calls_keep_working() -> None:
    d = short_dir()
    events: list[str] = []
    try:
        with build_server(identity_mesh("127.0.0.1:9", cert_ttl="20s"), debounce=0.02) as cp:
            token_file = join_token_file(cp, "default/caller", d)
            agent = IdentityAgent(d / "sc", join_token_file=token_file, on_event=events.append)
            agent.start()
            try:
                assert agent.wait_ready(15)
                not_after = agent.current.not_after
            finally:
                agent.stop()
        # The control plane is gone; the same sidecar, 12 s on (past half-life, before the end),
        # must renew and cannot.
        later = IdentityAgent(d / "sc", on_event=events.append, clock=lambda: time.time() + 12)
        later.start()
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any("trying again" in e for e in events):
                time.sleep(0.1)
        finally:
            later.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    retry = next(e for e in events if "trying again" in e)
    until = time.strftime("%H:%M:%S", time.localtime(not_after))
    assert f"valid until {until}" in retry, retry
    assert "calls keep working until then" in retry and "fail" in retry, retry
