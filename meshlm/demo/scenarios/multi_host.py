"""`meshlm demo --scenario multi-host`: the mesh across hosts, each a Linux network namespace
with its own address on a bridge (meshlm.demo.hosts).

Host `cp` runs the control plane; `h1`, `h2` (v1) and `h3` (v2) each run a runtime on their own
loopback and a sidecar whose inbound listener binds the host's address and which joins the
service by registration (the mesh file lists no endpoint of theirs); host `caller` runs the
caller sidecar and, beside it, the traffic client (meshlm.demo.host_client), as a pod's
container would. Every hop between hosts is sidecar to sidecar over mTLS with SPIFFE
certificates, the registration streams and the rollout gates' reads included (the gates read the
caller's counters through its read-only stats listener). Traffic scaled to the runtime's
measured speed runs while the control plane rolls v2 out; meanwhile h1 is cut off (blackhole
routes) and healed, then h2 scales in: its sidecar is sent SIGTERM (it deregisters, waits for
the callers to drop it, drains), and only then its runtime stops. Exit 0 when every goal holds;
2 where network namespaces cannot be made (never a fallback to loopback).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

from meshlm.demo.host_mesh import (
    MAX_NEW_TOKENS,
    SERVICE,
    HostMesh,
    calls_summary,
    mesh_base,
    overlaps,
    run_hosts,
    run_scenario,
)
from meshlm.demo.scenario import say

# host -> (version, zone)
RUNTIME_HOSTS = {"h1": ("v1", "zone-a"), "h2": ("v1", "zone-b"), "h3": ("v2", "zone-c")}
PARTITIONED, SCALED_IN = "h1", "h2"
HOSTS = ("cp", *RUNTIME_HOSTS, "caller")
PARTITION_S = 8.0
AVAILABILITY_GOAL = 99.9
STALL = {"gap": "1s", "consecutive": 3, "hard_limit": "5s", "max_resumes": 2}
ROLLOUT = {
    "stable": "v1", "canary": "v2", "steps": [20, 50, 100], "interval": "10s", "threshold": 2,
    "gates": {"grpc_success_rate_min": 99.0, "min_requests": 3},
}  # fmt: skip


def run(args: argparse.Namespace, name: str) -> int:
    return run_scenario(
        "multi-host: a rollout across hosts, a partition and a scale-in under traffic",
        lambda: run_hosts(HOSTS, args.workdir, _Demo, min(args.timeout, 600.0)),
    )


def mesh_doc(ports: dict[str, int], caller_stats_url: str) -> dict[str, Any]:
    """The mesh file: no endpoint of any runtime (they register), identity on."""
    service = {
        "service_account": f"default/{SERVICE}",
        "versions": {v: {"precision": "int4", "endpoints": []} for v in ("v1", "v2")},
        "route": {"weights": {"v1": 100, "v2": 0}, "stream_idle_timeout": "60s"},
        "outlier_detection": {
            "consecutive_gateway_failure": 2, "consecutive_5xx": 5, "interval": "1s",
            "base_ejection_time": "10s", "max_ejection_percent": 50,
        },
        "retry_policy": {
            "retry_on": "unavailable,connect-failure,refused-stream", "num_retries": 2,
        },
        "health_check": {
            "interval": "1s", "timeout": "1s", "unhealthy_threshold": 2, "healthy_threshold": 1,
        },
        "stall": dict(STALL),
    }  # fmt: skip
    doc = mesh_base(ports, caller_stats_url, {SERVICE: service})
    doc["rollouts"] = {SERVICE: dict(ROLLOUT)}
    return doc


class _Demo(HostMesh):
    runtime_hosts = RUNTIME_HOSTS

    def __init__(self, net: Any, workdir: Path, id_dir: Path, deadline: float) -> None:
        super().__init__(net, workdir, id_dir, deadline)
        self.history_seen = 0  # rollout transitions printed
        self.h1_active = 0

    def mesh_doc(self, caller_stats_url: str) -> dict[str, Any]:
        return mesh_doc(self.ports, caller_stats_url)

    # -- the run ---------------------------------------------------------------------------
    def scenario(self) -> dict[str, Any]:
        joins = self.start_hosts()
        registered = {r["address"]: r for r in self.admin("GET", "/debug/syncz")["registrations"]}
        say(f"registered: {', '.join(sorted(registered))}")
        capacity, rate = self.load("h3")
        say(
            f"runtime decodes {capacity:.0f} tokens/s: "
            f"{rate:.2f} calls/s of {MAX_NEW_TOKENS} tokens"
        )
        out = self.workdir / "calls.json"
        self.start_traffic(rate, out)
        time.sleep(4)
        status = self.admin("POST", f"/rollouts/{SERVICE}", {})
        spec = status["spec"]
        say(f"rollout {spec['stable']} -> {spec['canary']}, steps {spec['steps']}")
        self.sleep(2)
        self.h1_active = self._partition(PARTITIONED)
        say(
            f"{PARTITIONED} partitioned (blackhole routes both ways) for {PARTITION_S:g} s, "
            f"{self.h1_active} stream(s) running there"
        )
        self.sleep(PARTITION_S)
        self.net.heal(PARTITIONED)
        self.events["heal"] = time.monotonic()
        say(f"{PARTITIONED} healed")
        # Its registration stream either outlived the cut (no keepalive fell inside it) or broke
        # and registers again: either way the host is back once the control plane holds an open
        # stream for it, SERVING, and the caller's Envoy has it again.
        back = f"{PARTITIONED} back in the pool after the heal"
        self.until(lambda: self.back(PARTITIONED), 60, back)
        self.events["back_in_pool"] = time.monotonic()
        self.sleep(2)
        self._wait_rollout(lambda s: s["state"] in TERMINAL or _weight(s) >= 50)
        scale_in = self._scale_in(SCALED_IN)
        status = self._wait_rollout(lambda s: s["state"] in TERMINAL)
        self.sleep(3)  # calls after the last step
        calls = self.stop_traffic(out)
        return self._report(joins, registered, capacity, rate, status, scale_in, calls)

    # -- starting ----------------------------------------------------------------------------
    # -- faults ------------------------------------------------------------------------------
    def _partition(self, host: str) -> int:
        """Cut `host` off mid-stream; how many streams the caller's Envoy had running there."""
        active = self.busy(host)
        self.events["partition"] = time.monotonic()
        self.net.partition(host, "blackhole")
        return active

    def _scale_in(self, host: str) -> dict[str, Any]:
        """SIGTERM the host's sidecar (deregister, callers drop it, drain), then its runtime."""
        sidecar, runtime = self.procs[f"sidecar-{host}"], self.procs[f"runtime-{host}"]
        address = self.address(host)
        active = self.busy(host)
        self.events["scale_in"] = t0 = time.monotonic()
        say(f"{host} scales in: SIGTERM to its sidecar, {active} stream(s) running there")
        rc = sidecar.stop(timeout=60)
        t1 = time.monotonic()
        runtime.stop(timeout=30)
        self.events["scale_in_done"] = t2 = time.monotonic()
        dereg = sidecar.first(r"deregistered " + address)
        gone = address not in self.caller_hosts(RUNTIME_HOSTS[host][0])
        say(
            f"{host}: sidecar exited ({rc}) after {t1 - t0:.1f} s, "
            f"runtime after {t2 - t1:.1f} s more"
        )
        return {
            "host": host, "address": address, "streams_running_on_it": active,
            "sidecar_exit": rc,
            "deregistered_s": None if dereg is None else round(dereg - t0, 3),
            "deregistration_line": sidecar.first(r"deregistered ") is not None,
            "sidecar_exited_after_s": round(t1 - t0, 3),
            "runtime_stopped_after_s": round(t2 - t1, 3),
            "caller_dropped_it": gone,
        }  # fmt: skip

    # -- the rollout -------------------------------------------------------------------------
    def _wait_rollout(self, done: Any) -> dict[str, Any]:
        while True:
            s = self.admin("GET", f"/rollouts/{SERVICE}")
            for h in s["history"][self.history_seen :]:
                say(f"rollout -> {h['to']} canary {h['canary_weight']}%  {h['reason']}")
            self.history_seen = len(s["history"])
            if done(s):
                return s
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"rollout still {s['state']}: {s['message']}")
            time.sleep(0.5)

    # -- the report --------------------------------------------------------------------------
    def _report(
        self, joins: dict, registered: dict, capacity: float, rate: float,
        status: dict, scale_in: dict, calls: list[dict[str, Any]],
    ) -> dict[str, Any]:  # fmt: skip
        ok = sum(c["status"] == "OK" for c in calls)
        availability = 100.0 * ok / len(calls) if calls else 0.0
        ev = self.events
        window = (ev["scale_in"] - 0.5, ev["scale_in_done"] + 5)
        lost = [c for c in calls if c["status"] != "OK" and overlaps(c, *window)]
        static = [e for v in mesh_doc(self.ports, "")["services"][SERVICE]["versions"].values()
                  for e in v["endpoints"]]  # fmt: skip
        joined = {j["address"] for j in joins.values()}
        h1 = self.address(PARTITIONED)
        rejoined = self.procs[f"sidecar-{PARTITIONED}"].first_after(
            r"\bregistered " + h1, ev["heal"]
        )
        back = ev.get("back_in_pool")
        rollout_steps = [
            {"to": h["to"], "canary_weight": h["canary_weight"], "reason": h["reason"]}
            for h in status["history"]
        ]
        t0 = min((c["at"] for c in calls), default=ev["partition"])
        report = {
            "workdir": str(self.workdir),
            "hosts": {h.name: h.address for h in self.net.hosts.values()},
            "joins": joins,
            "endpoints_in_mesh_file": static,
            "registered_at_control_plane": sorted(registered),
            "capacity_tokens_per_s": round(capacity, 1),
            "rate_calls_per_s": round(rate, 3),
            "max_new_tokens": MAX_NEW_TOKENS,
            "calls": calls_summary(calls),
            "availability_percent": round(availability, 3),
            "events_s_after_first_call": {k: round(v - t0, 2) for k, v in ev.items()},
            "partition": {
                "host": PARTITIONED, "mode": "blackhole", "seconds": PARTITION_S,
                "streams_running_on_it": self.h1_active,
                "calls_in_flight_at_the_cut": _at_cut(calls, ev["partition"], h1),
                "back_in_pool_s_after_heal": None if back is None else round(back - ev["heal"], 2),
                "registered_again": rejoined is not None,
            },
            "scale_in": {**scale_in, "calls_lost": len(lost),
                         "lost_by_status": dict(Counter(c["status"] for c in lost))},
            "rollout": {"state": status["state"], "message": status["message"],
                        "steps": rollout_steps},
        }  # fmt: skip
        cut = report["partition"]["calls_in_flight_at_the_cut"]
        counted = sum(v for k, v in cut.items() if k != "total")
        report["goals"] = {
            "every_runtime_host_registered": not static and joined <= set(registered),
            "rollout_succeeded": status["state"] == "Succeeded",
            f"availability_at_least_{AVAILABILITY_GOAL}": availability >= AVAILABILITY_GOAL,
            "none_lost_by_the_drain": not lost and scale_in["sidecar_exit"] == 0,
            "partitioned_streams_counted": counted == cut["total"],
        }
        return report

    # -- plumbing ----------------------------------------------------------------------------


TERMINAL = ("Succeeded", "RolledBack", "Failed")


def _weight(status: dict[str, Any]) -> int:
    return status["history"][-1]["canary_weight"] if status["history"] else 0


def _at_cut(calls: list[dict[str, Any]], t: float, host: str) -> dict[str, int]:
    """The calls running when the host was cut off, each counted once: finished there before
    the cut took hold, resumed mid-stream, answered by another host, or failed (by status)."""
    out: Counter[str] = Counter()
    for c in calls:
        if not overlaps(c, t, t):
            continue
        out["total"] += 1
        if c["status"] != "OK":
            out[f"failed_{c['status']}"] += 1
        elif c["resumes"]:
            out["resumed"] += 1
        elif c["replica"] == host:
            out["finished_on_it"] += 1
        else:
            out["answered_by_another_host"] += 1
    return {"total": 0, **out}
