"""A service's `locality` in the mesh file and the EDS priorities it gives each caller zone."""

from __future__ import annotations

from typing import Any

import pytest

from mesh_common import type_urls as t
from xds_server.mesh import Endpoint, MeshError, RegisteredEndpoint, parse_mesh
from xds_server.mesh.locality import Locality, priorities
from xds_server.resources.build import build_resources
from xds_server.xds.node import NodeInfo


def _mesh(locality: Any) -> Any:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": ["127.0.0.1:7000"]}},
                    "route": {"weights": {"v1": 100}},
                    "locality": locality,
                }
            }
        }
    )


def test_failover_order_is_parsed() -> None:
    assert _mesh({"failover": ["zone-b", "zone-c"]}).services["llm"].locality == Locality(
        ("zone-b", "zone-c")
    )
    assert _mesh({}).services["llm"].locality == Locality(())


@pytest.mark.parametrize(
    ("locality", "field"),
    [
        ({"failover": ["zone-b", "zone-b"]}, "services.llm.locality.failover[1]: duplicate zone"),
        ({"failover": "zone-b"}, "services.llm.locality.failover: expected a list of zones"),
        ({"failover": [3]}, "services.llm.locality.failover[0]: expected a zone name"),
        ({"failover": [""]}, "services.llm.locality.failover[0]: expected a zone name"),
        ({"failover": ["a b"]}, "services.llm.locality.failover[0]: invalid name"),
        ({"distribute": []}, "services.llm.locality.distribute: unknown field"),
        (["zone-b"], "services.llm.locality: expected a mapping"),
    ],
)
def test_bad_locality_is_refused_naming_the_field(locality: Any, field: str) -> None:
    with pytest.raises(MeshError) as e:
        _mesh(locality)
    assert str(e.value).startswith(field), str(e.value)


def test_priorities_own_zone_then_failover_order_then_the_rest() -> None:
    zones = {"zone-a", "zone-b", "zone-c", "zone-d", ""}
    loc = Locality(("zone-c", "zone-x", "zone-b"))  # zone-x: no hosts yet, no gap for it
    assert priorities(zones, "zone-a", loc) == {
        "zone-a": 0, "zone-c": 1, "zone-b": 2, "zone-d": 3, "": 4,
    }  # fmt: skip
    # A caller in a zone without hosts starts at the failover order.
    assert priorities({"zone-b", "zone-c"}, "zone-z", loc) == {"zone-c": 0, "zone-b": 1}
    assert set(priorities(zones, None, loc).values()) == {0}
    assert set(priorities(zones, "zone-a", None).values()) == {0}


def _eds(mesh: Any, zone: str | None) -> dict[str, int]:
    """zone -> priority of outbound|llm|<version>'s localities as built for a caller in `zone`."""
    res = build_resources(mesh, NodeInfo(outbound_port=15001, zone=zone))
    return {
        v: {loc.locality.zone: loc.priority for loc in cla.endpoints}
        for v, cla in ((n.rsplit("|", 1)[1], c) for n, c in res[t.ENDPOINT].items())
    }


def test_each_version_cluster_gets_the_callers_zone_order() -> None:
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {}, "v2": {}},
                    "route": {"weights": {"v1": 90, "v2": 10}},
                    "locality": {"failover": ["zone-c", "zone-b"]},
                }
            }
        }
    )
    mesh = mesh.with_registered(
        {
            ("llm", v): tuple(
                RegisteredEndpoint(Endpoint("10.0.0.1", port + i), zone=z)
                for i, z in enumerate(("zone-a", "zone-b", "zone-c"))
            )
            for v, port in (("v1", 7000), ("v2", 7010))
        }
    )
    want_a = {"zone-a": 0, "zone-c": 1, "zone-b": 2, "": 3}
    assert _eds(mesh, "zone-a") == {"v1": want_a, "v2": want_a}
    assert _eds(mesh, "zone-b")["v1"] == {"zone-b": 0, "zone-c": 1, "zone-a": 2, "": 3}
    assert set(_eds(mesh, None)["v1"].values()) == {0}


def test_a_callers_zone_comes_from_node_locality_and_is_checked() -> None:
    from envoy.config.core.v3 import base_pb2

    def node(zone: str) -> Any:
        n = base_pb2.Node(id="n", locality=base_pb2.Locality(zone=zone))
        n.metadata.update({"meshlm.outbound_port": 15001})
        return n

    assert NodeInfo.from_node(node("zone-a")).zone == "zone-a"
    assert NodeInfo.from_node(node("")).zone is None
    with pytest.raises(ValueError, match=r"node\.locality\.zone"):
        NodeInfo.from_node(node("a/b"))


def test_static_endpoints_carry_their_zone_into_the_callers_priorities() -> None:
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {
                        "v1": {
                            "endpoints": [
                                {"address": "10.0.0.1:7000", "zone": "zone-b"},
                                {"address": "10.0.0.2:7000", "zone": "zone-a"},
                                "10.0.0.3:7000",
                            ]
                        }
                    },
                    "route": {"weights": {"v1": 100}},
                    "locality": {"failover": ["zone-b"]},
                }
            }
        }
    )
    assert mesh.services["llm"].versions["v1"].endpoints[0] == Endpoint("10.0.0.1", 7000)
    assert _eds(mesh, "zone-a") == {"v1": {"zone-a": 0, "zone-b": 1, "": 2}}


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [
        ({"address": "10.0.0.1:7000", "zone": 3}, "endpoints[0].zone: expected a zone name"),
        ({"address": "10.0.0.1:7000", "zone": "a b"}, "endpoints[0].zone: invalid name"),
        ({"zone": "zone-a"}, "endpoints[0].address: expected host:port"),
        ({"address": "10.0.0.1:7000", "region": "r"}, "endpoints[0].region: unknown field"),
    ],
)
def test_bad_zoned_endpoint_is_refused_naming_the_field(endpoint: Any, field: str) -> None:
    doc = {"services": {"llm": {"versions": {"v1": {"endpoints": [endpoint]}}}}}
    doc["services"]["llm"]["route"] = {"weights": {"v1": 100}}
    with pytest.raises(MeshError) as e:
        parse_mesh(doc)
    assert str(e.value).startswith(f"services.llm.versions.v1.{field}"), str(e.value)
