"""The built-in traffic gate's source: Envoy's `grpc_stats` counters on the caller-side sidecars,
`cluster.<cluster>.grpc.<service>.<method>.{total,success,failure,<grpc code>}`, read from each
Envoy's admin `/stats`. gRPC errors are HTTP 200 with a `grpc-status` trailer, so 5xx counters
are blind to them (docs/ARCHITECTURE.md). The OpenAI HTTP API shares the version's cluster: its
calls are the cluster's completed upstream requests beyond the gRPC calls, its faults the
cluster's `upstream_rq_5xx` (see `parse_http_stats`)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from xds_server.rollout.gates.fetch import MeasurementError, get_json

# UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS: the codes a
# server answers for its own faults (grpc/doc/statuscodes.md lists which codes are server-side).
SERVER_FAULT_CODES = frozenset({"2", "4", "12", "13", "14", "15"})
# by_status keys of the OpenAI HTTP API's calls: a 5xx is the upstream's fault.
HTTP_5XX = "http_5xx"
HTTP_OTHER = "http_other"


@dataclass(frozen=True)
class GrpcCounts:
    total: int = 0
    success: int = 0
    failure: int = 0
    by_status: dict[str, int] = field(default_factory=dict)  # grpc code number -> calls

    def __add__(self, o: GrpcCounts) -> GrpcCounts:
        codes = dict(self.by_status)
        for k, v in o.by_status.items():
            codes[k] = codes.get(k, 0) + v
        return GrpcCounts(
            self.total + o.total, self.success + o.success, self.failure + o.failure, codes
        )

    def since(self, before: GrpcCounts | None) -> GrpcCounts:
        """Counts added since `before`. A counter that went down means Envoy restarted (its
        stats start at zero), so everything now counted is new."""
        if before is None or self.total < before.total:
            return self
        codes = {k: v - before.by_status.get(k, 0) for k, v in self.by_status.items()}
        return GrpcCounts(
            self.total - before.total,
            max(0, self.success - before.success),
            max(0, self.failure - before.failure),
            {k: v for k, v in codes.items() if v > 0},
        )

    @property
    def server_faults(self) -> int:
        """Calls that failed through the upstream's fault. A denial by the authz filter
        (UNAUTHENTICATED, PERMISSION_DENIED, a tenant's RESOURCE_EXHAUSTED) or a client's bad
        argument is the right answer to a bad call, and must not roll a healthy canary back."""
        if not self.by_status:
            return self.failure
        faults = SERVER_FAULT_CODES | {HTTP_5XX}
        return sum(v for k, v in self.by_status.items() if k in faults)

    @property
    def success_rate(self) -> float | None:
        return 100.0 * (self.total - self.server_faults) / self.total if self.total else None


class GrpcCountsSource(Protocol):
    def read(self) -> dict[str, GrpcCounts]:
        """Counts per sidecar (key: its admin URL), cumulative since that Envoy started."""
        ...


def delta(before: dict[str, GrpcCounts] | None, after: dict[str, GrpcCounts]) -> GrpcCounts:
    """Sum over sidecars of what each counted between two reads (per sidecar, so one Envoy's
    restart does not spoil the others' numbers)."""
    out = GrpcCounts()
    for url, now in after.items():
        out = out + now.since((before or {}).get(url))
    return out


def parse_grpc_stats(stats_json: dict[str, Any], cluster: str) -> GrpcCounts:
    """Envoy admin `/stats?format=json` -> the cluster's gRPC counts, summed over methods.

    The last name segment says what is counted; service and method names contain dots, so the
    name is read from the right."""
    prefix = f"cluster.{cluster}.grpc."
    total = success = failure = 0
    codes: dict[str, int] = {}
    for s in stats_json.get("stats", []):
        name, value = s.get("name", ""), s.get("value")
        if value is None or not name.startswith(prefix):
            continue
        last = name.rsplit(".", 1)[-1]
        if last == "total":
            total += value
        elif last == "success":
            success += value
        elif last == "failure":
            failure += value
        elif last.isdigit():
            codes[last] = codes.get(last, 0) + value
    return GrpcCounts(total, success, failure, codes)


def parse_http_stats(stats_json: dict[str, Any], cluster: str, grpc: GrpcCounts) -> GrpcCounts:
    """`grpc` plus the cluster's non-gRPC calls (the OpenAI HTTP API).

    Envoy's cluster counters mix both protocols. HTTP calls: the completed upstream requests
    that are neither a retry nor a gRPC call. A gRPC call answered by the upstream is HTTP 200
    whatever its grpc-status, so `upstream_rq_5xx` holds the HTTP API's 5xx, plus gRPC calls the
    caller sidecar failed itself (connect failure, reset), which grpc_stats already counts: the
    HTTP faults are capped at the HTTP calls, so gRPC-only traffic reads as before."""
    prefix = f"cluster.{cluster}."
    got = {"upstream_rq_completed": 0, "upstream_rq_retry": 0, "upstream_rq_5xx": 0}
    for s in stats_json.get("stats", []):
        name = s.get("name", "")
        if name.startswith(prefix) and name[len(prefix) :] in got:
            got[name[len(prefix) :]] += s.get("value") or 0
    calls = got["upstream_rq_completed"] - got["upstream_rq_retry"] - grpc.total
    if calls <= 0:
        return grpc
    failed = min(got["upstream_rq_5xx"], calls)
    http = {HTTP_5XX: failed, HTTP_OTHER: calls - failed}
    return grpc + GrpcCounts(calls, calls - failed, failed, {k: v for k, v in http.items() if v})


class EnvoyStatsSource:
    """gRPC counters for one upstream cluster, read from several Envoys' admin `/stats`, with
    the OpenAI HTTP API's calls to it (`parse_http_stats`).
    `admin_urls` is a list, or a function asked at every read (sidecars come and go)."""

    def __init__(
        self,
        admin_urls: list[str] | Callable[[], list[str]],
        cluster: str,
        *,
        timeout: float = 2.0,
    ) -> None:
        if not callable(admin_urls) and not admin_urls:
            raise ValueError("EnvoyStatsSource needs at least one caller-side admin URL")
        self._urls = admin_urls if callable(admin_urls) else (lambda: list(admin_urls))
        self.cluster = cluster
        self.timeout = timeout
        c = re.escape(f"cluster.{cluster}.")
        regex = f"^{c}(grpc\\.|upstream_rq_(completed|retry|5xx)$)"
        self._query = "/stats?format=json&filter=" + urllib.parse.quote(regex, safe="")

    def read(self) -> dict[str, GrpcCounts]:
        urls = [u.rstrip("/") for u in self._urls()]
        if not urls:
            raise MeasurementError("no caller-side sidecar with an admin URL is connected")
        docs = {url: get_json(url + self._query, self.timeout) for url in urls}
        return {
            url: parse_http_stats(doc, self.cluster, parse_grpc_stats(doc, self.cluster))
            for url, doc in docs.items()
        }
