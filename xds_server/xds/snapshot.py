"""A versioned, consistent set of resources for one sidecar group.

Version strings are `<incarnation>.<generation>`: the incarnation is a token drawn when the server
starts, so a restarted server never reuses a version string that meant something else. Each
resource also carries a content hash, the per-resource version that delta xDS sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import any_pb2
from google.protobuf.message import Message

from mesh_common import type_urls as t


class InconsistentSnapshot(ValueError):
    """A snapshot refers to a resource it does not contain; it is never pushed."""


@dataclass(frozen=True)
class Resources:
    """All resources of one type: a version for the set and a hash per resource."""

    version: str
    items: dict[str, any_pb2.Any]
    hashes: dict[str, str]
    # Responses built for this set, shared by every stream that is sent the same bytes: keyed
    # by what the stream held before and subscribes to (xds_server/xds/ads.py).
    shared: dict = field(default_factory=dict, compare=False, repr=False)


EMPTY = Resources(version="", items={}, hashes={})


@dataclass(frozen=True)
class Snapshot:
    generation: int
    types: dict[str, Resources]

    def get(self, type_url: str) -> Resources:
        return self.types.get(type_url, EMPTY)

    def version(self, type_url: str) -> str:
        return self.get(type_url).version


def make_version(incarnation: str, generation: int) -> str:
    return f"{incarnation}.{generation}"


def version_generation(version: str, incarnation: str) -> int:
    """The generation a version string of this incarnation names; -1 for anything else
    (another incarnation, or a transitional make-before-break version)."""
    inc, _, gen = version.partition(".")
    if inc != incarnation or not gen.isdigit():
        return -1
    return int(gen)


def resource_hash(a: any_pb2.Any) -> str:
    return hashlib.sha256(a.value).hexdigest()[:16]


def build_snapshot(
    resources: dict[str, dict[str, Message]],
    *,
    incarnation: str,
    generation: int,
    previous: Snapshot | None = None,
) -> Snapshot:
    """Pack, hash and version `resources`; a type whose content did not change keeps the
    version it had in `previous`, so sidecars are not sent it again."""
    check_consistency(resources)
    types: dict[str, Resources] = {}
    for tu, msgs in resources.items():
        items = {}
        for name, msg in sorted(msgs.items()):
            a = any_pb2.Any()
            a.Pack(msg, deterministic=True)
            items[name] = a
        hashes = {n: resource_hash(a) for n, a in items.items()}
        old = previous.get(tu) if previous else EMPTY
        version = old.version if old.hashes == hashes and old.version else None
        types[tu] = Resources(
            version=version or make_version(incarnation, generation), items=items, hashes=hashes
        )
    return Snapshot(generation=generation, types=types)


def check_consistency(resources: dict[str, dict[str, Message]]) -> None:
    """Every EDS name a cluster uses, every RDS name and ECDS name a listener uses, and every
    cluster a route points at must be in the same snapshot."""
    have = {tu: set(items) for tu, items in resources.items()}
    problems = []
    for name, c in resources.get(t.CLUSTER, {}).items():
        if c.type == cluster_pb2.Cluster.EDS:
            eds = c.eds_cluster_config.service_name or name
            if eds not in have.get(t.ENDPOINT, set()):
                problems.append(f"cluster {name}: no ClusterLoadAssignment {eds!r}")
    for name, lis in resources.get(t.LISTENER, {}).items():
        for hcm in _hcms(lis):
            if hcm.HasField("rds") and hcm.rds.route_config_name not in have.get(t.ROUTE, set()):
                problems.append(
                    f"listener {name}: no RouteConfiguration {hcm.rds.route_config_name!r}"
                )
            for f in hcm.http_filters:
                if f.HasField("config_discovery") and f.name not in have.get(
                    t.EXTENSION_CONFIG, set()
                ):
                    problems.append(f"listener {name}: no TypedExtensionConfig {f.name!r}")
    for name, rc in resources.get(t.ROUTE, {}).items():
        for cluster in _route_clusters(rc):
            if cluster not in have.get(t.CLUSTER, set()):
                problems.append(f"route {name}: no cluster {cluster!r}")
    if problems:
        raise InconsistentSnapshot("inconsistent snapshot: " + "; ".join(problems))


def _hcms(lis: listener_pb2.Listener) -> Iterator[hcm_pb2.HttpConnectionManager]:
    for chain in lis.filter_chains:
        for f in chain.filters:
            if f.typed_config.Is(hcm_pb2.HttpConnectionManager.DESCRIPTOR):
                hcm = hcm_pb2.HttpConnectionManager()
                f.typed_config.Unpack(hcm)
                yield hcm


def _route_clusters(rc: route_pb2.RouteConfiguration) -> Iterator[str]:
    for vh in rc.virtual_hosts:
        for r in vh.routes:
            if r.route.cluster:
                yield r.route.cluster
            for cw in r.route.weighted_clusters.clusters:
                yield cw.name
