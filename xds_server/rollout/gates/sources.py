"""What the controller reads for one rollout (`Sources`), and `mesh_sources`, which builds them
from fixed lists; `xds_server.rollout.sources.configured_sources` builds them from the mesh."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xds_server.mesh.rollout_spec import RolloutSpec
from xds_server.resources.names import outbound_cluster
from xds_server.rollout.gates.envoy_stats import EnvoyStatsSource, GrpcCountsSource
from xds_server.rollout.gates.runtime_metrics import LatencySource, RuntimeMetricsSource
from xds_server.rollout.liveness import GrpcHealthSource
from xds_server.rollout.quality import MirrorSource, ReplaySource


@dataclass(frozen=True)
class Sources:
    """What the controller reads for one rollout: caller-side gRPC counts for the canary
    cluster, and (optionally) the canary runtime's latency."""

    grpc: GrpcCountsSource
    latency: LatencySource | None = None
    stable: GrpcCountsSource | None = None  # only to report the traffic split per step
    live: GrpcHealthSource | None = None  # the canary's endpoints, probed by the control plane
    quality: ReplaySource | MirrorSource | None = None  # spec.quality's


def mesh_sources(
    caller_admin_urls: list[str],
    runtime_metrics_urls: dict[str, list[str]] | None = None,
    endpoints: dict[str, list[str]] | None = None,
) -> Callable[[RolloutSpec], Sources]:
    """A `sources_factory` for `RolloutController` from fixed lists: the canary's (and
    stable's) outbound cluster counters on the given caller-side sidecars, the canary version's
    runtime metrics endpoints and its endpoints to probe, when listed (version -> URLs, version
    -> host:port). `xds_server.rollout.sources.configured_sources` takes them from the mesh."""

    def factory(spec: RolloutSpec) -> Sources:
        urls = (runtime_metrics_urls or {}).get(spec.canary)
        eps = (endpoints or {}).get(spec.canary)
        return Sources(
            grpc=EnvoyStatsSource(caller_admin_urls, outbound_cluster(spec.service, spec.canary)),
            latency=RuntimeMetricsSource(urls) if urls else None,
            stable=EnvoyStatsSource(caller_admin_urls, outbound_cluster(spec.service, spec.stable)),
            live=GrpcHealthSource(eps) if eps is not None else None,
        )

    return factory
