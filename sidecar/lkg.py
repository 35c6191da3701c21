"""Last-known-good config: what Envoy last accepted, kept so that a sidecar whose Envoy restarts
while the control plane is down still comes up serving (issue 5).

Envoy's admin `/config_dump?include_eds` holds only what it accepted (a NACKed resource never
becomes active), so a dump is the last good config by construction. `static_bootstrap` turns the
dynamic resources of a dump into `static_resources`: EDS clusters get their endpoints inline, RDS
listeners get their route table inline, ECDS filters get their typed config inline.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from cachetools import TTLCache

_TYPE = "@type"


def _by_type(dump: dict[str, Any], suffix: str) -> dict[str, Any]:
    for c in dump.get("configs", []):
        if c.get(_TYPE, "").endswith("." + suffix):  # not ScopedRoutesConfigDump
            return c
    return {}


def _strip_type(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k != _TYPE}


def resources_from_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """The accepted dynamic resources of a config dump, keyed by kind and name."""
    listeners = {
        d["name"]: d["active_state"]["listener"]
        for d in _by_type(dump, "ListenersConfigDump").get("dynamic_listeners", [])
        if "active_state" in d
    }
    clusters = {
        d["cluster"]["name"]: d["cluster"]
        for d in _by_type(dump, "ClustersConfigDump").get("dynamic_active_clusters", [])
    }
    routes = {
        d["route_config"]["name"]: d["route_config"]
        for d in _by_type(dump, "RoutesConfigDump").get("dynamic_route_configs", [])
    }
    endpoints = {
        d["endpoint_config"]["cluster_name"]: d["endpoint_config"]
        for d in _by_type(dump, "EndpointsConfigDump").get("dynamic_endpoint_configs", [])
    }
    ecds = {
        d["ecds_filter"]["name"]: d["ecds_filter"]
        for d in _by_type(dump, "EcdsConfigDump").get("ecds_filters", [])
    }
    versions = {
        "listeners": _by_type(dump, "ListenersConfigDump").get("version_info", ""),
        "clusters": _by_type(dump, "ClustersConfigDump").get("version_info", ""),
    }
    return {
        "listeners": listeners,
        "clusters": clusters,
        "routes": routes,
        "endpoints": endpoints,
        "ecds": ecds,
        "versions": versions,
    }


def _inline_listener(listener: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    listener = copy.deepcopy(_strip_type(listener))
    for chain in listener.get("filter_chains", []):
        for f in chain.get("filters", []):
            hcm = f.get("typed_config", {})
            if "rds" in hcm:
                name = hcm.pop("rds")["route_config_name"]
                if name not in res["routes"]:
                    raise KeyError(f"listener {listener['name']}: route {name} not in dump")
                hcm["route_config"] = _strip_type(res["routes"][name])
            for hf in hcm.get("http_filters", []):
                if "config_discovery" in hf:
                    hf.pop("config_discovery")
                    ext = res["ecds"].get(hf["name"])
                    if ext is None:
                        # Fail closed: a filter whose config we never received must not vanish.
                        raise KeyError(f"listener {listener['name']}: filter {hf['name']} missing")
                    hf["typed_config"] = ext["typed_config"]
    return listener


def _inline_cluster(cluster: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    cluster = copy.deepcopy(_strip_type(cluster))
    if cluster.get("type") == "EDS" or "eds_cluster_config" in cluster:
        eds = cluster.pop("eds_cluster_config", {})
        name = eds.get("service_name") or cluster["name"]
        cla = _strip_type(res["endpoints"].get(name, {"cluster_name": name}))
        for locality in cla.get("endpoints", []):
            # The dump prints an unset locality weight as 0, which a bootstrap rejects (>= 1).
            if not locality.get("load_balancing_weight"):
                locality.pop("load_balancing_weight", None)
        cluster["type"] = "STATIC"
        cluster["load_assignment"] = cla
    return cluster


def static_bootstrap(base: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """`base` (node, admin, overload manager...) with the accepted resources made static."""
    boot = copy.deepcopy(base)
    boot.pop("dynamic_resources", None)
    static = boot.setdefault("static_resources", {})
    static["listeners"] = [_inline_listener(v, res) for v in res["listeners"].values()]
    keep = [c for c in static.get("clusters", []) if c.get("name") != "xds_cluster"]
    static["clusters"] = keep + [_inline_cluster(v, res) for v in res["clusters"].values()]
    return boot


class LastKnownGood:
    """Bounded, expiring store of accepted configs per node; mirrored to a 0600 file so that a
    restarted supervisor has it too. A config older than `ttl` is not served: a sidecar that has
    been cut off for that long should not pretend to be current."""

    def __init__(self, path: str | Path | None = None, *, ttl: float = 24 * 3600.0) -> None:
        self._cache: TTLCache[str, dict[str, Any]] = TTLCache(maxsize=64, ttl=ttl)
        self._path = Path(path) if path else None
        self._lock = threading.Lock()
        if self._path and self._path.exists():
            try:
                for node, res in json.loads(self._path.read_text()).items():
                    self._cache[node] = res
            except (OSError, ValueError):
                pass  # a corrupt cache is no cache; the control plane is the source of truth

    def put(self, node_id: str, dump: dict[str, Any]) -> bool:
        """Keep the accepted resources of `dump`; False when it holds no listener yet or
        nothing changed since the last put."""
        res = resources_from_dump(dump)
        if not res["listeners"]:
            return False
        with self._lock:
            changed = self._cache.get(node_id) != res
            self._cache[node_id] = res  # re-put refreshes the TTL: the config is still current
            if not changed:
                return False
            if self._path:
                fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".lkg-")
                with os.fdopen(fd, "w") as f:
                    json.dump(dict(self._cache.items()), f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._path)
        return True

    def get(self, node_id: str) -> dict[str, Any] | None:
        with self._lock:
            return self._cache.get(node_id)
