"""Where rollouts read their measurements: only what the operator configured in the mesh file
(`caller_sidecars[].admin_url`, `services.<s>.versions.<v>.metrics_urls`, the version's
`endpoints` for the liveness probe) and the hosts that registered for the version (probed too).
A sidecar's node metadata is never a source: it is the sidecar's own claim (on a plaintext mesh
any local process can announce anything over ADS; with mTLS its workload identity is verified,
but the URLs it names are still only its word). The mesh is read at every measurement, so
`meshlm apply` changes are followed."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

from mesh_common.headers import CANARY_HEADER
from xds_server.identity.ca import spiffe_id
from xds_server.mesh.rollout_spec import RolloutSpec
from xds_server.resources.names import outbound_cluster
from xds_server.rollout.gates.envoy_stats import EnvoyStatsSource
from xds_server.rollout.gates.fetch import MeasurementError
from xds_server.rollout.gates.runtime_metrics import RuntimeMetricsSource
from xds_server.rollout.gates.sources import Sources
from xds_server.rollout.liveness import GrpcHealthSource, MtlsProbe, client_context
from xds_server.rollout.quality import MirrorSource, ReplaySource

if TYPE_CHECKING:
    from xds_server import mesh as m
    from xds_server.identity.workload import Identity


class MeshSource(Protocol):
    """What the sources read of the control plane that serves the mesh (an XdsServer): its
    current mesh, and its mesh CA for probing mTLS endpoints."""

    @property
    def mesh(self) -> m.Mesh: ...

    identity: Identity | None


def caller_admin_urls(cp: MeshSource) -> list[str]:
    urls = [c.admin_url for c in cp.mesh.caller_sidecars]
    if not urls:
        raise MeasurementError(
            "no caller-side sidecar configured: the mesh file's caller_sidecars lists the "
            "callers' Envoy admin URLs that the gates read"
        )
    return urls


def _version(cp: MeshSource, service: str, version: str):  # -> xds_server.mesh.Version
    ver = cp.mesh.services.get(service, None)
    ver = ver and ver.versions.get(version)
    if ver is None:
        raise MeasurementError(f"services.{service}.versions.{version}: not in the mesh")
    return ver


def runtime_metrics_urls(cp: MeshSource, service: str, version: str) -> list[str]:
    urls = list(_version(cp, service, version).metrics_urls)
    if not urls:
        raise MeasurementError(
            f"no metrics URL configured for {service}/{version} "
            f"(services.{service}.versions.{version}.metrics_urls)"
        )
    return urls


def endpoints(cp: MeshSource, service: str, version: str) -> list[str]:
    """Where the version's liveness is probed: its endpoints in the mesh file, then the hosts
    that registered for it (the control plane's own table, not a sidecar's announcement)."""
    try:
        ver = _version(cp, service, version)
    except MeasurementError:
        return []
    return [str(e) for e in ver.endpoints] + [str(r.endpoint) for r in ver.registered]


def mtls_probe(cp: MeshSource, service: str) -> MtlsProbe | None:
    """How the control plane probes `service`'s endpoints: None on a plaintext mesh; with mTLS
    its own certificate (the control plane's SPIFFE ID) and the service's SPIFFE ID."""
    mesh, ident = cp.mesh, cp.identity
    svc = mesh.services.get(service)
    if ident is None or mesh.identity is None or mesh.identity.mtls == "off" or svc is None:
        return None
    key, chain = ident.ca.server_credentials((), ())
    ctx = client_context(key, chain, ident.ca.bundle_pem())
    return MtlsProbe(ctx, spiffe_id(ident.ca.trust_domain, svc.service_account))


def _canary_header(cp: MeshSource, service: str) -> str:
    svc = cp.mesh.services.get(service)
    return svc.route.canary_header if svc is not None else CANARY_HEADER


def configured_sources(cp: MeshSource):
    """A `sources_factory` for `RolloutController` reading the control plane's current mesh."""

    def factory(spec: RolloutSpec) -> Sources:
        callers = functools.partial(caller_admin_urls, cp)
        return Sources(
            grpc=EnvoyStatsSource(callers, outbound_cluster(spec.service, spec.canary)),
            latency=RuntimeMetricsSource(
                functools.partial(runtime_metrics_urls, cp, spec.service, spec.canary)
            ),
            stable=EnvoyStatsSource(callers, outbound_cluster(spec.service, spec.stable)),
            live=GrpcHealthSource(
                functools.partial(endpoints, cp, spec.service, spec.canary),
                mtls=functools.partial(mtls_probe, cp, spec.service),
            ),
            quality=_quality_source(cp, spec),
        )

    return factory


def _quality_source(cp: MeshSource, spec: RolloutSpec) -> ReplaySource | MirrorSource | None:
    q = spec.quality
    if q is None:
        return None
    stable = functools.partial(runtime_metrics_urls, cp, spec.service, spec.stable)
    canary = functools.partial(runtime_metrics_urls, cp, spec.service, spec.canary)
    if q.mode == "mirror":
        return MirrorSource(q, stable, canary)
    return ReplaySource(
        q, spec.service, stable, canary, canary_header=_canary_header(cp, spec.service)
    )
