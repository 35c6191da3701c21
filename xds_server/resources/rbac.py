"""A service's `callers` as Envoy's RBAC filter on its inbound listener.

One ALLOW policy per caller: `principals.authenticated.principal_name` is the caller's SPIFFE ID
(the URI SAN of its verified client certificate; a prefix for `NAMESPACE/*`), `permissions` the
gRPC paths of its methods and the OpenAI HTTP paths that run them, or any path when
it may call every method. A workload no policy matches gets HTTP 403, which Envoy answers a
gRPC caller as PERMISSION_DENIED. The filter runs first, before the tenant authz (Wasm or
native), so an unlisted workload reaches no key check.
"""

from __future__ import annotations

import importlib
import re

from envoy.config.rbac.v3 import rbac_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import path_pb2, regex_pb2, string_pb2

from xds_server import mesh as m
from xds_server.mesh import callers as c
from xds_server.resources.common import pack

FILTER_NAME = "meshlm.callers"
STAT_PREFIX = "meshlm_callers."  # rbac stats: http.<hcm>.meshlm_callers.rbac.{allowed,denied}


def callers_filter(svc: m.Service, trust_domain: str) -> hcm_pb2.HttpFilter | None:
    """The RBAC filter for `svc`'s callers; None when the service lists none (any caller)."""
    if svc.callers is None:
        return None
    policies = {
        f"caller:{caller.service_account}": rbac_pb2.Policy(
            principals=[_principal(c.principal(trust_domain, caller))],
            permissions=[_permission(c.paths(caller))],
        )
        for caller in svc.callers
    }
    cfg = rbac_filter_pb2.RBAC(
        rules=rbac_pb2.RBAC(action=rbac_pb2.RBAC.ALLOW, policies=policies),
        rules_stat_prefix=STAT_PREFIX,
        # Per policy counters: which caller rule allowed how many calls.
        track_per_rule_stats=True,
    )
    return hcm_pb2.HttpFilter(name=FILTER_NAME, typed_config=pack(cfg))


def orca_callers(svc: m.Service, trust_domain: str) -> rbac_filter_pb2.RBACPerRoute | None:
    """The callers filter on the ORCA route: every listed workload, whatever its methods (its
    sidecar balances over this service's hosts by their load reports), and no one else. None
    when the service lists no callers (the listener takes any workload of the trust domain)."""
    if svc.callers is None:
        return None
    principals = [_principal(c.principal(trust_domain, caller)) for caller in svc.callers]
    policy = rbac_pb2.Policy(principals=principals, permissions=[rbac_pb2.Permission(any=True)])
    rules = rbac_pb2.RBAC(action=rbac_pb2.RBAC.ALLOW, policies={"orca:callers": policy})
    if not principals:  # `callers: []`: nobody
        rules.policies.clear()
    return rbac_filter_pb2.RBACPerRoute(rbac=rbac_filter_pb2.RBAC(rules=rules))


def _principal(spiffe_id: str) -> rbac_pb2.Principal:
    if spiffe_id.endswith("*"):
        match = string_pb2.StringMatcher(prefix=spiffe_id[:-1])
    else:
        match = string_pb2.StringMatcher(exact=spiffe_id)
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=match))


def _permission(paths: tuple[str, ...] | None) -> rbac_pb2.Permission:
    if paths is None:
        return rbac_pb2.Permission(any=True)
    exact = [string_pb2.StringMatcher(exact=p) for p in (*paths, *_openai_paths(paths))]
    rules = [
        rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=_star_segment(m))) for m in exact
    ]
    return rbac_pb2.Permission(or_rules=rbac_pb2.Permission.Set(rules=rules))


def _openai_paths(paths: tuple[str, ...]) -> list[str]:
    """The OpenAI HTTP paths that run the gRPC methods among `paths`, as the Wasm
    filter maps them (wasm_filters.policy.OPENAI_PATHS)."""
    policy = importlib.import_module("wasm_filters.policy")
    methods = [p[len(policy.METHOD_PREFIX) :] for p in paths if p.startswith(policy.METHOD_PREFIX)]
    return policy.openai_paths(methods)


def _star_segment(match: string_pb2.StringMatcher) -> string_pb2.StringMatcher:
    """A path ending in `/*` (OPENAI_PATHS) matches one more segment."""
    if not match.exact.endswith("/*"):
        return match
    regex = re.escape(match.exact[:-1]) + "[^/]+"
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=regex))
