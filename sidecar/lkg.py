"""Last-known-good config: what Envoy last accepted, kept so that a sidecar whose Envoy restarts
while the control plane is down still comes up serving.

Envoy's admin `/config_dump?include_eds` holds only what it accepted (a NACKed resource never
becomes active), so a dump is the last good config by construction. `static_bootstrap` turns the
dynamic resources of a dump into `static_resources`: EDS clusters get their endpoints inline, RDS
listeners get their route table inline, ECDS filters get their typed config inline.

Native authz mode: Envoy redacts `api_key_auth` credentials in its dumps, so the cache never holds
the keys; `static_bootstrap` puts them back from `keys` (the sidecar re-reads the same 0600
`keys_file` the control plane reads) and refuses to build a listener whose keys it lacks.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachetools import TLRUCache

from sidecar.bootstrap import BUDGET_LISTENER

_TYPE = "@type"
_FORMAT = 2  # {"format": 2, "nodes": {node: {"saved_at": unix time, "resources": {...}}}}
Keys = Mapping[str, Sequence[str]]  # tenant -> plaintext keys (native authz mode)


class LkgError(KeyError):
    """The cached config cannot be made into a bootstrap that enforces the same policy."""


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


def _restore_credentials(name: str, filters: list[dict[str, Any]], keys: Keys | None) -> None:
    """Put the tenants' keys back into a redacted `api_key_auth` config; fail closed.

    Envoy redacts key and client alike, so the tenants are taken from the RBAC filter beside it
    (its principals match the header `api_key_auth` forwards the client id in)."""
    configs = [f.get("typed_config", {}) for f in filters]
    for auth in (c for c in configs if c.get(_TYPE, "").endswith(".ApiKeyAuth")):
        header = auth.get("forwarding", {}).get("header")
        tenants = [
            p["header"]["string_match"]["exact"]
            for c in configs
            if c.get(_TYPE, "").endswith(".RBAC")
            for policy in c.get("rules", {}).get("policies", {}).values()
            for p in policy.get("principals", [])
            if p.get("header", {}).get("name") == header
            and "exact" in p["header"].get("string_match", {})
        ]
        tenants = list(dict.fromkeys(tenants))
        missing = [t for t in tenants if not (keys or {}).get(t)]
        if missing or not tenants:
            who = ", ".join(missing) or "its tenants"
            raise LkgError(
                f"listener {name}: api_key_auth needs the keys of {who} "
                "(native authz: give the sidecar the control plane's keys_file)"
            )
        auth["credentials"] = [{"key": k, "client": t} for t in tenants for k in keys[t]]


def _inline_listener(
    listener: dict[str, Any], res: dict[str, Any], keys: Keys | None = None
) -> dict[str, Any]:
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
            _restore_credentials(listener["name"], hcm.get("http_filters", []), keys)
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


def static_bootstrap(
    base: dict[str, Any], res: dict[str, Any], *, keys: Keys | None = None
) -> dict[str, Any]:
    """`base` (node, admin, overload manager...) with the accepted resources made static;
    `keys` (tenant -> plaintext keys) for native authz listeners."""
    boot = copy.deepcopy(base)
    boot.pop("dynamic_resources", None)
    static = boot.setdefault("static_resources", {})
    # The bootstrap's own static listeners stay (they are not in the dump's dynamic ones), but
    # the budget listener, which routes to the control plane: without it the runtime keeps
    # tenants' token budgets itself.
    own = [v for v in static.get("listeners", []) if v.get("name") != BUDGET_LISTENER]
    static["listeners"] = own + [_inline_listener(v, res, keys) for v in res["listeners"].values()]
    keep = [c for c in static.get("clusters", []) if c.get("name") != "xds_cluster"]
    static["clusters"] = keep + [_inline_cluster(v, res) for v in res["clusters"].values()]
    return boot


class LastKnownGood:
    """Bounded, expiring store of accepted configs per node; mirrored to a 0600 file so that a
    restarted supervisor has it too. Each entry keeps the time it was taken, in the file too, and
    expires `ttl` after that time, so a reload does not make an old copy young. A config older
    than `ttl` is not served: a sidecar cut off that long should not pretend to be current."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        ttl: float = 24 * 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl = ttl
        self._clock = clock
        # node -> {"saved_at": unix time, "resources": {...}}; expires at saved_at + ttl.
        self._cache: TLRUCache[str, dict[str, Any]] = TLRUCache(
            maxsize=64, ttu=lambda _node, e, _now: e["saved_at"] + ttl, timer=clock
        )
        self._path = Path(path) if path else None
        self._lock = threading.Lock()
        if self._path and self._path.exists():
            try:
                doc = json.loads(self._path.read_text())
                if doc.get("format") == _FORMAT:  # an older file has no age: it is no cache
                    for node, e in doc["nodes"].items():
                        if isinstance(e.get("saved_at"), (int, float)) and "resources" in e:
                            self._cache[node] = e
            except (OSError, ValueError, AttributeError, KeyError, TypeError):
                pass  # a corrupt cache is no cache; the control plane is the source of truth

    def put(self, node_id: str, dump: dict[str, Any]) -> bool:
        """Keep the accepted resources of `dump`; False when it holds no listener yet or
        nothing changed since the last put. A re-put of the same config renews its age (it is
        still current), written to the file at most every `min(60 s, ttl / 10)`."""
        res = resources_from_dump(dump)
        if not res["listeners"]:
            return False
        now = self._clock()
        with self._lock:
            old = self._cache.get(node_id)
            changed = old is None or old["resources"] != res
            if not changed and now - old["saved_at"] < min(60.0, self.ttl / 10):
                return False
            self._cache[node_id] = {"saved_at": now, "resources": res}
            if self._path:
                fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".lkg-")  # 0600
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": _FORMAT, "nodes": dict(self._cache.items())}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._path)
        return changed

    def get(self, node_id: str) -> dict[str, Any] | None:
        with self._lock:
            e = self._cache.get(node_id)
        return None if e is None else e["resources"]
