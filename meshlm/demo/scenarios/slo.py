"""`meshlm demo --scenario slo`: the SLO loop (xds_server/slo/loop.py) restores a breached TTFT SLO
after a load step, then undoes what it did once the step is over, without flapping.

One int4 replica behind its sidecar; a high-priority tenant (gold) and a low-priority one (free)
at a base load. The TTFT p99 SLO is set from the base load's own TTFT p99 on this machine
(BASE_FACTOR times the median of three intervals' p99, at least BASE_FLOOR_MS) and applied
with `meshlm apply`'s API after the mesh is up: the loop picks up a block applied later. Free
asks for stories as long as make its step STEP_LOAD times the replica's decode capacity, which
`decode_capacity` measures first (CPUs differ several-fold). Then free floods (inside its rate
limit) for STEP_INTERVALS intervals: the runtime-wide TTFT p99 breaches the SLO; after `intervals`
breached intervals the loop sheds free at the sidecars (a quarter of its rate), then scales
out (`--scaler local`: another `meshlm serve` and its sidecar, added by EDS once it serves) if
that was not enough. The replica starts off the loop's interval: every interval is still
measured while it loads (the timeline has no gap), and the loop acts again only once it serves.
The step ends; after `recover_intervals` met intervals each action is undone, the last first.

Interval lengths: the runtime's `--metrics-window` equals the loop's interval, so each interval
reads the calls of that interval only. STEP_INTERVALS <= INTERVALS + RECOVER_INTERVALS: the
earliest undo (the step breaching at once, restored at once) falls at the step's end, never
inside it, so the loop cannot undo while the flood lasts and shed again (flap). The first
intervals of the step fill the runtime's queue before TTFT breaches: the step is long enough
for that, two breached intervals and GOAL_INTERVALS to restore, all before it ends.

The report: the timeline (each interval: TTFT p99, deviation, action), `intervals_to_restore`
(from the first breached interval of the step to the first met one; goal <= 3), the loop's
actions with their reasons, whether it flapped, and the `sla` object of the gold tenant during
the step. `measure()` for `python -m bench sla`: the same step with the loop only watching
(`intervals` beyond the run: it never acts) vs acting.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report
from meshlm.demo.scenarios.capacity import STORY_PROMPTS, decode_capacity, flood_tokens

BENCH_TITLE = "SLO loop: a low-priority tenant's load step against a TTFT p99 SLO"
GOAL_INTERVALS = 3
INTERVAL_S = 5.0
INTERVALS, RECOVER_INTERVALS = 2, 6
STEP_INTERVALS = 8
WATCH_INTERVALS = 2  # after the undo: no action may follow
BASE_FACTOR, BASE_FLOOR_MS = 4.0, 400.0
MAX_BATCH = MAX_QUEUE = 4
SERVE_ARGS = ["--precision", "int4", "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
              "--metrics-window", f"{INTERVAL_S:g}"]  # fmt: skip
KEYS = {"gold": "demo-gold-key-slo", "free": "demo-free-key-slo"}
GOLD_RATE, GOLD_TOKENS = 1.0, 4
# Free asks for stories (answers run to max_new_tokens), as many tokens each as make the step
# offer STEP_LOAD times what the replica's 4 slots decode on this machine, measured before the
# traffic starts: a fixed length overloaded one CPU's replica at the base load and left
# another's unloaded by the step (the same 2 cores decode int4 3x faster with AVX-512 kernels).
# Shed, free keeps a quarter of its limit (0.75/s): about half the capacity, so shedding
# restores the SLO, and the base load (0.5/s) uses a third of it.
FREE_BASE_RATE, FREE_STEP_RATE, STEP_LOAD = 0.5, 3.0, 2.0
FREE_TOKENS_RANGE = (16, 256)
RATE_LIMITS = {
    "gold": {"max_tokens": 10, "tokens_per_fill": 5, "fill_interval": "1s"},
    # the flood stays inside it: only the loop's shed (a quarter) refuses free's calls
    "free": {"max_tokens": 6, "tokens_per_fill": 6, "fill_interval": "2s"},
}


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "slo: a load step breaches a TTFT SLO; the SLO loop restores it",
        lambda: scenario(workdir=args.workdir, act=True, say=say),
        hide=("timeline",),
    )
    if report is None:
        return 1
    for row in report["timeline"]:
        print(f"  {row['t_s']:6.1f}s {row['phase']:5} TTFT p99 {row['ttft_p99_ms']} ms "
              f"dev {row['deviation']} {row['action'] or ''}")  # fmt: skip
    n, bound = report["intervals_to_restore"], INTERVALS + drain_intervals()
    print(f"intervals to restore: {n} (goal <= {GOAL_INTERVALS}; with the drain of the calls "
          f"queued before the shed <= {bound}); undone after the step: "
          f"{report['undone_after_step']}; flapped: {report['flapped']}")  # fmt: skip
    good = n is not None and n <= bound and report["undone_after_step"]
    return 0 if good and not report["flapped"] else 1


def drain_intervals() -> int:
    """Intervals that stay breached after the one whose end decided the shed, from the
    scenario's parameters: no action reaches calls a replica already holds. A free call answers
    in MAX_BATCH * STEP_LOAD / FREE_STEP_RATE s (2.7 s: its length makes the step ask STEP_LOAD
    times what MAX_BATCH slots decode, at most). The calls queued before the shed (MAX_QUEUE
    behind MAX_BATCH running) have their first token within ceil(MAX_QUEUE / MAX_BATCH)
    answers, and a call's TTFT enters the runtime's window when it ends, one answer later:
    5.3 s, 2 intervals of 5 s (the shed's push to the sidecars fits in what is left of the
    second). The SLO loop's goal (GOAL_INTERVALS) holds where the shed lands before the queue
    fills; where it does not, the loop restores within this bound (and may scale out meanwhile).
    """
    answer_s = MAX_BATCH * STEP_LOAD / FREE_STEP_RATE
    answers = math.ceil(MAX_QUEUE / MAX_BATCH) + 1
    return math.ceil(answers * answer_s / INTERVAL_S)


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    r = scenario(workdir=None, act=mechanism, say=lambda m: None)
    keys = ("sla", "gold_step_ttft_ms", "intervals_to_restore", "slo_ttft_p99_ms")
    step = [row for row in r["timeline"] if row["phase"] == "step"]
    band = r["slo"]["deviation_fraction"]
    return {k: r[k] for k in keys} | {
        "step_intervals_breached": sum((row["deviation"] or 0) > band for row in step),
        "step_intervals": len(step),
        "actions": ", ".join(f"{a['direction']} {a['action']}" for a in r["actions"]) or "none",
    }


def scenario(workdir: Path | None, act: bool, say: Any) -> dict[str, Any]:
    """One run; `act=False` leaves the loop watching only (it never reaches `intervals`)."""
    from meshlm.demo.sla import latency, sla

    mesh = _local_mesh(workdir)
    say(f"logs and report in {mesh.workdir}")
    watch = Watch(mesh)
    with running(mesh, say) as stops:
        stops.callback(watch.stop)
        rt = next(iter(mesh.runtimes.values()))
        capacity = decode_capacity(f"127.0.0.1:{rt.port}", slots=MAX_BATCH)
        free_tokens = flood_tokens(capacity, FREE_STEP_RATE, STEP_LOAD, FREE_TOKENS_RANGE)
        say(f"the replica decodes {capacity:.0f} tokens/s in 4 slots: free asks {free_tokens}")
        gold = _traffic(mesh, "gold", GOLD_RATE, GOLD_TOKENS)
        free = _traffic(mesh, "free", FREE_BASE_RATE, free_tokens)
        stops.callback(gold.stop)
        stops.callback(free.stop)
        time.sleep(INTERVAL_S)  # warm-up
        # The base load's TTFT p99 on this machine: the median of three windows' (one slow
        # moment on a shared machine must not set the SLO).
        readings = []
        for _ in range(3):
            time.sleep(INTERVAL_S)
            readings.append(_runtime_ttft_p99(mesh))
        base_p99 = sorted(readings)[1]
        slo_ms = round(max(BASE_FACTOR * base_p99, BASE_FLOOR_MS))
        block = _slo_block(slo_ms, act)
        doc = json.loads(json.dumps(mesh.mesh))
        doc["services"]["llm"]["slo"] = block
        mesh.admin("POST", "/v1/mesh?timeout=10", doc)
        say(f"base TTFT p99 {base_p99:.0f} ms: SLO TTFT p99 {slo_ms} ms applied")
        watch.start()
        time.sleep(2 * INTERVAL_S)
        t_step = time.monotonic()
        flood = _traffic(mesh, "free", FREE_STEP_RATE, free_tokens)
        stops.callback(flood.stop)
        say(f"load step: free floods at {FREE_STEP_RATE:g}/s for {STEP_INTERVALS} intervals")
        time.sleep(STEP_INTERVALS * INTERVAL_S)
        flood.stop()
        t_end = time.monotonic()
        say("load step over")
        # each action in force is undone after RECOVER_INTERVALS met intervals, the last first
        applied = sum(h["direction"] == "apply" for h in watch.history)
        deadline = t_end + (applied * RECOVER_INTERVALS + 2) * INTERVAL_S
        while watch.history and not watch.all_undone() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(WATCH_INTERVALS * INTERVAL_S)
        watch.stop()
        for t in (gold, free):
            t.stop()
        status = mesh.admin("GET", "/slo/llm")
    timeline = watch.timeline(t_step, t_end, status["history"])
    step = [row for row in timeline if row["phase"] == "step"]
    gold_step = [o for o in gold.outcomes if t_step <= o.at < t_end]
    history = status["history"]
    first_undo = next((i for i, h in enumerate(history) if h["direction"] == "undo"), None)
    report = {
        "scenario": "slo",
        "workdir": str(mesh.workdir),
        "loop_acts": act,
        "capacity_tokens_per_s": round(capacity, 1),
        "traffic": _traffic_doc(free_tokens),
        "base_ttft_p99_ms": round(base_p99, 1),
        "slo_ttft_p99_ms": slo_ms,
        "slo": block | {"deviation_fraction": status["slo"]["deviation"]},
        "intervals_to_restore": intervals_to_restore(step, status["slo"]["deviation"]),
        "step_ttft_p99_ms": max((r["ttft_p99_ms"] or 0 for r in step), default=None),
        "goal_intervals": GOAL_INTERVALS,
        "bound_intervals": INTERVALS + drain_intervals(),
        "actions": [
            {k: h[k] for k in ("action", "direction", "reason", "done")}
            | {"t_s": round(h["time"] - watch.t0_wall - (t_step - watch.t0), 1)}
            for h in history
        ],
        "undone_after_step": bool(history) and status["level"] == 0 and first_undo is not None,
        "flapped": first_undo is not None
        and any(h["direction"] == "apply" for h in history[first_undo:]),
        "gold_step_ttft_ms": latency(
            o.ttft_ms for o in gold_step if o.status == "OK" and o.ttft_ms is not None
        ),
        "sla": sla(gold_step),
        "gold_step_by_status": _by_status(gold_step),
        "timeline": timeline,
    }
    write_report(mesh.workdir, report)
    return report


def intervals_to_restore(step: list[dict[str, Any]], band: float) -> int | None:
    """Intervals from the step's first breached interval (past the deviation band) to its first
    met one (deviation <= 0) after it; None when the SLO was not breached, or not restored."""
    first = next((i for i, r in enumerate(step) if (r["deviation"] or 0) > band), None)
    if first is None:
        return None
    met = next(
        (
            i
            for i, r in enumerate(step[first:])
            if r["deviation"] is not None and r["deviation"] <= 0
        ),
        None,
    )
    return met


class Watch:
    """Polls the loop's `GET /slo/llm` and keeps every interval it evaluated."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.intervals: dict[float, dict[str, Any]] = {}
        self.history: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0, self.t0_wall = time.monotonic(), time.time()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, name="slo-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            try:
                doc = self.mesh.admin("GET", "/slo/llm", timeout=5)
            except (OSError, RuntimeError):  # RuntimeError: a 404 until the loop reads the block
                continue
            last = doc.get("last") or {}
            if "time" in last:
                self.intervals[last["time"]] = last
            self.history = doc["history"]

    def all_undone(self) -> bool:
        return bool(self.history) and self.history[-1]["level"] == 0

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def timeline(
        self, t_step: float, t_end: float, history: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Each interval: seconds since the step began (its end), phase, TTFT p99, deviation
        and the action taken at its end."""
        step_wall = self.t0_wall + (t_step - self.t0)
        end_wall = self.t0_wall + (t_end - self.t0)
        times = sorted(self.intervals)
        # Each entry at the end of the interval it followed: an apply or undo at the interval
        # that decided it, a scale-out's `ready` at the last interval before its replica served.
        done_at: dict[float, list[str]] = {}
        for h in history:
            at = max((t for t in times if t <= h["time"]), default=None)
            if at is not None:
                done_at.setdefault(at, []).append(f"{h['direction']} {h['action']}")
        rows = []
        for at in times:
            last = self.intervals[at]
            ttft = last["reading"]["ttft_p99"]
            done = done_at.get(at, [])
            phase = "base" if at < step_wall else "step" if at <= end_wall else "after"
            rows.append({
                "t_s": round(at - step_wall, 1),
                "phase": phase,
                "ttft_p99_ms": None if ttft is None else round(ttft * 1e3, 1),
                "deviation": last["deviation"],
                "worst": last["worst"],
                "action": ", ".join(done) or None,
            })  # fmt: skip
        return rows


def _traffic_doc(free_tokens: int) -> dict[str, Any]:
    return {
        "gold": {"rate_per_s": GOLD_RATE, "max_new_tokens": GOLD_TOKENS, "priority": "high"},
        "free": {"base_rate_per_s": FREE_BASE_RATE, "step_rate_per_s": FREE_STEP_RATE,
                 "max_new_tokens": free_tokens, "step_load": STEP_LOAD, "priority": "low"},
        "rate_limits": RATE_LIMITS,
        "serve_args": SERVE_ARGS,
        "step_s": STEP_INTERVALS * INTERVAL_S,
    }  # fmt: skip


def _by_status(calls: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in calls:
        out[o.status] = out.get(o.status, 0) + 1
    return out


def _slo_block(slo_ms: int, act: bool) -> dict[str, Any]:
    return {
        "ttft_p99": f"{slo_ms}ms",
        "interval": f"{INTERVAL_S:g}s",
        "deviation": "15%",
        # Watching only: the run ends long before 100 breached intervals.
        "intervals": INTERVALS if act else 100,
        "recover_intervals": RECOVER_INTERVALS if act else 100,
        "actions": ["shed", "scale_out"],
        "max_replicas": 1,
        "min_requests": 3,
    }


def _runtime_ttft_p99(mesh: Any) -> float:
    """The replica's own TTFT p99 over its metrics window (what the loop reads), in ms."""
    import urllib.request

    rt = next(iter(mesh.runtimes.values()))
    with urllib.request.urlopen(f"http://127.0.0.1:{rt.metrics_port}/metrics.json", timeout=5) as r:
        p99 = json.loads(r.read()).get("ttft_ms", {}).get("p99")
    if p99 is None:
        raise RuntimeError("the base load produced no TTFT at the runtime")
    return float(p99)


def _local_mesh(workdir: Path | None) -> Any:
    from meshlm.demo.launcher import SERVICE, LocalMesh, scenario_mesh
    from wasm_filters.policy import hash_key

    mesh = scenario_mesh({"v1": 100})
    mesh["tenants"] = {
        name: {
            "key_sha256": hash_key(key),
            "allow": [f"{SERVICE}/Generate"],
            "rate_limit": RATE_LIMITS[name],
            "priority": "high" if name == "gold" else "low",
        }
        for name, key in KEYS.items()
    }
    return LocalMesh(mesh, workdir=workdir, faults={"v1": SERVE_ARGS[2:]},
                     scaler_serve_args=SERVE_ARGS)  # fmt: skip


def _traffic(mesh: Any, tenant: str, rate: float, tokens: int) -> Any:
    from meshlm.demo.launcher import SERVICE
    from meshlm.demo.traffic import PROMPTS, TenantLoad, Traffic

    prompts = STORY_PROMPTS if tenant == "free" else PROMPTS
    load = TenantLoad(tenant, KEYS[tenant], rate=rate, prompts=prompts)
    return Traffic(
        mesh.caller_target, [load], authority=SERVICE, max_new_tokens=tokens, resume=False
    ).start()
