"""The Prometheus metric provider (Flagger's and Argo's): with `gates.provider.prometheus` in the
spec, the gates are PromQL queries to that server (`promql` renders them),
judged by `evaluate_metrics`, so one host's loopback polling no longer bounds the mesh."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from xds_server.mesh.rollout_spec import PrometheusProvider, RolloutSpec
from xds_server.resources.names import outbound_cluster
from xds_server.rollout.gates.fetch import HttpStatusError, MeasurementError, get_json
from xds_server.rollout.gates.promql import QueryError, duration, render, single_value
from xds_server.rollout.verdict import FAIL, HALT, PASS, Verdict


class PrometheusSource:
    """Instant queries to a Prometheus server's HTTP API (`GET /api/v1/query`), fetched as
    every source is (`get_json`: http(s) only, no redirects, no proxy, size cap, deadline)."""

    def __init__(self, provider: PrometheusProvider) -> None:
        self.url = provider.url.rstrip("/")
        self.timeout = provider.timeout

    def query(self, promql: str) -> float | None:
        """The query's one value now; None for no data (empty, NaN). MeasurementError when the
        server cannot be read, QueryError when it answers with an error or several series."""
        q = urllib.parse.urlencode({"query": promql})
        try:
            return single_value(get_json(f"{self.url}/api/v1/query?{q}", self.timeout))
        except HttpStatusError as e:
            if e.status not in (400, 422):  # bad_data, execution: the query's fault
                raise
            try:
                answer = json.loads(e.body)
            except ValueError:
                raise QueryError(f"Prometheus answered {e.status}: {e.body}") from e
            return single_value(answer)


def query_variables(spec: RolloutSpec) -> dict[str, str]:
    """What a gate query's `{{ name }}`s stand for (xds_server.mesh.rollout_spec.VARIABLES)."""
    return {
        "interval": duration(spec.interval),
        "service": spec.service,
        "version": spec.canary,
        "stable": spec.stable,
        "cluster": outbound_cluster(spec.service, spec.canary),
        "stable_cluster": outbound_cluster(spec.service, spec.stable),
    }


def metrics_problem(spec: RolloutSpec, source: PrometheusSource) -> str | None:
    """Why the provider's gates could never be judged (checked before a rollout starts), or
    None. No data is fine here: the canary has had no calls yet."""
    variables = query_variables(spec)
    for g in spec.gates.metrics:
        try:
            source.query(render(g.query, variables))
        except MeasurementError as e:
            return f"Prometheus cannot be read: {e}"
        except QueryError as e:
            return f"gates.metrics.{g.name}: {e}"
    return None


def evaluate_metrics(spec: RolloutSpec, source: PrometheusSource) -> Verdict:
    """One interval's verdict from the provider's queries: FAIL when a value is outside its
    [min, max]; else HALT when one has no data (an empty result or NaN: neither promotes nor
    fails, as with too little traffic), Prometheus answers an error or cannot be read; else
    PASS."""
    values: dict[str, float | None] = {}
    m: dict[str, Any] = {"metrics": values, "provider": source.url}
    failed: list[str] = []
    held: list[str] = []
    variables = query_variables(spec)
    for g in spec.gates.metrics:
        try:
            v = values[g.name] = source.query(render(g.query, variables))
        except MeasurementError as e:
            return Verdict(HALT, f"halted: Prometheus unavailable ({e})", m)
        except QueryError as e:
            values[g.name] = None
            held.append(f"{g.name}: {e}")
            continue
        if v is None:
            held.append(f"{g.name}: no data")
        elif g.min is not None and v < g.min:
            failed.append(f"{g.name} {v:g} < min {g.min:g}")
        elif g.max is not None and v > g.max:
            failed.append(f"{g.name} {v:g} > max {g.max:g}")
    if failed:
        return Verdict(FAIL, "; ".join(failed), m)
    if held:
        return Verdict(HALT, f"halted: {'; '.join(held)}", m)
    shown = ", ".join(f"{k} {v:g}" for k, v in values.items() if v is not None)
    return Verdict(PASS, f"gates passed: {shown}", m)
