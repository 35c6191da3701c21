"""Where rollouts read their measurements, learned from the sidecars themselves: each sidecar
announces its Envoy admin URL (`meshlm.admin`) and, for an inbound one, its runtime's metrics
URL (`meshlm.runtime_metrics`) in its node metadata, as istiod learns its proxies from xDS."""

from __future__ import annotations

import functools
from typing import Any

from xds_server.control_plane import ControlPlane
from xds_server.gates import EnvoyStatsSource, RuntimeMetricsSource, Sources
from xds_server.resources.names import outbound_cluster
from xds_server.rollout_spec import RolloutSpec

ADMIN = "meshlm.admin"
RUNTIME_METRICS = "meshlm.runtime_metrics"


def _nodes(cp: ControlPlane) -> list[Any]:
    with cp.sync.cond:
        return [n for n in cp.sync.nodes.values() if n.connected]


def caller_admin_urls(cp: ControlPlane) -> list[str]:
    """Admin URLs of the connected sidecars that have an outbound listener (the callers)."""
    return sorted(
        n.metadata[ADMIN]
        for n in _nodes(cp)
        if n.group.outbound_port is not None and n.metadata.get(ADMIN)
    )


def runtime_metrics_urls(cp: ControlPlane, service: str, version: str) -> list[str]:
    return sorted(
        n.metadata[RUNTIME_METRICS]
        for n in _nodes(cp)
        if (n.group.service, n.group.version) == (service, version)
        and n.metadata.get(RUNTIME_METRICS)
    )


def discovered_sources(cp: ControlPlane):
    """A `sources_factory` for `RolloutController` that looks the sidecars up at every read,
    so sidecars that come, go or reconnect after a control-plane restart are followed."""

    def factory(spec: RolloutSpec) -> Sources:
        callers = functools.partial(caller_admin_urls, cp)
        return Sources(
            grpc=EnvoyStatsSource(callers, outbound_cluster(spec.service, spec.canary)),
            latency=RuntimeMetricsSource(
                functools.partial(runtime_metrics_urls, cp, spec.service, spec.canary)
            ),
            stable=EnvoyStatsSource(callers, outbound_cluster(spec.service, spec.stable)),
        )

    return factory
