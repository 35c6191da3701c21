"""The rollout's liveness probe covers a version's registered hosts: a canary whose hosts joined
by registration (none in the mesh file) is probed there, not refused as having no endpoint."""

from __future__ import annotations

from dataclasses import dataclass

from xds_server import mesh as m
from xds_server.mesh import parse_mesh
from xds_server.rollout.sources import endpoints


@dataclass
class Served:
    """What the sources read of a control plane: its live mesh, no CA."""

    mesh: m.Mesh
    identity: None = None


def test_registered_hosts_are_probed_beside_static_endpoints() -> None:
    doc = {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": ["10.0.0.9:7000"]}, "v2": {"endpoints": []}},
                "route": {"weights": {"v1": 100}},
            }
        },
        "control_plane": {"registration": {"enabled": True}},
    }
    mesh = parse_mesh(doc)
    hosts = {
        ("llm", "v2"): (m.RegisteredEndpoint(m.Endpoint("10.0.0.4", 15006)),),
        ("llm", "v1"): (m.RegisteredEndpoint(m.Endpoint("10.0.0.2", 15006), healthy=False),),
    }
    live = Served(mesh.with_registered(hosts))
    assert endpoints(live, "llm", "v2") == ["10.0.0.4:15006"]
    assert endpoints(live, "llm", "v1") == ["10.0.0.9:7000", "10.0.0.2:15006"]
    assert endpoints(live, "llm", "v3") == []
