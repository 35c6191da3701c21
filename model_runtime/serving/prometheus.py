"""The runtime's Prometheus metrics (`GET /metrics`, text exposition 0.0.4), named after vLLM's
(`vllm:time_to_first_token_seconds` -> `meshlm_time_to_first_token_seconds`), so dashboards and
alerts written for vLLM need only the prefix changed. An underscore, not vLLM's colon: colons are
reserved for recording rules, and `promtool check metrics` refuses them.

The text and the registry (one per runtime) come from mesh_common/prometheus_text.py, as the
control plane's. Gauges and engine counters are read from `engine.stats()` at scrape time;
latencies are observed as they happen. Bucket bounds are chosen for token latencies:
milliseconds for the gap between tokens, up to a minute for the first token and several minutes
for a whole stream (the client library's defaults stop at 10 s).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mesh_common import prometheus_text

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0,
               60.0, 90.0, 120.0, 300.0)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 30.0, 60.0)  # fmt: skip

# The tenant label comes from the header the sidecar's authz filter sets; a runtime reached
# around its sidecar could be sent any value, so distinct tenants are capped (cardinality).
MAX_TENANTS = 100
OTHER_TENANT = "_other"

# engine.stats() key -> (metric, help); counters are cumulative since the engine started.
_ENGINE_GAUGES = {
    "running": ("meshlm_num_requests_running", "Requests decoding or prefilling now."),
    "queue_depth": ("meshlm_num_requests_waiting", "Requests waiting to be admitted."),
    "batch_size": ("meshlm_batch_size", "The engine's adaptive batch size now."),
}
_ENGINE_COUNTERS = {
    "prefix_hit_tokens": ("meshlm_prefix_cache_hits", "Prompt tokens read from the prefix cache."),
    "prefix_query_tokens": ("meshlm_prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache."),
    "nonfinite_fallbacks": ("meshlm_nonfinite_fallbacks",
                            "Decode steps redone in full precision after a non-finite logit."),
    "tokens_generated": ("meshlm_generation_tokens", "Tokens generated."),
    "requests_admitted": ("meshlm_requests_admitted", "Requests admitted by the engine."),
    "requests_shed": ("meshlm_requests_shed", "Requests shed from the queue (overload)."),
}  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for key, (name, doc) in _ENGINE_GAUGES.items():
            if isinstance(s.get(key), int | float):
                yield GaugeMetricFamily(name, doc, value=s[key])
        used, total = s.get("kv_blocks_used"), s.get("kv_blocks_total")
        if isinstance(used, int) and isinstance(total, int) and total > 0:
            yield GaugeMetricFamily(
                "meshlm_kv_cache_usage_perc",
                "KV cache blocks in use (1 = all).",
                value=used / total,
            )
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if isinstance(s.get(key), int | float):
                yield CounterMetricFamily(name, doc, value=s[key])


class _BudgetCollector(Collector):
    def __init__(self, levels: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.levels = levels

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "meshlm_tenant_token_budget_remaining",
            "Tokens left of a tenant's budget on this runtime (its share in rate_limits.mode "
            "local), refills counted; tenants that called since the runtime started.",
            labels=["tenant", "budget"],
        )
        for tenant, budgets in sorted(self.levels().items()):
            for name, left in sorted(budgets.items()):
                g.add_metric([tenant, name], left)
        yield g


class RuntimeMetrics:
    """What a runtime observes, and its exposition. Thread-safe (prometheus_client locks)."""

    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.registry = prometheus_text.registry()
        r = self.registry
        self.ttft = Histogram("meshlm_time_to_first_token_seconds",
                              "Time from a Generate call's arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("meshlm_inter_token_latency_seconds",
                             "Time between two tokens of one stream, as sent.",
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("meshlm_e2e_request_latency_seconds",
                             "Generate calls from arrival to their last chunk (any status).",
                             buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.queue = Histogram("meshlm_request_queue_time_seconds",
                               "Time a Generate call waited in the engine's queue.",
                               buckets=QUEUE_BUCKETS, registry=r)  # fmt: skip
        self.requests = Counter("meshlm_requests", "Calls by method, gRPC status and tenant.",
                                ["method", "code", "tenant"], registry=r)  # fmt: skip
        self.shadow_requests = Counter("meshlm_shadow_requests",
                                       "Mirrored (shadow) Generate calls by gRPC status; they "
                                       "count in no other series.",
                                       ["code"], registry=r)  # fmt: skip
        # Usage, what a tenant is billed for, by tenant and the served model id a call named: both
        # label sets are bounded (MAX_TENANTS; only the runtime's served ids pass validation).
        self.prompt_tokens = Counter("meshlm_tenant_prompt_tokens",
                                     "Prompt tokens of Generate calls the engine ran, by tenant "
                                     "and model id.", ["tenant", "model"], registry=r)  # fmt: skip
        self.generation_tokens = Counter("meshlm_tenant_generation_tokens",
                                         "Tokens Generate calls streamed, by tenant and model id.",
                                         ["tenant", "model"], registry=r)  # fmt: skip
        self.resumes = Counter("meshlm_request_resumes",
                               "Generate calls that resumed another replica's stream.",
                               registry=r)  # fmt: skip
        self._tenants: set[str] = set()
        self._lock = threading.Lock()
        r.register(_EngineCollector(engine_stats))

    def watch_budgets(self, levels: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Report `levels()` (tenant -> budget -> tokens left) as a gauge at each scrape."""
        self.registry.register(_BudgetCollector(levels))

    def tenant(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._tenants:
                return tenant
            if len(self._tenants) < MAX_TENANTS:
                self._tenants.add(tenant)
                return tenant
        return OTHER_TENANT

    def exposition(self) -> bytes:
        return prometheus_text.exposition(self.registry)
