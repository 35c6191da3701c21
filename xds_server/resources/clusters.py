"""Cluster: HTTP/2 upstream, EDS over ADS, outlier detection, circuit breakers, gRPC health."""

from __future__ import annotations

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2, health_check_pb2, protocol_pb2
from envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3 import (
    client_side_weighted_round_robin_pb2 as cswrr_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as hpo
from envoy.type.v3 import percent_pb2
from google.protobuf import wrappers_pb2

from xds_server import mesh as m
from xds_server.resources.common import ads, duration, pack, u32

_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_CSWRR = "envoy.load_balancing_policies.client_side_weighted_round_robin"
# prefix_aware is Maglev, not a ring: when a replica leaves, Envoy's ring gives each survivor
# more points, which take some keys from the other survivors too (a cache lost for nothing);
# Maglev's table moved the leaver's keys alone (tests/test_prefix_routing_envoy.py). ring_hash
# stays a ring (changing it would move its sessions once).
_LB_POLICY = {
    "ring_hash": cluster_pb2.Cluster.RING_HASH,
    "prefix_aware": cluster_pb2.Cluster.MAGLEV,
}
# least_loaded, tuned for token streams (seconds). A stream's load outlives its request, so
# per-request reports (read once, at the end of a stream) come too late: the runtime reports
# out of band every OOB_REPORTING_PERIOD on its data port. A new host serves at the median weight
# for BLACKOUT_PERIOD (a few reports) before its own weight counts, so a just-started replica is
# not flooded on one low first report; weights are recomputed every WEIGHT_UPDATE_PERIOD; a host
# silent for WEIGHT_EXPIRATION_PERIOD (its ORCA stream broken) falls back to the median weight.
# The runtime averages its figures over 10 s (model_runtime/serving/orca.py), so weights move over
# seconds; a replica that got no call in that window reports rps 0, which Envoy ignores, so its
# weight expires and it serves at the median weight again: a starved replica is probed back.
OOB_REPORTING_PERIOD = 1.0
BLACKOUT_PERIOD = 3.0
WEIGHT_UPDATE_PERIOD = 1.0
WEIGHT_EXPIRATION_PERIOD = 10.0


def cluster(
    name: str,
    svc: m.Service,
    *,
    active_health: bool = True,
    caller_side: bool = False,
    transport_socket: base_pb2.TransportSocket | None = None,
    http1: bool = False,
) -> cluster_pb2.Cluster:
    """`caller_side`: a cluster of a version's replicas (their inbound sidecars), where the
    service's load_balancing applies; the inbound cluster has one host, its runtime.
    `transport_socket`: mTLS to the hosts (xds_server/resources/tls.py); it carries the calls,
    the active health checks and the ORCA streams alike. `http1`: the upstream speaks
    HTTP/1.1 only (the runtime's OpenAI API); every other hop is HTTP/2."""
    c = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads(), service_name=name
        ),
        connect_timeout=duration(svc.connect_timeout),
        # A header hash (sticky tenants, the prompt-prefix key) only picks a host with a
        # consistent-hash balancer.
        lb_policy=_LB_POLICY.get(svc.load_balancing, cluster_pb2.Cluster.ROUND_ROBIN),
    )
    if svc.hash_balance_factor is not None:
        # Bounded load: a host over factor% of the mean active calls is passed over for the
        # next one on the ring, so a hot key spills instead of queueing on one replica.
        c.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value = (
            svc.hash_balance_factor
        )
    if caller_side and svc.load_balancing == "least_loaded":
        # Replaces lb_policy. With a hash_policy, the hash still picks the version (the route's
        # use_hash_policy) and load picks the replica: CSWRR ignores the hash.
        c.load_balancing_policy.CopyFrom(least_loaded())
    if transport_socket is not None:
        c.transport_socket.CopyFrom(transport_socket)
    # gRPC needs HTTP/2 to the upstream, stated explicitly (no ALPN on plaintext loopback).
    explicit = hpo.HttpProtocolOptions.ExplicitHttpConfig(
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
    )
    if http1:
        explicit = hpo.HttpProtocolOptions.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions()
        )
    c.typed_extension_protocol_options[_HTTP_OPTIONS].CopyFrom(
        pack(hpo.HttpProtocolOptions(explicit_http_config=explicit))
    )
    od = svc.outlier_detection
    if svc.slo_state.outlier_tightened:
        od = tightened(od or m.OutlierDetection(consecutive_gateway_failure=5))
    if od:
        c.outlier_detection.CopyFrom(outlier_detection(od))
    if svc.circuit_breakers:
        c.circuit_breakers.CopyFrom(circuit_breakers(svc.circuit_breakers))
    if svc.health_check and active_health:
        c.health_checks.append(health_check(svc.health_check, authority=svc.name))
        # A host that leaves EDS (deregistered, scaled in) goes at once, even while it still
        # passes its checks: it is about to close, so no new call may be sent to it.
        c.ignore_health_on_host_removal = True
    return c


# The shadow cluster's circuit breaker: mirroring never holds more than this many
# copies open on the canary; Envoy drops a shadow that overflows it (upstream_rq_pending_overflow
# on the shadow cluster), the caller's own call is untouched.
SHADOW_MAX_REQUESTS = 8
SHADOW_MAX_PENDING = 4


def shadow_cluster(
    name: str, svc: m.Service, *, transport_socket: base_pb2.TransportSocket | None = None
) -> cluster_pb2.Cluster:
    """The mirror's copy of a version's outbound cluster: the same hosts (EDS) and TLS, its own
    name (so its stats are its own), no health checks or outlier detection of its own (the
    version's real cluster has them), and a tight circuit breaker."""
    c = cluster(name, svc, active_health=False, caller_side=True, transport_socket=transport_socket)
    c.ClearField("outlier_detection")
    c.circuit_breakers.CopyFrom(
        circuit_breakers(
            m.CircuitBreakers(
                max_requests=SHADOW_MAX_REQUESTS,
                max_pending_requests=SHADOW_MAX_PENDING,
                max_retries=0,
            )
        )
    )
    return c


# An inbound sidecar's report streams to its runtime (ORCA, least_loaded): a cluster of their
# own, so they never hold a slot of the calls' circuit breaker; its breaker is the runtime's own
# bound on report streams (model_runtime/serving/orca.py MAX_STREAMS).
ORCA_MAX_REQUESTS = 64


def orca_cluster(name: str, svc: m.Service) -> cluster_pb2.Cluster:
    """The inbound cluster's twin for the ORCA route: the same runtime, no health checks or
    outlier detection (the calls' cluster has them), a breaker of its own."""
    c = cluster(name, svc, active_health=False)
    c.ClearField("outlier_detection")
    c.circuit_breakers.CopyFrom(
        circuit_breakers(
            m.CircuitBreakers(max_requests=ORCA_MAX_REQUESTS, max_pending_requests=8, max_retries=0)
        )
    )
    return c


def least_loaded() -> cluster_pb2.LoadBalancingPolicy:
    """Envoy's client_side_weighted_round_robin on ORCA out-of-band reports: weight = qps /
    utilization, so a host that reports more utilization per request gets fewer."""
    cfg = cswrr_pb2.ClientSideWeightedRoundRobin(
        enable_oob_load_report=wrappers_pb2.BoolValue(value=True),
        oob_reporting_period=duration(OOB_REPORTING_PERIOD),
        blackout_period=duration(BLACKOUT_PERIOD),
        weight_update_period=duration(WEIGHT_UPDATE_PERIOD),
        weight_expiration_period=duration(WEIGHT_EXPIRATION_PERIOD),
    )
    ext = extension_pb2.TypedExtensionConfig(name=_CSWRR, typed_config=pack(cfg))
    return cluster_pb2.LoadBalancingPolicy(
        policies=[cluster_pb2.LoadBalancingPolicy.Policy(typed_extension_config=ext)]
    )


def tightened(o: m.OutlierDetection) -> m.OutlierDetection:
    """The SLO loop's tighter outlier detection (bounded): half the consecutive failures
    (at least 1), a check every 2 s at most, up to half the hosts ejected."""

    def half(n: int | None) -> int | None:
        return None if n is None else max(1, n // 2)

    return m.OutlierDetection(
        consecutive_5xx=half(o.consecutive_5xx),
        consecutive_gateway_failure=half(o.consecutive_gateway_failure or 5),
        interval=min(o.interval, 2.0),
        base_ejection_time=o.base_ejection_time,
        max_ejection_percent=max(o.max_ejection_percent, 50),
    )


def outlier_detection(o: m.OutlierDetection) -> outlier_detection_pb2.OutlierDetection:
    # The router reports gRPC statuses to the outlier detector mapped to HTTP codes
    # (UNAVAILABLE -> 503), so consecutive_5xx / consecutive_gateway_failure see gRPC failures.
    od = outlier_detection_pb2.OutlierDetection(
        interval=duration(o.interval),
        base_ejection_time=duration(o.base_ejection_time),
        max_ejection_percent=u32(o.max_ejection_percent),
    )
    if o.consecutive_5xx is not None:
        od.consecutive_5xx.CopyFrom(u32(o.consecutive_5xx))
    else:
        od.enforcing_consecutive_5xx.CopyFrom(u32(0))
    if o.consecutive_gateway_failure is not None:
        od.consecutive_gateway_failure.CopyFrom(u32(o.consecutive_gateway_failure))
        od.enforcing_consecutive_gateway_failure.CopyFrom(u32(100))
    if o.failure_percentage_threshold is not None:
        od.failure_percentage_threshold.CopyFrom(u32(o.failure_percentage_threshold))
        od.enforcing_failure_percentage.CopyFrom(u32(100))
        od.failure_percentage_minimum_hosts.CopyFrom(u32(o.failure_percentage_minimum_hosts))
        od.failure_percentage_request_volume.CopyFrom(u32(o.failure_percentage_request_volume))
    return od


def circuit_breakers(cb: m.CircuitBreakers) -> circuit_breaker_pb2.CircuitBreakers:
    t = circuit_breaker_pb2.CircuitBreakers.Thresholds(priority=base_pb2.RoutingPriority.DEFAULT)
    for f in ("max_connections", "max_pending_requests", "max_requests", "max_retries"):
        v = getattr(cb, f)
        if v is not None:
            getattr(t, f).CopyFrom(u32(v))
    if cb.retry_budget:
        t.retry_budget.CopyFrom(
            circuit_breaker_pb2.CircuitBreakers.Thresholds.RetryBudget(
                budget_percent=percent_pb2.Percent(value=cb.retry_budget.budget_percent),
                min_retry_concurrency=u32(cb.retry_budget.min_retry_concurrency),
            )
        )
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[t])


def health_check(h: m.HealthCheck, authority: str) -> health_check_pb2.HealthCheck:
    """`authority`: the probe's :authority. Envoy's default is the cluster name, and ours
    (`outbound|llm|v1`) is not a valid authority: an inbound sidecar's HTTP/2 codec resets the
    probe (http2.invalid.header.field), so every replica would fail its checks."""
    return health_check_pb2.HealthCheck(
        timeout=duration(h.timeout),
        interval=duration(h.interval),
        no_traffic_interval=duration(h.no_traffic_interval or h.interval),
        unhealthy_threshold=u32(h.unhealthy_threshold),
        healthy_threshold=u32(h.healthy_threshold),
        grpc_health_check=health_check_pb2.HealthCheck.GrpcHealthCheck(
            service_name=h.service_name, authority=authority
        ),
    )
