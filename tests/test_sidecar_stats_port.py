"""The sidecar's read-only stats listener (`meshlm sidecar --stats-port`) and EnvoyProcess's
admin URL, on real Envoys: the admin answers where the bootstrap binds it, and another host
reads /stats through the listener but nothing else of the admin."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from mesh_common.ports import free_port
from sidecar.envoy_process import EnvoyProcess
from sidecar.stats_listener import with_stats_listener


def _bootstrap(admin_host: str, admin_port: int) -> dict:
    return {
        "node": {"id": "stats-test", "cluster": "meshlm"},
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
        "static_resources": {"clusters": []},
    }


def _get(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_admin_url_is_where_the_bootstrap_binds_the_admin() -> None:
    # A host's own address (here a loopback alias): 127.0.0.1 has nothing there.
    boot = _bootstrap("127.0.0.2", free_port("127.0.0.2"))
    with EnvoyProcess(boot) as envoy:
        assert envoy.admin_url == f"http://127.0.0.2:{envoy.admin_port}"
        envoy.wait_ready(timeout=30)
        assert json.loads(envoy.admin_get("/server_info"))["state"] == "LIVE"


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/server_info"), ("GET", "/config_dump"), ("POST", "/quitquitquit"),
    ("POST", "/stats"), ("POST", "/logging?level=trace"), ("GET", "/stats/../config_dump"),
])  # fmt: skip
def test_stats_listener_passes_get_stats_only(method: str, path: str) -> None:
    admin_port, stats_port = free_port(), free_port("127.0.0.3")
    boot = with_stats_listener(
        _bootstrap("127.0.0.1", admin_port), host="127.0.0.3", port=stats_port,
        admin_port=admin_port,
    )  # fmt: skip
    with EnvoyProcess(boot) as envoy:
        envoy.wait_ready(timeout=30)
        base = f"http://127.0.0.3:{stats_port}"
        code, body = _get(base + "/stats?format=json&filter=server%5C.live")
        assert code == 200
        assert {"name": "server.live", "value": 1} in json.loads(body)["stats"]
        code, body = _get(base + "/stats/prometheus")
        assert code == 200 and b"envoy_server_live" in body
        code, _ = _get(base + path, method)
        assert code == 404
        assert envoy.is_live()  # nothing through the listener stopped or changed it
