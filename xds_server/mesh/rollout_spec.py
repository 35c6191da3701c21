"""A canary rollout's desired shape, parsed from the mesh file's `rollouts:` section.

Names follow docs/ARCHITECTURE.md "One vocabulary" (and Flagger's `analysis`): steps, interval,
threshold, gates. A bad spec raises `RolloutSpecError` naming the field; nothing is applied.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from xds_server.mesh.quality_spec import QualityGate, parse_quality
from xds_server.mesh.rollout_fields import (
    DURATION,
    RolloutSpecError,
    integer,
    name,
    only_known,
    parse_duration,
)
from xds_server.mesh.source_url import url_problem

# The control plane waits at most this long for ACKs (control_plane.MAX_TIMEOUT).
MAX_ACK_TIMEOUT = 600.0


# A gate's query is a template, as in Flagger's MetricTemplate: `{{ interval }}` is the step's
# analysis interval as a Prometheus duration, `{{ service }}`, `{{ version }}` (the canary),
# `{{ stable }}`, `{{ cluster }}` and `{{ stable_cluster }}` (the versions' outbound clusters, as
# Envoy's `envoy_cluster_name` label reads them).
VARIABLES = ("interval", "service", "version", "stable", "cluster", "stable_cluster")
TEMPLATE_VARIABLE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def unknown_variables(template: str) -> list[str]:
    """The `{{ name }}`s of `template` that are not VARIABLES."""
    return sorted({m.group(1) for m in TEMPLATE_VARIABLE.finditer(template)} - set(VARIABLES))


@dataclass(frozen=True)
class PrometheusProvider:
    """A Prometheus server the gates' queries go to (Flagger's metric template provider)."""

    url: str
    timeout: float = 5.0  # seconds for one query, answer included


@dataclass(frozen=True)
class MetricGate:
    """One gate read from the provider: the query's value must lie within [min, max]."""

    name: str
    query: str  # PromQL with {{ interval }}, {{ version }}, ... (VARIABLES)
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class Gates:
    """SLO gates checked on the canary every interval: the built-in gates read from the
    sidecars and runtimes directly (the zero-setup default), or, when `provider` is set, the
    `metrics` queries read from that Prometheus instead."""

    grpc_success_rate_min: float = 99.0  # percent of gRPC calls with grpc-status 0
    min_requests: int = 20  # fewer calls than this in an interval halts (never passes/fails)
    ttft_p99_max: float | None = None  # seconds
    tpot_p99_max: float | None = None  # seconds
    provider: PrometheusProvider | None = None
    metrics: tuple[MetricGate, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The mesh file's form (parse_rollout reads it back)."""
        if self.provider is None:
            return {k: getattr(self, k) for k in _KNOWN_GATES}
        limits = ("query", "min", "max")
        return {
            "provider": {"prometheus": asdict(self.provider)},
            "metrics": {
                m.name: {k: getattr(m, k) for k in limits if getattr(m, k) is not None}
                for m in self.metrics
            },
        }


@dataclass(frozen=True)
class RolloutSpec:
    service: str
    stable: str
    canary: str
    steps: tuple[int, ...] = (5, 25, 50, 100)  # canary weight per step; always ends at 100
    interval: float = 10.0  # seconds of analysis per step
    threshold: int = 2  # consecutive failed intervals before rollback
    gates: Gates = field(default_factory=Gates)
    ack_timeout: float = 10.0  # how long a weight change may wait for every sidecar's ACK
    quality: QualityGate | None = None  # the canary's answers vs the stable's

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = list(self.steps)
        d["gates"] = self.gates.to_dict()
        d["quality"] = self.quality.to_dict() if self.quality is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], service: str | None = None) -> RolloutSpec:
        return parse_rollout(service or d.get("service", ""), d)


_KNOWN = {"service", "stable", "canary", "steps", "interval", "threshold", "gates", "ack_timeout",
          "quality"}  # fmt: skip
_KNOWN_GATES = {"grpc_success_rate_min", "min_requests", "ttft_p99_max", "tpot_p99_max"}
_PROVIDER_GATES = {"provider", "metrics"}


def parse_rollout(service: str, d: dict[str, Any]) -> RolloutSpec:
    """One entry of `rollouts:` (`service` is its key) -> a validated RolloutSpec."""
    where = f"rollouts.{service or '?'}"
    if not isinstance(d, dict):
        raise RolloutSpecError(f"{where}: expected a mapping, got {type(d).__name__}")
    only_known(d, where, _KNOWN)
    if not service:
        raise RolloutSpecError("rollouts: a rollout needs a service name")
    stable = name(d, "stable", where)
    canary = name(d, "canary", where)
    if stable == canary:
        raise RolloutSpecError(f"{where}.canary: must differ from stable ({stable!r})")

    raw_steps = d.get("steps", [5, 25, 50, 100])
    if not isinstance(raw_steps, list | tuple) or not raw_steps:
        raise RolloutSpecError(f"{where}.steps: expected a list of weights, got {raw_steps!r}")
    steps = [integer(s, f"{where}.steps[{i}]", 1, 100) for i, s in enumerate(raw_steps)]
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise RolloutSpecError(f"{where}.steps: weights must increase strictly, got {steps}")
    if steps[-1] != 100:
        steps.append(100)  # the last step is always the promotion

    interval = parse_duration(d.get("interval", "10s"), f"{where}.interval")
    if interval <= 0:
        raise RolloutSpecError(f"{where}.interval: must be positive")
    threshold = integer(d.get("threshold", 2), f"{where}.threshold", 1)
    ack_timeout = parse_duration(d.get("ack_timeout", "10s"), f"{where}.ack_timeout")
    if ack_timeout > MAX_ACK_TIMEOUT:
        raise RolloutSpecError(f"{where}.ack_timeout: at most {MAX_ACK_TIMEOUT:.0f}s")

    g = d.get("gates", {}) or {}
    if not isinstance(g, dict):
        raise RolloutSpecError(f"{where}.gates: expected a mapping, got {g!r}")
    if "provider" in g or "metrics" in g:
        gates = _provider_gates(g, f"{where}.gates")
    else:
        only_known(g, f"{where}.gates", _KNOWN_GATES | _PROVIDER_GATES, what="gate")
        gates = _direct_gates(g, f"{where}.gates")
    return RolloutSpec(
        service=service,
        stable=stable,
        canary=canary,
        steps=tuple(steps),
        interval=interval,
        threshold=threshold,
        gates=gates,
        ack_timeout=ack_timeout,
        quality=parse_quality(d.get("quality"), f"{where}.quality"),
    )


def _direct_gates(g: dict[str, Any], where: str) -> Gates:
    rate = g.get("grpc_success_rate_min", 99.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 100:
        raise RolloutSpecError(
            f"{where}.grpc_success_rate_min: expected a percentage 0..100, got {rate!r}"
        )
    return Gates(
        grpc_success_rate_min=float(rate),
        min_requests=integer(g.get("min_requests", 20), f"{where}.min_requests", 0),
        ttft_p99_max=(
            parse_duration(g["ttft_p99_max"], f"{where}.ttft_p99_max")
            if g.get("ttft_p99_max") is not None
            else None
        ),
        tpot_p99_max=(
            parse_duration(g["tpot_p99_max"], f"{where}.tpot_p99_max")
            if g.get("tpot_p99_max") is not None
            else None
        ),
    )


def _provider_gates(g: dict[str, Any], where: str) -> Gates:
    """`provider: {prometheus: {url, timeout}}` and `metrics: {name: {query, min, max}}`."""
    for k in g:
        if k not in _PROVIDER_GATES:
            raise RolloutSpecError(
                f"{where}.{k}: not read when gates.provider is set (the gates are the "
                f"provider's queries, in gates.metrics; known: metrics, provider)"
            )
    p = g.get("provider")
    if not isinstance(p, dict) or set(p) != {"prometheus"}:
        raise RolloutSpecError(
            f"{where}.provider: expected {{prometheus: {{url: http://HOST:9090}}}}, got {p!r}"
        )
    prom = p["prometheus"]
    if not isinstance(prom, dict):
        raise RolloutSpecError(f"{where}.provider.prometheus: expected a mapping, got {prom!r}")
    only_known(prom, f"{where}.provider.prometheus", {"url", "timeout"})
    problem = url_problem(prom.get("url"))
    if problem:
        raise RolloutSpecError(f"{where}.provider.prometheus.url: {problem}")
    timeout = parse_duration(prom.get("timeout", "5s"), f"{where}.provider.prometheus.timeout")
    if not 0 < timeout <= 60:
        raise RolloutSpecError(f"{where}.provider.prometheus.timeout: expected 0 < timeout <= 60s")
    raw = g.get("metrics")
    if not isinstance(raw, dict) or not raw:
        raise RolloutSpecError(
            f"{where}.metrics: expected a mapping of gate name -> {{query, min and/or max}}, "
            f"got {raw!r}"
        )
    return Gates(
        provider=PrometheusProvider(prom["url"], timeout),
        metrics=tuple(_metric(name, m, f"{where}.metrics.{name}") for name, m in raw.items()),
    )


def _metric(name: Any, m: Any, where: str) -> MetricGate:
    if not isinstance(m, dict):
        raise RolloutSpecError(f"{where}: expected {{query, min and/or max}}, got {m!r}")
    only_known(m, where, {"query", "min", "max"})
    query = m.get("query")
    if not isinstance(query, str) or not query.strip():
        raise RolloutSpecError(f"{where}.query: expected a PromQL query, got {query!r}")
    unknown = unknown_variables(query)
    if unknown:
        raise RolloutSpecError(
            f"{where}.query: unknown variable {{{{ {unknown[0]} }}}} "
            f"(known: {', '.join(VARIABLES)})"
        )
    lo, hi = (_limit(m.get(k), f"{where}.{k}") for k in ("min", "max"))
    if lo is None and hi is None:
        raise RolloutSpecError(f"{where}: needs min, max or both")
    if lo is not None and hi is not None and lo > hi:
        raise RolloutSpecError(f"{where}.min: {lo:g} is above max {hi:g}")
    return MetricGate(str(name), query, lo, hi)


def _limit(v: Any, where: str) -> float | None:
    """A number, or a duration ('500ms' -> 0.5: queries answer in seconds)."""
    if v is None:
        return None
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    m = DURATION.match(v) if isinstance(v, str) else None
    if m and m.group(2):
        return parse_duration(v, where)
    raise RolloutSpecError(f"{where}: expected a number or a duration like '500ms', got {v!r}")


def parse_rollouts(section: dict[str, Any] | None) -> dict[str, RolloutSpec]:
    """The whole `rollouts:` section of a mesh file."""
    if not section:
        return {}
    if not isinstance(section, dict):
        raise RolloutSpecError("rollouts: expected a mapping of service -> rollout")
    return {name: parse_rollout(name, d) for name, d in section.items()}
