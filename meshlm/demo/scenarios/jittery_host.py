"""`meshlm demo --scenario jittery-host`: one host of three turns slow and callers route around it.

One service, three int4 runtime hosts of v1 on loopback, each behind its inbound sidecar, the
caller's sidecar and one tenant's open-loop Generate traffic at a rate scaled to the runtimes'
measured speed (sequential calls through the mesh first: CPUs differ several-fold). A baseline
window runs without a fault; then a host-scoped 500 ms delay fault on one host, set through the
control plane's admin API (`meshlm fault add --host`), which that host's own sidecar injects, so
every caller sees it slow.

The mechanism (on): what a user sets to avoid a slow host. A per-try timeout just above the
baseline's TTFT p99 (derived from it, applied once the baseline is measured): Envoy's per-try
timeout fires only before the response started, so on a token stream it is a time-to-first-token
limit; the timed-out try is retried on another host (`gateway-error`, previous_hosts) and counts
as a gateway failure (504) for outlier detection, whose `consecutive_gateway_failure` ejects the
host; least_loaded balancing. Off: round robin, no per-try timeout.

The report: `time_to_avoid_s` (fault ACKed -> the slow host's share of the tries, over a sliding
window of the last WINDOW_TRIES tries at the three hosts, below 10 %), its share after that, the
caller's TTFT p99 after avoidance against the baseline's, the caller sidecar's per-try timeouts,
retries and ejections, the `sla` object of the run and `goals`."""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report

BENCH_TITLE = "Jittery host: a 500 ms delay on one host of three"
HOSTS = 3
SLOW = "v1-0"
FAULT_DELAY_S = 0.5
MAX_NEW_TOKENS = 4
# Calls in flight on average (open loop): the rate is this over one call's measured latency.
LOAD = 0.5
RATE_BOUNDS = (0.3, 5.0)  # calls per second
WINDOW_S = (12.0, 40.0)  # each window's length bounds, whatever the rate
CALIBRATION_CALLS = 6
WINDOW_TRIES = 12  # the sliding window the slow host's share is read over
AVOID_SHARE = 0.10
AVOID_WITHIN_S = 15.0
TTFT_FACTOR = 1.2
# The per-try timeout from the baseline's TTFT p99: above every healthy first token.
PER_TRY_FACTOR, PER_TRY_MARGIN_S = 1.5, 0.1
POLL_S = 0.2
# Outlier detection: two timed-out tries in a row eject a host for the run; never two hosts.
OUTLIER = {
    "consecutive_gateway_failure": 2,
    "consecutive_5xx": 5,
    "interval": "1s",
    "base_ejection_time": "300s",
    "max_ejection_percent": 34,  # one host of three at most
}
TRIES_STAT = "http.inbound_llm_v1.downstream_rq_total"  # the inbound listener's stat_prefix
RETRY_ON = "unavailable,connect-failure,refused-stream,gateway-error"


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "jittery-host: a 500 ms delay on one host of three",
        lambda: _run(mechanism=True, quick=False, workdir=args.workdir, say=say),
    )
    if report is None:
        return 1
    return 0 if all(report["goals"].values()) and report["sla"]["ok"] else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    r = _run(mechanism=mechanism, quick=quick, workdir=None, say=lambda m: None)
    keep = ("sla", "time_to_avoid_s", "slow_host_share_after", "ttft_p99_ms",
            "per_try_timeout_ms", "caller_sidecar", "goals")  # fmt: skip
    return {k: r[k] for k in keep}


def _mesh(mechanism: bool) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, scenario_mesh

    mesh = scenario_mesh({"v1": 100})
    svc = mesh["services"][SERVICE]
    svc["load_balancing"] = "least_loaded" if mechanism else "round_robin"
    svc["outlier_detection"] = dict(OUTLIER)
    svc["retry_policy"] = {"retry_on": RETRY_ON, "num_retries": 1}
    return mesh


def _run(*, mechanism: bool, quick: bool, workdir: Any, say: Any) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.sla import percentile, sla
    from meshlm.demo.traffic import TenantLoad, Traffic

    mesh = LocalMesh(_mesh(mechanism), workdir=workdir, replicas={"v1": HOSTS})
    slow = mesh.runtimes[SLOW]
    slow_host = f"127.0.0.1:{slow.inbound_port}"
    say(f"logs and report in {mesh.workdir}; mechanism {'on' if mechanism else 'off'}")
    calls = 40 if quick else 100  # per window: baseline, and after avoidance
    with running(mesh, say) as stops:
        latency = _calibrate(mesh)
        rate = min(max(LOAD / latency, RATE_BOUNDS[0]), RATE_BOUNDS[1])
        window_s = min(max(calls / rate, WINDOW_S[0]), WINDOW_S[1])
        say(f"one call {latency * 1000:.0f} ms: traffic {rate:.2f} calls/s, "
            f"{MAX_NEW_TOKENS} tokens")  # fmt: skip
        tries = _TryCounter(mesh)
        stops.callback(tries.stop)
        load = TenantLoad("acme", "demo-acme-key", rate=rate)
        traffic = Traffic(
            mesh.caller_target, [load], authority=SERVICE, max_new_tokens=MAX_NEW_TOKENS
        ).start()
        stops.callback(traffic.stop)
        tries.start()
        t_base = time.monotonic()
        time.sleep(window_s)
        baseline = [o for o in traffic.since(t_base) if o.status == "OK" and o.ttft_ms]
        base_p99 = percentile((o.ttft_ms for o in baseline), 99) or 0.0
        per_try = None
        if mechanism:
            per_try = round(
                max(base_p99 / 1000 * PER_TRY_FACTOR, base_p99 / 1000 + PER_TRY_MARGIN_S), 3
            )
            doc = json.loads(json.dumps(mesh.mesh))
            doc["services"][SERVICE]["retry_policy"]["per_try_timeout"] = f"{per_try * 1000:.0f}ms"
            mesh.admin("POST", "/v1/mesh?timeout=10", doc)
            say(f"baseline TTFT p99 {base_p99:.0f} ms: per_try_timeout {per_try * 1000:.0f} ms")
        delay = {"fixed_delay": f"{FAULT_DELAY_S * 1000:.0f}ms"}
        fault = {"service": SERVICE, "host": slow_host, "delay": delay, "duration": "10m"}
        mesh.admin("POST", "/v1/faults/slow-host?timeout=10", fault)
        t_fault = time.monotonic()
        say(f"fault ACKed: {SLOW} ({slow_host}) delays every call {FAULT_DELAY_S * 1000:.0f} ms")
        avoided = None
        deadline = t_fault + max(AVOID_WITHIN_S * 2, window_s)
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            avoided = tries.avoided_at(SLOW, since=t_fault)
            if avoided is not None:
                break
        t_after = avoided if avoided is not None else time.monotonic()
        time.sleep(window_s)
        traffic.stop()
        tries.stop()
        after = [o for o in traffic.since(t_after) if o.status == "OK" and o.ttft_ms]
        after_p99 = percentile((o.ttft_ms for o in after), 99)
        ratio = round(after_p99 / base_p99, 2) if after_p99 and base_p99 else None
        share_after = tries.share(SLOW, since=t_after)
        to_avoid = round(avoided - t_fault, 1) if avoided is not None else None
        report = {
            "scenario": "jittery-host",
            "mechanism": mechanism,
            "workdir": str(mesh.workdir),
            "load_balancing": "least_loaded" if mechanism else "round_robin",
            "per_try_timeout_ms": None if per_try is None else round(per_try * 1000),
            "outlier_detection": OUTLIER,
            "slow_host": {"runtime": SLOW, "endpoint": slow_host, "delay_ms": FAULT_DELAY_S * 1000},
            "offered_rate_per_s": round(rate, 2),
            "max_new_tokens": MAX_NEW_TOKENS,
            "time_to_avoid_s": to_avoid,
            "slow_host_share_after": share_after,
            "tries_by_host_after": tries.counts(since=t_after),
            "ttft_p99_ms": {"baseline": base_p99, "after_avoidance": after_p99, "ratio": ratio},
            "caller_sidecar": _caller_stats(mesh),
            "sla": sla(traffic.outcomes),
            "goals": {
                "share_below_10pct_within_15s": to_avoid is not None and to_avoid <= AVOID_WITHIN_S,
                "ttft_p99_within_1_2x_baseline": ratio is not None and ratio <= TTFT_FACTOR,
            },
        }
        write_report(mesh.workdir, report)
        return report


def _calibrate(mesh: Any) -> float:
    """Seconds one call takes through the mesh, alone (the median of a few, after one that
    warms every host)."""
    from meshlm.demo.launcher import SERVICE
    from model_runtime.serving.client import generate

    def one() -> float:
        t0 = time.monotonic()
        chat = [{"role": "user", "content": "Say hello."}]
        list(generate(mesh.caller_target, messages=chat, max_new_tokens=MAX_NEW_TOKENS,
                      api_key="demo-acme-key", authority=SERVICE, timeout=60))  # fmt: skip
        return time.monotonic() - t0

    for _ in range(HOSTS):
        one()
    return sorted(one() for _ in range(CALIBRATION_CALLS))[CALIBRATION_CALLS // 2]


class _TryCounter:
    """Each host's tries (requests its inbound sidecar took), polled from the sidecars' Envoy
    stats every POLL_S: (time, {runtime: total so far})."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tries", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _read(self) -> dict[str, int]:
        out = {}
        for name, rt in self.mesh.runtimes.items():
            stats = self.mesh.envoy_stats(rt.admin_port, TRIES_STAT)
            out[name] = stats.get(TRIES_STAT, 0)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = (time.monotonic(), self._read())
            with self._lock:
                self.samples.append(sample)
            self._stop.wait(POLL_S)

    def avoided_at(self, host: str, since: float) -> float | None:
        """The first sample after `since` where `host` had under AVOID_SHARE of the last
        WINDOW_TRIES tries (or more, to the sample boundary)."""
        with self._lock:
            samples = list(self.samples)
        for i, (t, now) in enumerate(samples):
            if t < since:
                continue
            for _, then in reversed(samples[:i]):
                total = sum(now.values()) - sum(then.values())
                if total >= WINDOW_TRIES:
                    if (now[host] - then[host]) / total < AVOID_SHARE:
                        return t
                    break
        return None

    def counts(self, since: float) -> dict[str, int]:
        with self._lock:
            samples = list(self.samples)
        first = next((c for t, c in samples if t >= since), None)
        if first is None or not samples:
            return {}
        last = samples[-1][1]
        return {n: last[n] - first[n] for n in last}

    def share(self, host: str, since: float) -> float | None:
        c = self.counts(since)
        total = sum(c.values())
        return round(c[host] / total, 3) if total else None


def _caller_stats(mesh: Any) -> dict[str, int]:
    """The caller sidecar's per-try timeouts, retries and ejections for the service's cluster."""
    out = {}
    for stat in ("upstream_rq_per_try_timeout", "upstream_rq_retry",
                 "ejections_enforced_consecutive_gateway_failure"):  # fmt: skip
        stats = mesh.envoy_stats(mesh.caller_admin, stat)
        out[stat] = sum(
            v for k, v in stats.items() if k.startswith("cluster.") and k.endswith(stat)
        )
    return out
