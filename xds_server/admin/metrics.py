"""The control plane's Prometheus metrics (`GET /metrics` on the admin port, text exposition
0.0.4 written by mesh_common/prometheus_text.py, as the runtime's), named after istiod's
(`pilot_xds_pushes{type}` -> `meshlm_xds_pushes_total{type}`, `pilot_total_xds_rejects` ->
`meshlm_xds_rejects_total`, `pilot_proxy_convergence_time` ->
`meshlm_proxy_convergence_time_seconds`, `pilot_xds` -> `meshlm_xds_connected_sidecars`).

Everything is read at scrape time from the state the control plane keeps anyway (sync status,
rollouts, SLO loops, isolation), so no code path of theirs changes. Label values are service,
version, state and action names from the mesh file: no key, token, prompt or request class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mesh_common import prometheus_text
from mesh_common import type_urls as t
from mesh_common.prometheus_text import CONTENT_TYPE
from xds_server.rollout.controller import (
    FAILED,
    PAUSED,
    PENDING,
    PROGRESSING,
    PROMOTING,
    ROLLED_BACK,
    SUCCEEDED,
)
from xds_server.xds.sync import BUCKETS

log = logging.getLogger(__name__)

ROLLOUT_STATES = (PENDING, PROGRESSING, PAUSED, PROMOTING, SUCCEEDED, ROLLED_BACK, FAILED)
# An analysis record's reading -> (metric, help); seconds and percent as the gates read them.
_GATE_READINGS = {
    "success_rate": ("meshlm_rollout_gate_success_rate_percent",
                     "The canary's gRPC success rate over the last analysis interval."),
    "requests": ("meshlm_rollout_gate_requests", "Calls to the canary in the last interval."),
    "ttft_p99": ("meshlm_rollout_gate_ttft_p99_seconds", "The canary's TTFT p99, last interval."),
    "tpot_p99": ("meshlm_rollout_gate_tpot_p99_seconds", "The canary's TPOT p99, last interval."),
}  # fmt: skip


class Exposition(NamedTuple):
    """A reply that is not JSON: the admin server sends it as is."""

    content_type: str
    body: bytes


class _Collector(Collector):
    def __init__(self, owner: ControlPlaneMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        o = self.owner
        yield from _xds(o.cp)
        rollouts, slo = o.work()
        for name, source in (("rollouts", rollouts), ("slo", slo)):
            if source is None:
                continue
            try:  # one failing source must not cost the scrape the others
                yield from (_rollouts(source) if name == "rollouts" else _slo(source))
            except Exception:
                log.exception("metrics: reading %s failed", name)
        yield from _isolation(o.cp)


class ControlPlaneMetrics:
    """One per admin server. `work()` gives the RolloutController and SloLoops running now (None
    for each that does not); their metrics appear while they run."""

    def __init__(self, cp: Any, work: Callable[[], tuple[Any, Any]] = lambda: (None, None)) -> None:
        self.cp = cp
        self.work = work
        self.registry = prometheus_text.registry(_Collector(self))

    def exposition(self) -> Exposition:
        return Exposition(CONTENT_TYPE, prometheus_text.exposition(self.registry))


def _xds(cp: Any) -> Iterator[Metric]:
    sync = cp.sync
    with sync.cond:
        pushes, rejects = dict(sync.pushes), dict(sync.rejects)
        counts, total = list(sync.histogram), sync.convergence_sum
        connected = sum(ns.connected for ns in sync.nodes.values())
    push = CounterMetricFamily(
        "meshlm_xds_pushes", "xDS responses sent to sidecars, by type.", labels=["type"]
    )
    reject = CounterMetricFamily(
        "meshlm_xds_rejects", "xDS responses sidecars NACKed, by type.", labels=["type"]
    )
    for type_url, short in t.SHORT.items():
        push.add_metric([short.lower()], pushes.get(type_url, 0))
        reject.add_metric([short.lower()], rejects.get(type_url, 0))
    yield push
    yield reject
    cumulative, buckets = 0, []
    for bound, count in zip(BUCKETS, counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    yield HistogramMetricFamily(
        "meshlm_proxy_convergence_time_seconds",
        "From a change staged to every affected sidecar holding it.",
        buckets=buckets,
        sum_value=total,
    )
    yield GaugeMetricFamily(
        "meshlm_xds_connected_sidecars", "Sidecars with an open ADS stream.", value=connected
    )
    yield GaugeMetricFamily(
        "meshlm_snapshot_generation", "The newest staged config generation.",
        value=cp.cache.generation,
    )  # fmt: skip


def _rollouts(controller: Any) -> Iterator[Metric]:
    state = GaugeMetricFamily("meshlm_rollout_state", "1 for the state each service's rollout "
                              "is in, 0 for the others.", labels=["service", "state"])  # fmt: skip
    step = GaugeMetricFamily("meshlm_rollout_step", "Index of the rollout step applied now "
                             "(-1 before the first).", labels=["service"])  # fmt: skip
    weight = GaugeMetricFamily("meshlm_rollout_canary_weight_percent",
                               "Traffic weight of the canary now.", labels=["service"])  # fmt: skip
    failures = GaugeMetricFamily("meshlm_rollout_failed_intervals",
                                 "Consecutive failed intervals at this step.",
                                 labels=["service"])  # fmt: skip
    gates = {key: GaugeMetricFamily(name, doc, labels=["service"])
             for key, (name, doc) in _GATE_READINGS.items()}  # fmt: skip
    for service, r in sorted(controller.status().items()):
        for s in ROLLOUT_STATES:
            state.add_metric([service, s], float(r["state"] == s))
        step.add_metric([service], r["step"])
        weight.add_metric([service], r["canary_weight"])
        failures.add_metric([service], r["failures"])
        last = r["analyses"][-1] if r["analyses"] else {}
        for key, family in gates.items():
            if isinstance(last.get(key), int | float):
                family.add_metric([service], last[key])
    yield from (state, step, weight, failures, *gates.values())


def _slo(loops: Any) -> Iterator[Metric]:
    level = GaugeMetricFamily("meshlm_slo_level", "SLO-loop actions in force (0: none).",
                              labels=["service"])  # fmt: skip
    action = GaugeMetricFamily("meshlm_slo_action_in_force", "1 while the SLO loop holds this "
                               "action, else 0.", labels=["service", "action"])  # fmt: skip
    for service, loop in sorted(dict(loops.loops).items()):
        st = loop.status()
        level.add_metric([service], st["level"])
        for a in loop.plan:
            action.add_metric([service, a], float(a in st["in_force"]))
    yield from (level, action)


def _isolation(cp: Any) -> Iterator[Metric]:
    quarantined = GaugeMetricFamily("meshlm_isolation_quarantined_classes",
                                    "Request classes quarantined now.",
                                    labels=["service"])  # fmt: skip
    tracked = GaugeMetricFamily("meshlm_isolation_tracked_classes",
                                "Request classes watched.", labels=["service"])  # fmt: skip
    for service, st in sorted(cp.isolation.status().items()):
        quarantined.add_metric([service], len(st["quarantined"]))
        tracked.add_metric([service], st["classes_tracked"])
    yield from (quarantined, tracked)
