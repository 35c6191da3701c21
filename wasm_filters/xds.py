"""The policy as Envoy configuration: the Wasm filter (for ECDS) or Envoy's native filters.

Wasm (`wasm_extension_config`, the default): the compiled policy travels as the plugin
configuration of `envoy.filters.http.wasm`; the control plane delivers it with ECDS
(`ecds_http_filter` is the listener side), so a policy change drains no listener. Only key
hashes leave Python.

Native (`native_http_filters`, the baseline and a no-Wasm fallback), in order:
`header_mutation` (drops client-sent identity headers) -> `api_key_auth` (key -> client id,
forwarded as `x-meshlm-tenant`, credential hidden from the upstream) -> `rbac` (tenant ->
allowed gRPC methods and the OpenAI HTTP paths that run them) -> `local_ratelimit` (one token
bucket per tenant, descriptor `tenant`).
What native mode cannot do, compared with the Wasm filter:
- `api_key_auth` compares plaintext keys, so the keys themselves must be in the xDS config (and
  in every config dump); RBAC cannot hash a header either. Callers pass them in `keys`.
- no per-tenant `x-meshlm-priority` header (no native filter maps a client id to a value);
- a denial by `local_ratelimit` carries a fixed `retry-after` (the fill interval), not the
  time to the next refill; its buckets are per listener filter, as the Wasm ones are per vm_id.
  In both modes these per-sidecar buckets are the local tier; the control plane's rate-limit
  service (xds_server/ratelimit/service.py) holds the mesh-wide one.
- a missing and an unknown key both give 401, as in Wasm, but with Envoy's own messages, as
  plain text: an OpenAI client gets the right status (401/403/429, so the SDK's error class)
  without OpenAI's error JSON.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, extension_pb2
from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as wasm_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.wasm.v3 import wasm_pb2
from envoy.type.matcher.v3 import path_pb2, regex_pb2, string_pb2
from envoy.type.v3 import percent_pb2, token_bucket_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2

from mesh_common.headers import API_KEY_HEADER, PRIORITY_HEADER, TENANT_HEADER
from mesh_common.type_urls import WASM as WASM_TYPE_URL
from wasm_filters.policy import (
    METHOD_PREFIX,
    OPENAI_PATHS,
    CallerRule,
    Policy,
    PolicyError,
    compile_filter_config,
    hash_key,
    openai_paths,
)

WASM_PATH = Path(__file__).resolve().parent / "authz.wasm"
VM_ID = "meshlm_authz"  # shared data (the token buckets) is scoped by vm_id


def pack(msg: object) -> any_pb2.Any:
    """`msg` in a google.protobuf.Any (typed_config, a Wasm configuration)."""
    a = any_pb2.Any()
    a.Pack(msg)  # type: ignore[arg-type]
    return a


def wasm_filter_config(
    policy: Policy,
    *,
    service: str,
    name: str = "meshlm.authz",
    wasm_file: str | None = None,
    peer_identity: bool = False,
    callers: Sequence[CallerRule] | None = None,
) -> wasm_filter_pb2.Wasm:
    """`envoy.filters.http.wasm` config: V8, the module inline (or from `wasm_file`), the
    compiled policy as plugin configuration, failing closed. `peer_identity` and `callers`:
    see `compile_filter_config`."""
    code = (
        base_pb2.DataSource(filename=wasm_file)
        if wasm_file
        else base_pb2.DataSource(inline_bytes=WASM_PATH.read_bytes())
    )
    plugin = wasm_pb2.PluginConfig(
        name=name,
        root_id=VM_ID,
        vm_config=wasm_pb2.VmConfig(
            vm_id=VM_ID,
            runtime="envoy.wasm.runtime.v8",
            code=base_pb2.AsyncDataSource(local=code),
        ),
        configuration=pack(
            wrappers_pb2.StringValue(
                value=compile_filter_config(
                    policy, service=service, peer_identity=peer_identity, callers=callers
                ).decode()
            )
        ),
        failure_policy=wasm_pb2.FAIL_CLOSED,
    )
    return wasm_filter_pb2.Wasm(config=plugin)


def wasm_extension_config(
    policy: Policy,
    *,
    service: str,
    name: str = "meshlm.authz",
    wasm_file: str | None = None,
    peer_identity: bool = False,
    callers: Sequence[CallerRule] | None = None,
) -> extension_pb2.TypedExtensionConfig:
    """The ECDS resource (its name is what `ecds_http_filter` asks for)."""
    cfg = wasm_filter_config(
        policy,
        service=service,
        name=name,
        wasm_file=wasm_file,
        peer_identity=peer_identity,
        callers=callers,
    )
    return extension_pb2.TypedExtensionConfig(name=name, typed_config=pack(cfg))


def wasm_http_filter(
    policy: Policy,
    *,
    service: str,
    name: str = "meshlm.authz",
    peer_identity: bool = False,
    callers: Sequence[CallerRule] | None = None,
) -> hcm_pb2.HttpFilter:
    """The Wasm filter inline in a listener (static bootstraps, tests, benchmarks)."""
    cfg = wasm_filter_config(
        policy, service=service, name=name, peer_identity=peer_identity, callers=callers
    )
    return hcm_pb2.HttpFilter(name=name, typed_config=pack(cfg))


def ecds_http_filter(*, name: str = "meshlm.authz") -> hcm_pb2.HttpFilter:
    """The listener's side of ECDS: fetch `name` over ADS. No default config, so a listener
    stays warming (serves nothing) until a policy arrives: fail closed."""
    return hcm_pb2.HttpFilter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            ),
            type_urls=[WASM_TYPE_URL],
        ),
    )


def _method_regex(globs: Sequence[str]) -> str:
    """Paths of the service's gRPC API only; `*` stays inside one method name, as in Wasm."""
    alts = "|".join(
        "[^/]+" if not g.strip("*") else "[^/]*".join(re.escape(p) for p in g.split("*"))
        for g in globs
    )
    return f"{re.escape(METHOD_PREFIX)}(?:{alts})"


def _methods_matching(globs: Sequence[str]) -> list[str]:
    """The OpenAI API's methods (OPENAI_PATHS) that one of `globs` allows."""
    return [m for _, m in OPENAI_PATHS if any(fnmatch.fnmatchcase(m, g) for g in globs)]


def _http_path(pattern: str) -> rbac_pb2.Permission:
    """An OPENAI_PATHS pattern as an RBAC path (`/*`: one more segment, as in the Wasm filter)."""
    if pattern.endswith("/*"):
        match = string_pb2.StringMatcher(
            safe_regex=regex_pb2.RegexMatcher(regex=re.escape(pattern[:-1]) + "[^/]+")
        )
    else:
        match = string_pb2.StringMatcher(exact=pattern)
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=match))


def native_http_filters(
    policy: Policy, *, service: str, keys: Mapping[str, Sequence[str]] | None = None
) -> list[hcm_pb2.HttpFilter]:
    """The same policy as Envoy native filters (no router). `keys` maps tenant -> plaintext
    keys: `api_key_auth` cannot work from hashes, so native mode needs them (see module doc)."""
    keys = keys or {}
    credentials = []
    for t in policy.tenants:
        given = keys.get(t.name, [])
        if not given:
            raise PolicyError(f"keys.{t.name}: native mode needs the tenant's plaintext key(s)")
        for i, k in enumerate(given):
            if hash_key(k) not in t.key_sha256:
                raise PolicyError(f"keys.{t.name}[{i}]: does not match any key_sha256")
            credentials.append(api_key_auth_pb2.Credential(key=k, client=t.name))
    strip = header_mutation_pb2.HeaderMutation(
        mutations=header_mutation_pb2.Mutations(
            request_mutations=[
                mutation_rules_pb2.HeaderMutation(remove=h)
                for h in (TENANT_HEADER, PRIORITY_HEADER)
            ]
        )
    )
    api_key = api_key_auth_pb2.ApiKeyAuth(
        credentials=credentials,
        key_sources=[
            api_key_auth_pb2.KeySource(header=API_KEY_HEADER),
            api_key_auth_pb2.KeySource(header="authorization"),  # `Bearer ` is stripped
        ],
        forwarding=api_key_auth_pb2.Forwarding(header=TENANT_HEADER, hide_credentials=True),
    )
    policies = {}
    for t in policy.tenants:
        methods = policy.methods_for(t, service)
        if not methods:
            continue
        perm = rbac_pb2.Permission(
            url_path=path_pb2.PathMatcher(
                path=string_pb2.StringMatcher(
                    safe_regex=regex_pb2.RegexMatcher(regex=_method_regex(methods))
                )
            )
        )
        http = [_http_path(p) for p in openai_paths(_methods_matching(methods))]
        if http:
            perm = rbac_pb2.Permission(or_rules=rbac_pb2.Permission.Set(rules=[perm, *http]))
        principal = rbac_pb2.Principal(
            header=route_components_pb2.HeaderMatcher(
                name=TENANT_HEADER, string_match=string_pb2.StringMatcher(exact=t.name)
            )
        )
        policies[f"tenant-{t.name}"] = rbac_pb2.Policy(permissions=[perm], principals=[principal])
    rbac = rbac_filter_pb2.RBAC(rules=rbac_pb2.RBAC(action=rbac_pb2.RBAC.ALLOW, policies=policies))
    full = percent_pb2.FractionalPercent(numerator=100)
    descriptors = []
    retry_after = 1
    for t in policy.tenants:
        if t.rate_limit is None:
            continue
        rl = t.rate_limit
        retry_after = max(retry_after, math.ceil(rl.fill_interval_ms / 1000))
        descriptors.append(
            ratelimit_pb2.LocalRateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="tenant", value=t.name)],
                token_bucket=token_bucket_pb2.TokenBucket(
                    max_tokens=rl.max_tokens,
                    tokens_per_fill=wrappers_pb2.UInt32Value(value=rl.tokens_per_fill),
                    fill_interval=duration_pb2.Duration(
                        seconds=rl.fill_interval_ms // 1000,
                        nanos=(rl.fill_interval_ms % 1000) * 1_000_000,
                    ),
                ),
            )
        )
    ratelimit = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix="meshlm_native_ratelimit",
        # The filter-wide bucket must be present; it is effectively unlimited here.
        token_bucket=token_bucket_pb2.TokenBucket(
            max_tokens=1_000_000_000,
            tokens_per_fill=wrappers_pb2.UInt32Value(value=1_000_000_000),
            fill_interval=duration_pb2.Duration(seconds=1),
        ),
        filter_enabled=config_runtime(full, "meshlm.native_ratelimit.enabled"),
        filter_enforced=config_runtime(full, "meshlm.native_ratelimit.enforced"),
        descriptors=descriptors,
        rate_limits=[
            route_components_pb2.RateLimit(
                actions=[
                    route_components_pb2.RateLimit.Action(
                        request_headers=route_components_pb2.RateLimit.Action.RequestHeaders(
                            header_name=TENANT_HEADER, descriptor_key="tenant"
                        )
                    )
                ]
            )
        ],
        rate_limited_as_resource_exhausted=True,
        response_headers_to_add=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="retry-after", value=str(retry_after)),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    )
    return [
        hcm_pb2.HttpFilter(name="envoy.filters.http.header_mutation", typed_config=pack(strip)),
        hcm_pb2.HttpFilter(name="envoy.filters.http.api_key_auth", typed_config=pack(api_key)),
        hcm_pb2.HttpFilter(name="envoy.filters.http.rbac", typed_config=pack(rbac)),
        hcm_pb2.HttpFilter(name="envoy.filters.http.local_ratelimit", typed_config=pack(ratelimit)),
    ]


def config_runtime(
    pct: percent_pb2.FractionalPercent, key: str
) -> base_pb2.RuntimeFractionalPercent:
    return base_pb2.RuntimeFractionalPercent(default_value=pct, runtime_key=key)
