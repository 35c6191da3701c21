"""The authz policy: tenants, API key hashes, roles, allow rules, rate limits, priorities.

Read from the mesh file's `tenants:` mapping (and an optional top-level `roles:` mapping):

    roles:
      reader: ["llm/Tokenize", "llm/Health*"]
    tenants:
      acme: {key_sha256: "<hex>", allow: ["llm/*"], priority: high,
             rate_limit: {max_tokens: 40, tokens_per_fill: 20, fill_interval: 1s}}
      free: {key_sha256: ["<new hex>", "<old hex>"], roles: [reader], allow: ["llm/Generate"],
             token_budget: {tokens_per_minute: 20000, tokens_per_day: 1000000}}

Allow patterns are `service/method` globs (`*` is the only wildcard); methods are the gRPC
method names of `/meshlm.inference.v1.Inference/<Method>` (the OpenAI HTTP paths count as the
method they run, OPENAI_PATHS), and no rule matches any other path (`llm/*` is neither llm's
health checks nor another gRPC service on its sidecar). A list of key
hashes lets a tenant rotate keys: add the new hash, move clients, then drop the old one.
Plaintext keys never enter the policy, the filter's configuration or a log line; `hash_key`
turns a key into its hash.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

METHOD_PREFIX = "/meshlm.inference.v1.Inference/"
# The OpenAI-compatible HTTP API (model_runtime/serving/openai_http.py): each path counts as
# the gRPC method it runs, for allow rules and `callers` alike, so `llm/Generate` covers both
# completions endpoints and `llm/Info` the model list. A path ending in `/*` matches one more
# segment (`/v1/models/{id}`). Any other /v1/ path matches no rule (denied).
OPENAI_PATHS: tuple[tuple[str, str], ...] = (
    ("/v1/chat/completions", "Generate"),
    ("/v1/completions", "Generate"),
    ("/v1/models", "Info"),
    ("/v1/models/*", "Info"),
)
PRIORITIES = ("high", "normal", "low")
FILTER_CONFIG_VERSION = 1

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}\Z")
_CALLER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/(?:[A-Za-z0-9][A-Za-z0-9_.-]*|\*)\Z")
_PATTERN_PART = re.compile(r"^[A-Za-z0-9_.*-]+\Z")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?\Z")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, None: 1000}
_TENANT_FIELDS = {"key_sha256", "allow", "roles", "rate_limit", "priority", "token_budget"}
_RATE_FIELDS = {"max_tokens", "tokens_per_fill", "fill_interval"}
_BUDGET_FIELDS = ("tokens_per_minute", "tokens_per_day")


class PolicyError(ValueError):
    """A policy that cannot be used; the message starts with the field path."""


@dataclass(frozen=True)
class RateLimit:
    """A token bucket (names from Envoy's `local_ratelimit` TokenBucket)."""

    max_tokens: int
    tokens_per_fill: int
    fill_interval_ms: int


@dataclass(frozen=True)
class TokenBudget:
    """Prompt + completion tokens a tenant may use of each model (service) it calls; each
    budget refills continuously over its span. Enforced by the runtimes, which reserve
    prompt + max_tokens per call (model_runtime/serving/budgets.py)."""

    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    # Set by the control plane, never in a mesh file: the service whose mesh-wide budget the
    # control plane keeps (`rate_limits.mode: global`).
    global_service: str | None = None

    def header_value(self) -> str:
        """`x-meshlm-token-budget` as the authz filter sets it (token_budgets.parse_budget)."""
        parts = [(n, getattr(self, n)) for n in _BUDGET_FIELDS]
        parts.append(("global", self.global_service))
        return ";".join(f"{n}={v}" for n, v in parts if v is not None)


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: tuple[str, ...]  # lowercase hex
    allow: tuple[str, ...]  # `service/method` globs, roles already expanded
    rate_limit: RateLimit | None
    priority: str
    token_budget: TokenBudget | None = None


@dataclass(frozen=True)
class Policy:
    tenants: tuple[Tenant, ...]

    def tenant(self, name: str) -> Tenant:
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(name)

    def methods_for(self, tenant: Tenant, service: str) -> list[str]:
        """The method globs `tenant` may call on `service` (service part matched here)."""
        out: list[str] = []
        for pattern in tenant.allow:
            svc, method = pattern.split("/", 1)
            if fnmatch.fnmatchcase(service, svc) and method not in out:
                out.append(method)
        return out


def openai_paths(methods: Sequence[str]) -> list[str]:
    """The OpenAI HTTP paths (patterns of OPENAI_PATHS) that run one of `methods`."""
    return [p for p, m in OPENAI_PATHS if m in methods]


def hash_key(key: str | bytes) -> str:
    """The hex SHA-256 of an API key, as the mesh file's `key_sha256` wants it."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def _int(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise PolicyError(f"{path}: must be a positive integer, got {v!r}")
    return v


def _duration_ms(v: Any, path: str) -> int:
    """`1s`, `250ms`, `2m`, `1h` or a number of seconds -> whole milliseconds (>= 1)."""
    if isinstance(v, bool):
        raise PolicyError(f"{path}: must be a duration like 1s or 250ms, got {v!r}")
    m = _DURATION.match(str(v).strip()) if isinstance(v, str | int | float) else None
    if not m:
        raise PolicyError(f"{path}: must be a duration like 1s or 250ms, got {v!r}")
    ms = float(m.group(1)) * _UNIT_MS[m.group(2)]
    if ms < 1 or ms != int(ms) or ms > 86_400_000:
        raise PolicyError(f"{path}: must be whole milliseconds between 1ms and 24h, got {v!r}")
    return int(ms)


def _patterns(v: Any, path: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise PolicyError(f"{path}: must be a list of 'service/method' patterns")
    for i, p in enumerate(v):
        parts = p.split("/")
        if len(parts) != 2 or not all(_PATTERN_PART.match(x) for x in parts):
            raise PolicyError(
                f"{path}[{i}]: {p!r} is not a 'service/method' pattern "
                "(letters, digits, _ . - and * only)"
            )
    return tuple(v)


def _rate_limit(v: Any, path: str) -> RateLimit | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise PolicyError(f"{path}: must be a mapping with {sorted(_RATE_FIELDS)}")
    for k in v:
        if k not in _RATE_FIELDS:
            raise PolicyError(f"{path}.{k}: unknown field (expected {sorted(_RATE_FIELDS)})")
    for k in _RATE_FIELDS:
        if k not in v:
            raise PolicyError(f"{path}.{k}: required")
    return RateLimit(
        max_tokens=_int(v["max_tokens"], f"{path}.max_tokens"),
        tokens_per_fill=_int(v["tokens_per_fill"], f"{path}.tokens_per_fill"),
        fill_interval_ms=_duration_ms(v["fill_interval"], f"{path}.fill_interval"),
    )


def _token_budget(v: Any, path: str) -> TokenBudget | None:
    if v is None:
        return None
    if not isinstance(v, Mapping) or not v:
        raise PolicyError(f"{path}: must be a mapping with one or both of {list(_BUDGET_FIELDS)}")
    for k in v:
        if k not in _BUDGET_FIELDS:
            raise PolicyError(f"{path}.{k}: unknown field (expected {list(_BUDGET_FIELDS)})")
    return TokenBudget(**{k: _int(n, f"{path}.{k}") for k, n in v.items()})


def _tenant(name: str, v: Any, path: str, roles: Mapping[str, tuple[str, ...]]) -> Tenant:
    if not isinstance(v, Mapping):
        raise PolicyError(f"{path}: must be a mapping")
    for k in v:
        if k not in _TENANT_FIELDS:
            raise PolicyError(f"{path}.{k}: unknown field (expected {sorted(_TENANT_FIELDS)})")
    keys = v.get("key_sha256")
    keys = [keys] if isinstance(keys, str) else keys
    if not isinstance(keys, list) or not keys:
        raise PolicyError(f"{path}.key_sha256: required, a hex SHA-256 or a list of them")
    for i, h in enumerate(keys):
        if not isinstance(h, str) or not _HEX64.match(h):
            where = f"{path}.key_sha256" + (f"[{i}]" if len(keys) > 1 else "")
            raise PolicyError(f"{where}: must be 64 hex digits (use `hash_key`), got {h!r}")
    allow = list(_patterns(v.get("allow", []), f"{path}.allow"))
    role_names = v.get("roles", [])
    if not isinstance(role_names, list):
        raise PolicyError(f"{path}.roles: must be a list of role names")
    for i, r in enumerate(role_names):
        if r not in roles:
            raise PolicyError(f"{path}.roles[{i}]: unknown role {r!r} (defined: {sorted(roles)})")
        allow += [p for p in roles[r] if p not in allow]
    priority = v.get("priority", "normal")
    if priority not in PRIORITIES:
        raise PolicyError(f"{path}.priority: must be one of {list(PRIORITIES)}, got {priority!r}")
    return Tenant(
        name=name,
        key_sha256=tuple(dict.fromkeys(h.lower() for h in keys)),
        allow=tuple(allow),
        rate_limit=_rate_limit(v.get("rate_limit"), f"{path}.rate_limit"),
        priority=priority,
        token_budget=_token_budget(v.get("token_budget"), f"{path}.token_budget"),
    )


def parse_policy(
    raw_tenants: Any,
    *,
    path: str = "tenants",
    roles: Any = None,
    roles_path: str = "roles",
) -> Policy:
    """Validate the mesh file's `tenants:` mapping (and optional `roles:`) into a Policy.

    Raises PolicyError naming the field, e.g. `tenants.acme.rate_limit.max_tokens: ...`.
    """
    if raw_tenants is None:
        raw_tenants = {}
    if not isinstance(raw_tenants, Mapping):
        raise PolicyError(f"{path}: must be a mapping of tenant name -> settings")
    role_map: dict[str, tuple[str, ...]] = {}
    if roles is not None:
        if not isinstance(roles, Mapping):
            raise PolicyError(f"{roles_path}: must be a mapping of role name -> patterns")
        for r, pats in roles.items():
            role_map[str(r)] = _patterns(pats, f"{roles_path}.{r}")
    tenants: list[Tenant] = []
    owner: dict[str, str] = {}
    for name, v in raw_tenants.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise PolicyError(f"{path}.{name}: tenant names are 1-64 of [A-Za-z0-9_-]")
        t = _tenant(name, v, f"{path}.{name}", role_map)
        for h in t.key_sha256:
            if h in owner:
                raise PolicyError(
                    f"{path}.{name}.key_sha256: a key hash is also used by tenant {owner[h]!r}"
                )
            owner[h] = name
        tenants.append(t)
    return Policy(tenants=tuple(tenants))


@dataclass(frozen=True)
class CallerRule:
    """A workload that may call the service (mesh `callers`): `principal` is its SPIFFE ID, or a
    prefix of IDs followed by `*`; `paths` the request paths it may ask for, None for any.
    `name` (the mesh file's service account) names the rule in stats and explanations."""

    name: str
    principal: str
    paths: tuple[str, ...] | None = None


def _caller_doc(rule: CallerRule, i: int) -> dict[str, Any]:
    where = f"callers[{i}]"
    if not _CALLER_NAME.match(rule.name):
        raise PolicyError(f"{where}.name: {rule.name!r} is not NAMESPACE/NAME or NAMESPACE/*")
    if not rule.principal.startswith("spiffe://") or "*" in rule.principal[:-1]:
        raise PolicyError(f"{where}.principal: {rule.principal!r} is not a SPIFFE ID (or ID*)")
    if rule.paths is not None and not all(p.startswith("/") for p in rule.paths):
        raise PolicyError(f"{where}.paths: each path starts with /")
    return {
        "name": rule.name,
        "principal": rule.principal,
        "paths": None if rule.paths is None else list(rule.paths),
    }


def compile_filter_config(
    policy: Policy,
    *,
    service: str,
    peer_identity: bool = False,
    callers: Sequence[CallerRule] | None = None,
) -> bytes:
    """The authz filter's configuration for the sidecar guarding `service` (JSON, hashes only).

    `peer_identity`: the filter reads the caller's SPIFFE ID from its mTLS certificate and
    forwards it as `x-meshlm-principal`; `callers` (needs it): the workloads that may call,
    checked before any key (None: any workload; empty: none)."""
    if not _NAME.match(service):
        raise PolicyError(f"service: {service!r} is not 1-64 of [A-Za-z0-9_-]")
    if callers is not None and not peer_identity:
        raise PolicyError("callers: workload rules need peer_identity (mTLS)")
    workloads: dict[str, Any] = {}
    if peer_identity:
        workloads["peer_identity"] = True
    if callers is not None:
        workloads["callers"] = [_caller_doc(r, i) for i, r in enumerate(callers)]
    doc = {
        **workloads,
        "version": FILTER_CONFIG_VERSION,
        "service": service,
        "method_prefix": METHOD_PREFIX,
        "http_paths": [{"path": p, "method": m} for p, m in OPENAI_PATHS],
        "tenants": [
            {
                "name": t.name,
                "priority": t.priority,
                "key_sha256": list(t.key_sha256),
                "allow": policy.methods_for(t, service),
                **(
                    {"token_budget": t.token_budget.header_value()}
                    if t.token_budget is not None
                    else {}
                ),
                "rate_limit": None
                if t.rate_limit is None
                else {
                    "max_tokens": t.rate_limit.max_tokens,
                    "tokens_per_fill": t.rate_limit.tokens_per_fill,
                    "fill_interval_ms": t.rate_limit.fill_interval_ms,
                },
            }
            for t in policy.tenants
        ],
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
