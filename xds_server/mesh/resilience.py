"""Parsers of a route's resilience settings: SLO, outlier detection, circuit breakers, retry
policy, isolation, stall resume and health checks."""

from __future__ import annotations

from xds_server.mesh.fields import (
    MeshError,
    only_known,
    parse_duration,
    read_int,
    read_mapping,
    read_optional_int,
    read_positive,
    read_rate,
)
from xds_server.mesh.model import (
    RETRY_ON,
    SLO_ACTIONS,
    CircuitBreakers,
    HealthCheck,
    Isolation,
    OutlierDetection,
    RetryBudget,
    RetryPolicy,
    Route,
    Slo,
    Stall,
    checked_stall,
)


def parse_slo(d: dict, path: str) -> Slo:
    keys = {"ttft_p99", "tpot_p99", "success_rate", "interval", "deviation", "intervals"}
    only_known(d, path, keys | {"recover_intervals", "actions", "max_replicas", "min_requests"})
    if not keys & {"ttft_p99", "tpot_p99", "success_rate"} & set(d):
        raise MeshError(f"{path}: needs at least one of ttft_p99, tpot_p99, success_rate")
    rate = d.get("success_rate")
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 100
    ):
        raise MeshError(f"{path}.success_rate: expected a percentage above 0, below 100")
    dev = read_rate(d.get("deviation", "15%"), f"{path}.deviation")
    n = read_int(d.get("intervals", 3), f"{path}.intervals", 1, 100)
    actions = d.get("actions", list(SLO_ACTIONS))
    if not isinstance(actions, list) or not actions:
        raise MeshError(f"{path}.actions: expected a list of {', '.join(SLO_ACTIONS)}")
    for i, a in enumerate(actions):
        if a not in SLO_ACTIONS:
            raise MeshError(f"{path}.actions[{i}]: expected one of {', '.join(SLO_ACTIONS)}")
    if len(set(actions)) != len(actions):
        raise MeshError(f"{path}.actions: an action is listed twice")
    return Slo(
        ttft_p99=None if "ttft_p99" not in d else read_positive(d["ttft_p99"], f"{path}.ttft_p99"),
        tpot_p99=None if "tpot_p99" not in d else read_positive(d["tpot_p99"], f"{path}.tpot_p99"),
        success_rate=None if rate is None else float(rate),
        interval=read_positive(d.get("interval", "10s"), f"{path}.interval"),
        deviation=dev,
        intervals=n,
        # Hysteresis: undoing takes twice as long as acting unless said otherwise.
        recover_intervals=read_int(
            d.get("recover_intervals", 2 * n), f"{path}.recover_intervals", n, 1000
        ),
        actions=tuple(actions),
        max_replicas=read_int(d.get("max_replicas", 1), f"{path}.max_replicas", 1, 16),
        min_requests=read_int(d.get("min_requests", 10), f"{path}.min_requests", 0, 1_000_000),
    )


def parse_outlier_detection(d: dict, path: str) -> OutlierDetection:
    only_known(
        d,
        path,
        {
            "consecutive_5xx",
            "consecutive_gateway_failure",
            "interval",
            "base_ejection_time",
            "max_ejection_percent",
            "failure_percentage_threshold",
            "failure_percentage_minimum_hosts",
            "failure_percentage_request_volume",
        },
    )
    fp = "failure_percentage"
    return OutlierDetection(
        failure_percentage_threshold=(
            None
            if d.get(f"{fp}_threshold") is None
            else read_int(d[f"{fp}_threshold"], f"{path}.{fp}_threshold", 1, 100)
        ),
        failure_percentage_minimum_hosts=read_int(
            d.get(f"{fp}_minimum_hosts", 2), f"{path}.{fp}_minimum_hosts", 1
        ),
        failure_percentage_request_volume=read_int(
            d.get(f"{fp}_request_volume", 10), f"{path}.{fp}_request_volume", 1
        ),
        consecutive_5xx=read_optional_int(d, "consecutive_5xx", path, 1),
        consecutive_gateway_failure=read_optional_int(d, "consecutive_gateway_failure", path, 1),
        interval=parse_duration(d.get("interval", "10s"), f"{path}.interval"),
        base_ejection_time=parse_duration(
            d.get("base_ejection_time", "30s"), f"{path}.base_ejection_time"
        ),
        max_ejection_percent=read_int(
            d.get("max_ejection_percent", 10), f"{path}.max_ejection_percent", 0, 100
        ),
    )


def parse_circuit_breakers(d: dict, path: str) -> CircuitBreakers:
    keys = {"max_connections", "max_pending_requests", "max_requests", "max_retries"}
    only_known(d, path, keys | {"retry_budget"})
    budget = None
    if "retry_budget" in d:
        b = read_mapping(d["retry_budget"], f"{path}.retry_budget")
        only_known(b, f"{path}.retry_budget", {"budget_percent", "min_retry_concurrency"})
        pct = b.get("budget_percent", 20.0)
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct <= 100:
            raise MeshError(f"{path}.retry_budget.budget_percent: expected 0..100, got {pct!r}")
        budget = RetryBudget(
            budget_percent=float(pct),
            min_retry_concurrency=read_int(
                b.get("min_retry_concurrency", 3), f"{path}.retry_budget.min_retry_concurrency", 0
            ),
        )
    return CircuitBreakers(
        **{k: read_optional_int(d, k, path, 0) for k in keys}, retry_budget=budget
    )


def parse_retry_policy(d: dict, path: str) -> RetryPolicy:
    only_known(d, path, {"retry_on", "num_retries", "per_try_timeout", "hedge_on_per_try_timeout"})
    retry_on = d.get("retry_on", "unavailable,connect-failure")
    if not isinstance(retry_on, str):
        raise MeshError(f"{path}.retry_on: expected a comma-separated string")
    for tok in retry_on.split(","):
        if tok.strip() not in RETRY_ON:
            raise MeshError(f"{path}.retry_on: unknown condition {tok.strip()!r}")
    pt = d.get("per_try_timeout")
    hedge = d.get("hedge_on_per_try_timeout", False)
    if not isinstance(hedge, bool):
        raise MeshError(f"{path}.hedge_on_per_try_timeout: expected true or false")
    if hedge and pt is None:
        raise MeshError(f"{path}.hedge_on_per_try_timeout: needs per_try_timeout (when to hedge)")
    return RetryPolicy(
        retry_on=",".join(t.strip() for t in retry_on.split(",")),
        num_retries=read_int(d.get("num_retries", 1), f"{path}.num_retries", 0, 10),
        per_try_timeout=None if pt is None else parse_duration(pt, f"{path}.per_try_timeout"),
        hedge_on_per_try_timeout=hedge,
    )


def parse_isolation(d: dict, path: str, route: Route) -> Isolation:
    keys = {"error_rate", "window", "min_requests", "pool", "cooldown", "max_classes"}
    only_known(d, path, keys | {"probe_percent"})
    if "error_rate" not in d:
        raise MeshError(f"{path}.error_rate: required, e.g. 0.8%")
    pool = d.get("pool")
    if pool is not None:
        if not isinstance(pool, str) or pool not in route.weights:
            raise MeshError(
                f"{path}.pool: unknown version {pool!r} (known: {', '.join(route.weights)})"
            )
        if route.weights[pool]:  # else healthy traffic would share the quarantine pool
            raise MeshError(f"{path}.pool: version {pool} must have weight 0 in route.weights")
    return Isolation(
        error_rate=read_rate(d["error_rate"], f"{path}.error_rate"),
        window=read_positive(d.get("window", "10m"), f"{path}.window"),
        min_requests=read_int(d.get("min_requests", 20), f"{path}.min_requests", 1, 1_000_000),
        pool=pool,
        cooldown=read_positive(d.get("cooldown", "30s"), f"{path}.cooldown"),
        max_classes=read_int(d.get("max_classes", 10_000), f"{path}.max_classes", 1, 1_000_000),
        probe_percent=read_int(d.get("probe_percent", 10), f"{path}.probe_percent", 1, 100),
    )


def parse_stall(d: dict, path: str) -> Stall:
    only_known(d, path, {"gap", "consecutive", "hard_limit", "max_resumes"})
    stall = Stall(
        gap=read_positive(d.get("gap", "1s"), f"{path}.gap"),
        consecutive=read_int(d.get("consecutive", 3), f"{path}.consecutive", 1, 100),
        hard_limit=read_positive(d.get("hard_limit", "10s"), f"{path}.hard_limit"),
        max_resumes=read_int(d.get("max_resumes", 2), f"{path}.max_resumes", 0, 10),
    )
    return checked_stall(stall, path, MeshError)


def parse_health_check(d: dict, path: str) -> HealthCheck:
    keys = {"interval", "no_traffic_interval", "timeout", "unhealthy_threshold"}
    only_known(d, path, keys | {"healthy_threshold", "service_name"})
    interval = read_positive(d.get("interval", "5s"), f"{path}.interval")
    return HealthCheck(
        interval=interval,
        no_traffic_interval=read_positive(
            d.get("no_traffic_interval", interval), f"{path}.no_traffic_interval"
        ),
        timeout=read_positive(d.get("timeout", "1s"), f"{path}.timeout"),
        unhealthy_threshold=read_int(
            d.get("unhealthy_threshold", 2), f"{path}.unhealthy_threshold", 1
        ),
        healthy_threshold=read_int(d.get("healthy_threshold", 1), f"{path}.healthy_threshold", 1),
        service_name=str(d.get("service_name", "")),
    )
