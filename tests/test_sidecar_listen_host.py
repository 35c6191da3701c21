"""`meshlm sidecar --listen-host`: the address a sidecar's listeners bind (127.0.0.1 by default;
a pod's sidecar that other pods call binds 0.0.0.0)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.lkg import LastKnownGood
from sidecar.supervisor import Supervisor
from tests.test_xds_support import Caller, eventually, llm_mesh, upstreams
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.resources import faults, names
from xds_server.resources.build import build_resources
from xds_server.xds.node import NodeInfo


def _listener_addresses(admin_port: int) -> list[str]:
    url = f"http://127.0.0.1:{admin_port}/listeners?format=json"
    with urllib.request.urlopen(url, timeout=5) as r:
        doc = json.load(r)
    return [
        f"{a['socket_address']['address']}:{a['socket_address']['port_value']}"
        for ls in doc.get("listener_statuses", [])
        for a in [ls["local_address"]]
    ]


def test_a_sidecar_binds_its_listeners_where_listen_host_says() -> None:
    with upstreams("v1") as ups, build_server(llm_mesh(ups), debounce=0.02) as cp:
        outbound = free_port()
        boot = ads_bootstrap(
            "caller-any",
            xds_address=("127.0.0.1", cp.grpc_port),
            outbound_port=outbound,
            admin_port=free_port(),
            listen_host="0.0.0.0",
        )
        sv = Supervisor("caller-any", boot, ("127.0.0.1", cp.grpc_port), lkg=LastKnownGood())
        sv.start()
        try:
            sv.wait_ready()
            caller = Caller(outbound)
            assert eventually(lambda: caller.who() == "v1", what="routed via ADS")
            caller.close()
            assert _listener_addresses(sv.admin_port) == [f"0.0.0.0:{outbound}"]
        finally:
            sv.stop()


def test_listen_host_must_be_an_ip_address() -> None:
    cmd = [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds", "127.0.0.1:1"]
    r = subprocess.run([*cmd, "--listen-host", "pod.local"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--listen-host: expected an IP address, got 'pod.local'" in r.stderr


def test_a_host_fault_finds_a_sidecar_on_0_0_0_0_by_the_address_it_registers() -> None:
    """A sidecar binding 0.0.0.0 is reached at the address it registers (`--register`, node
    metadata meshlm.host): a `host:` fault naming that address is injected by its inbound
    listener; without it, 0.0.0.0:PORT matches no host."""
    pod = "10.1.2.3:9000"
    mesh = parse_mesh({
        "services": {"llm": {"versions": {"v1": {"endpoints": [pod]}},
                             "route": {"weights": {"v1": 100}}}},
        "faults": {"slow-pod": {"service": "llm", "host": pod, "delay": {"fixed_delay": "1s"}}},
    })  # fmt: skip

    def faulted(**extra) -> bool:
        md = ads_bootstrap("n", xds_address=("127.0.0.1", 1), service="llm", version="v1",
                  inbound_port=9000, local_endpoint="127.0.0.1:8000", listen_host="0.0.0.0",
                  **extra)["node"]["metadata"]  # fmt: skip
        route = build_resources(mesh, NodeInfo.from_metadata(md))[t.ROUTE][
            names.inbound_route("llm", "v1")
        ]
        return faults.FILTER_NAME in route.virtual_hosts[0].typed_per_filter_config

    assert faulted(host=pod)
    assert not faulted()
    assert not faulted(host="10.1.2.4:9000")
