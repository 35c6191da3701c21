"""The Envoy test helper itself: a real Envoy from a static bootstrap serves a direct response."""

import urllib.request

import pytest

from mesh_common.ports import free_port
from sidecar.envoy_process import EnvoyError, EnvoyProcess

HCM = (
    "type.googleapis.com/envoy.extensions.filters.network."
    "http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def test_static_envoy_serves_direct_response_and_stops() -> None:
    port = free_port()
    bootstrap = {
        "static_resources": {
            "listeners": [
                {
                    "name": "l",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": HCM,
                                        "stat_prefix": "t",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "v",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "direct_response": {
                                                                "status": 200,
                                                                "body": {"inline_string": "hi"},
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {"@type": ROUTER},
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ]
        }
    }
    with EnvoyProcess(bootstrap) as envoy:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
        assert body == b"hi"
        assert envoy.stats("http.t.downstream_rq_2xx")["http.t.downstream_rq_2xx"] == 1
        assert "static_listeners" in envoy.admin_get("/config_dump")
        proc = envoy.proc
    assert proc is not None and proc.poll() is not None


def test_ready_only_counts_the_childs_own_admin_port() -> None:
    """An Envoy already on the admin port (an orphan) must not make a new one look ready."""
    with EnvoyProcess({}) as first:
        second = EnvoyProcess({"admin": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": first.admin_port}}}}).start()  # fmt: skip
        try:
            with pytest.raises(EnvoyError, match="Address already in use"):
                second.wait_ready(timeout=30)
        finally:
            second.stop()
