"""Prometheus text exposition (format 0.0.4) for every `GET /metrics` of the mesh: the runtime's
(model_runtime/serving/prometheus.py) and the control plane's (xds_server/admin/metrics.py).

prometheus_client writes the text; each server keeps a registry of its own, never the library's
process-wide one, so several runtimes or control planes in one process (tests, benchmarks) never
mix their series. Series read from live state at scrape time come from a `Collector`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # text/plain; version=0.0.4; charset=utf-8


def registry(*collectors: Collector) -> CollectorRegistry:
    """A registry of its own holding `collectors` (more may be registered later)."""
    r = CollectorRegistry(auto_describe=False)
    for c in collectors:
        r.register(c)
    return r


def exposition(r: CollectorRegistry) -> bytes:
    """The text of every series in `r` now."""
    return generate_latest(r)
