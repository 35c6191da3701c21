"""`meshlm demo --scenario zone-loss`: a caller's zone loses every runtime host mid-traffic and
gets them back, on hosts that are Linux network namespaces (meshlm.demo.hosts).

Host `cp` runs the control plane; `a1` (zone-a) and `b1` (zone-b) each run a runtime and a
sidecar that registers the host in its zone (`meshlm sidecar --zone`); host `caller` runs the
caller sidecar in zone-a and the traffic client beside it (meshlm.demo.host_mesh). The service
has `locality: {failover: [zone-a, zone-b]}`, outlier detection, active health checks, a per-try
timeout and stream resumption (`stall`). Traffic scaled to the runtime's measured speed runs
while zone-a's runtime hosts are cut off (blackhole routes both ways), held so, then healed,
LOSSES times.
Which zone served a call is read from the runtime's `x-meshlm-replica` (its host's address).
The report: `in_zone_share` (percent of calls served in zone-a before the first loss),
`failovers_s` (each cut -> the first token from zone-b after it) and `failover_s` (the slowest),
`failbacks_s` (each heal -> the first token from zone-a again) and `failback_s` (the slowest),
the `sla` object and the goals. Exit 0 when every goal holds; 2 where network
namespaces cannot be made.

`measure(mechanism, quick)` is the same run for `python -m bench sla`: off, the service has no
`locality` (its calls spread over both zones, as Istio with `localityLbSetting` disabled or a
plain Kubernetes Service); both runs keep outlier detection, health checks, the per-try
timeout and resumption.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from meshlm.demo.host_mesh import (
    MAX_NEW_TOKENS,
    SERVICE,
    HostMesh,
    calls_summary,
    mesh_base,
    run_hosts,
    run_scenario,
)
from meshlm.demo.scenario import say

BENCH_TITLE = (
    "Zone loss: a caller's zone loses its runtime hosts and gets them back "
    "(off: no `locality`, calls spread over both zones)"
)
HOME, AWAY = "zone-a", "zone-b"
RUNTIME_HOSTS = {"a1": ("v1", HOME), "b1": ("v1", AWAY)}  # host -> (version, zone)
HOSTS = ("cp", *RUNTIME_HOSTS, "caller")
WARM_S, HOLD_S = 8.0, 6.0
# Losses per run, each healed and served in zone-a again for SETTLE_S before the next: the
# failover goal is over the run's failovers (their p99: with three, the slowest).
LOSSES, SETTLE_S = 3, 3.0
TRAFFIC_MAX_S = 150.0
IN_ZONE_GOAL, FAILOVER_GOAL_S, AVAILABILITY_GOAL = 95.0, 2.0, 99.9
STALL = {"gap": "1s", "consecutive": 3, "hard_limit": "3s", "max_resumes": 2}


def run(args: argparse.Namespace, name: str) -> int:
    return run_scenario(
        "zone-loss: the caller's zone loses its runtime hosts mid-traffic, then heals",
        lambda: _run(args.workdir, min(args.timeout, 600.0), mechanism=True),
    )


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    """One run with `locality` on or off; its sla object and zone figures."""
    workdir = Path(tempfile.mkdtemp(prefix=f"meshlm-zone-loss-{'on' if mechanism else 'off'}-"))
    report = _run(workdir, 400.0, mechanism=mechanism)
    return {
        "sla": report["sla"],
        "in_zone_share": report["in_zone_share"],
        "failover_s": report["failover_s"],
        "failback_s": report["failback_s"],
    }


def _run(workdir: Path | None, timeout: float, mechanism: bool) -> dict[str, Any]:
    def make(net: Any, wd: Path, id_dir: Path, deadline: float) -> _ZoneLoss:
        return _ZoneLoss(net, wd, id_dir, deadline, mechanism)

    return run_hosts(HOSTS, workdir, make, timeout)


def service(locality: bool) -> dict[str, Any]:
    """The service's mesh entry: registered endpoints only; `locality` keeps zone-a's callers
    in zone-a. A partitioned host holds its open connection silent: the per-try timeout fails
    the try (a failure outlier detection counts), the retry goes on once the host is ejected,
    and a stream cut after its first token resumes on another replica."""
    doc = {
        "service_account": f"default/{SERVICE}",
        "versions": {"v1": {"precision": "int4", "endpoints": []}},
        "route": {"weights": {"v1": 100}, "stream_idle_timeout": "60s"},
        "connect_timeout": "0.5s",
        "outlier_detection": {
            "consecutive_5xx": 2, "consecutive_gateway_failure": 2, "interval": "0.5s",
            "base_ejection_time": "2s", "max_ejection_percent": 100,
        },
        "retry_policy": {
            "retry_on": "unavailable,connect-failure,refused-stream", "num_retries": 3,
            "per_try_timeout": "750ms",
        },
        "health_check": {
            "interval": "1s", "timeout": "1s", "unhealthy_threshold": 2, "healthy_threshold": 1,
        },
        "stall": dict(STALL),
    }  # fmt: skip
    if locality:
        doc["locality"] = {"failover": [HOME, AWAY]}
    return doc


class _ZoneLoss(HostMesh):
    runtime_hosts = RUNTIME_HOSTS
    caller_zone = HOME

    def __init__(
        self, net: Any, workdir: Path, id_dir: Path, deadline: float, mechanism: bool
    ) -> None:
        super().__init__(net, workdir, id_dir, deadline)
        self.mechanism = mechanism
        self.cycles: list[dict[str, float]] = []  # each loss: monotonic times of its events

    def mesh_doc(self, caller_stats_url: str) -> dict[str, Any]:
        return mesh_base(self.ports, caller_stats_url, {SERVICE: service(self.mechanism)})

    def scenario(self) -> dict[str, Any]:
        joins = self.start_hosts()
        capacity, rate = self.load("a1")
        say(f"runtime decodes {capacity:.0f} tokens/s: {rate:.2f} calls/s of {MAX_NEW_TOKENS} "
            f"tokens; locality {'on' if self.mechanism else 'off'}")  # fmt: skip
        out = self.workdir / "calls.json"
        self.start_traffic(rate, out, max_seconds=TRAFFIC_MAX_S)
        self.sleep(WARM_S)
        home = [h for h, (_, zone) in RUNTIME_HOSTS.items() if zone == HOME]
        for n in range(LOSSES):
            active = self.busy(home[0], wait=5)  # the cut comes while a stream runs there
            self.cycles.append({"partition": time.monotonic()})
            for h in home:
                self.net.partition(h, "blackhole")
            say(f"loss {n + 1}/{LOSSES}: {HOME} partitioned ({', '.join(home)}, blackhole "
                f"routes both ways) for {HOLD_S:g} s, {active} stream(s) there")  # fmt: skip
            self.sleep(HOLD_S)
            for h in home:
                self.net.heal(h)
            self.cycles[-1]["heal"] = time.monotonic()
            say(f"{HOME} healed")
            base = self._successes(home)
            what = f"a call served in {HOME} after the heal"
            self.until(lambda b=base: self._successes(home) > b, 45, what)
            self.cycles[-1]["served_in_zone_again"] = time.monotonic()
            self.sleep(SETTLE_S)
        calls = self.stop_traffic(out)
        return self._report(joins, capacity, rate, calls)

    def _successes(self, hosts: list[str]) -> int:
        """Calls the caller's Envoy counts as finished well on `hosts` (its rq_success)."""
        lines = self.caller_admin("/clusters").splitlines()
        keys = tuple(f"outbound|{SERVICE}|{self.runtime_hosts[h][0]}::{self.address(h)}::"
                     "rq_success::" for h in hosts)  # fmt: skip
        return sum(int(x.rsplit(":", 1)[1]) for x in lines if x.startswith(keys))

    def _report(
        self, joins: dict, capacity: float, rate: float, calls: list[dict[str, Any]]
    ) -> dict[str, Any]:
        from meshlm.demo.sla import sla

        zone_of = {self.address(h): zone for h, (_, zone) in RUNTIME_HOSTS.items()}
        served = [(_first_token(c), zone_of.get(c["replica"])) for c in calls if c["replica"]]
        first_cut = self.cycles[0]["partition"]
        before = [zone for t, zone in served if t < first_cut]
        in_zone = 100.0 * before.count(HOME) / len(before) if before else None

        def first(zone: str, since: float) -> float | None:
            at = min((t for t, z in served if t >= since and z == zone), default=None)
            return None if at is None else round(at - since, 3)

        failovers = [first(AWAY, c["partition"]) for c in self.cycles]
        failbacks = [first(HOME, c["heal"]) for c in self.cycles]
        report_sla = sla(SimpleNamespace(**c) for c in calls)
        t0 = min((c["at"] for c in calls), default=first_cut)
        report = {
            "workdir": str(self.workdir),
            "locality": self.mechanism,
            "hosts": {h.name: h.address for h in self.net.hosts.values()},
            "zones": {h: zone for h, (_, zone) in RUNTIME_HOSTS.items()} | {"caller": HOME},
            "joins": joins,
            "capacity_tokens_per_s": round(capacity, 1),
            "rate_calls_per_s": round(rate, 3),
            "max_new_tokens": MAX_NEW_TOKENS,
            "partition": {"zone": HOME, "mode": "blackhole", "seconds": HOLD_S, "losses": LOSSES},
            "losses_s_after_first_call": [
                {k: round(v - t0, 2) for k, v in c.items()} for c in self.cycles
            ],
            "calls": calls_summary(calls),
            "calls_before_the_loss": len(before),
            "in_zone_share": None if in_zone is None else round(in_zone, 2),
            # The slowest of the run's failovers and failbacks (None: one never happened).
            "failover_s": _slowest(failovers),
            "failback_s": _slowest(failbacks),
            "failovers_s": failovers,
            "failbacks_s": failbacks,
            "sla": report_sla,
        }
        availability = report_sla["availability"] or 0.0
        report["goals"] = {
            f"in_zone_share_at_least_{IN_ZONE_GOAL:g}": (in_zone or 0.0) >= IN_ZONE_GOAL,
            f"failover_within_{FAILOVER_GOAL_S:g}_s": report["failover_s"] is not None
            and report["failover_s"] <= FAILOVER_GOAL_S,
            f"availability_at_least_{AVAILABILITY_GOAL}": availability >= AVAILABILITY_GOAL,
            f"calls_back_in_{HOME}": report["failback_s"] is not None,
        }
        return report


def _first_token(call: dict[str, Any]) -> float:
    """The driver's monotonic time of the call's first token (its send time when it had none)."""
    return call["at"] + (call["ttft_ms"] or 0.0) / 1000


def _slowest(times: list[float | None]) -> float | None:
    return None if not times or None in times else max(t for t in times if t is not None)
