"""PromQL for the Prometheus metric provider of rollout gates: a gate's query template
(`xds_server.mesh.rollout_spec.VARIABLES`) rendered for one interval, and the one value of the
HTTP API's instant query (`GET /api/v1/query`, prometheus.io/docs/prometheus/latest/querying/api/).
"""

from __future__ import annotations

import math
from typing import Any

from xds_server.mesh.rollout_spec import TEMPLATE_VARIABLE


def duration(seconds: float) -> str:
    """Seconds -> a Prometheus duration: '10s', '1500ms'."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def render(template: str, values: dict[str, str]) -> str:
    """The query with each `{{ name }}` replaced by values[name]."""
    return TEMPLATE_VARIABLE.sub(lambda m: values[m.group(1)], template)


class QueryError(ValueError):
    """Prometheus answered, but not with one number: its error, or a result we cannot judge."""


def single_value(answer: Any) -> float | None:
    """An instant query's JSON answer -> its one value; None when there is no data (an empty
    vector, or NaN: no calls in the window makes a ratio 0/0). Several series are refused: a gate
    judges one number, so the query must aggregate (sum, max, ...)."""
    if not isinstance(answer, dict):
        raise QueryError(f"not a Prometheus API answer: {answer!r:.200}")
    if answer.get("status") != "success":
        raise QueryError(
            f"Prometheus: {answer.get('errorType', 'error')}: {answer.get('error', answer)!s:.300}"
        )
    data = answer.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        sample = result
    elif kind == "vector" and isinstance(result, list):
        if not result:
            return None
        if len(result) > 1:
            labels = [r.get("metric", {}) for r in result[:3]]
            raise QueryError(
                f"{len(result)} series (e.g. {labels}); aggregate the query to one (sum, max)"
            )
        sample = result[0].get("value")
    else:
        raise QueryError(f"a {kind} result; a gate needs an instant vector or a scalar")
    try:
        value = float(sample[1])
    except (TypeError, ValueError, IndexError) as e:
        raise QueryError(f"unreadable sample {sample!r:.100}") from e
    return None if math.isnan(value) else value
