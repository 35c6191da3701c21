"""A sidecar with workload identity on real Envoy (issue 14): its agent gets a SPIFFE certificate
from the mesh CA by join token, serves it to Envoy by SDS, renews it under a running Envoy with
no failed request, and boots with it while the control plane is down. No key or token bytes in
the logs, Envoy's config_dump or the last-known-good file."""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.identity import CREDENTIALS_FILE, IdentityAgent
from sidecar.lkg import LastKnownGood
from sidecar.supervisor import Supervisor
from tests.test_identity_support import (
    identity_mesh,
    join_token_file,
    mode,
    san,
    short_dir,
    tls_get,
    tls_listener,
)
from tests.test_xds_support import eventually, upstreams
from xds_server.compose import build_server

SPIFFE_CALLER = "spiffe://meshlm.local/ns/default/sa/caller"


def _sidecar(cp_port: int, d: Path, lkg: LastKnownGood, agent: IdentityAgent, events: list):
    tls_port = free_port()
    boot = ads_bootstrap(
        "caller-id",
        xds_address=("127.0.0.1", cp_port),
        outbound_port=free_port(),
        admin_port=free_port(),
    )
    boot["static_resources"]["listeners"] = [tls_listener(tls_port)]
    sv = Supervisor(
        "caller-id",
        boot,
        ("127.0.0.1", cp_port),
        lkg=lkg,
        poll_interval=0.2,
        on_event=events.append,
        identity=agent,
    )
    return sv, tls_port


def _dumped_private_keys(dump: dict) -> dict[str, bytes]:
    out = {}
    for c in dump["configs"]:
        if c["@type"].endswith(".SecretsConfigDump"):
            for s in c.get("dynamic_active_secrets", []):
                key = s["secret"].get("tls_certificate", {}).get("private_key")
                if key is not None:
                    out[s["name"]] = base64.b64decode(key["inline_bytes"])
    return out


def _roots(agent: IdentityAgent) -> str:
    return "".join(agent.current.bundle)


def test_certificate_by_sds_renewed_under_load_and_no_secret_leaks(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    d = short_dir()
    events: list[str] = []
    with (
        upstreams("v1") as ups,
        build_server(identity_mesh(ups["v1"].address, cert_ttl="20s"), debounce=0.02) as cp,
    ):
        token_file = join_token_file(cp, "default/caller", d)
        token = json.loads(token_file.read_text())["token"]
        agent = IdentityAgent(d / "sc", join_token_file=token_file, on_event=events.append)
        lkg = LastKnownGood(d / "lkg.json")
        sv, tls_port = _sidecar(cp.grpc_port, d, lkg, agent, events)
        sv.start()
        keys: set[str] = set()
        try:
            sv.wait_ready()
            assert agent.wait_ready(15)
            status, cert = eventually(lambda: tls_get(tls_port, _roots(agent)), what="TLS up")
            assert status == 200 and san(cert) == [SPIFFE_CALLER]
            # A call on a fresh connection every 0.1 s across two renewals (at half of 20 s).
            serials, failures, deadline = [], [], time.monotonic() + 25
            while time.monotonic() < deadline and len(set(serials)) < 3:
                keys.add(agent.current.key_pem)
                try:
                    status, cert = tls_get(tls_port, _roots(agent))
                    serials.append(cert.serial_number)
                    if status != 200:
                        failures.append(status)
                except OSError as e:
                    failures.append(repr(e))
                time.sleep(0.1)
            assert failures == []
            assert len(set(serials)) >= 3, "two renewals reached Envoy"
            assert agent.renewals >= 2
            assert mode(d / "sc" / CREDENTIALS_FILE) == 0o600 and mode(d / "sc") == 0o700
            eventually(lambda: sv.saved_at, what="last-known-good saved")
            raw_dump = sv.envoy.config_dump_eds()
            dump = json.dumps(raw_dump)
            envoy_log = Path(sv.envoy.log_path).read_text()
        finally:
            sv.stop()
    # Envoy shows the secrets it holds, the private key redacted.
    assert _dumped_private_keys(raw_dump) == {"default": b"[redacted]"}
    lkg_text = (d / "lkg.json").read_text()
    logs = "\n".join(events) + caplog.text + envoy_log
    for where, text in (("config_dump", dump), ("lkg", lkg_text), ("logs", logs)):
        assert token not in text, where
        for key in keys:
            body = "".join(key.strip().splitlines()[1:-1])  # the base64 of the DER key
            assert body[:40] not in text, where
            assert base64.b64encode(key.encode()).decode()[:60] not in text, where


def test_restarted_sidecar_boots_with_its_certificate_while_control_plane_is_down() -> None:
    d = short_dir()
    events: list[str] = []
    lkg = LastKnownGood(d / "lkg.json")
    with upstreams("v1") as ups:
        with build_server(identity_mesh(ups["v1"].address), debounce=0.02) as cp:
            token_file = join_token_file(cp, "default/caller", d)
            agent = IdentityAgent(d / "sc", join_token_file=token_file, on_event=events.append)
            sv, tls_port = _sidecar(cp.grpc_port, d, lkg, agent, events)
            sv.start()
            try:
                sv.wait_ready()
                _, first = eventually(lambda: tls_get(tls_port, _roots(agent)), what="TLS up")
                eventually(lambda: sv.saved_at, what="last-known-good saved")
                roots = _roots(agent)
            finally:
                sv.stop()
        # The control plane is gone; a new supervisor (same private dir) boots Envoy from the
        # last-known-good config and its agent serves the persisted certificate.
        agent = IdentityAgent(d / "sc", on_event=events.append)
        sv, _ = _sidecar(cp.grpc_port, d, lkg, agent, events)
        sv.bootstrap["static_resources"]["listeners"] = [tls_listener(tls_port)]
        sv.start()
        try:
            sv.wait_ready()
            assert sv.mode == "lkg"
            status, cert = eventually(lambda: tls_get(tls_port, roots), what="TLS after restart")
            assert status == 200 and cert.serial_number == first.serial_number
            assert san(cert) == [SPIFFE_CALLER]
        finally:
            sv.stop()
