"""The SLO loop: per service, every `slo.interval`, measure what callers saw,
and when the worst metric stays past its target by more than `slo.deviation` for
`slo.intervals` intervals in a row, take the next bounded action; when the SLO holds for
`slo.recover_intervals` intervals in a row, undo the last one.

Hysteresis, so it never flaps: an action needs N breached intervals in a row, an undo needs
`recover_intervals` (default 2N) intervals in a row within the SLO (deviation <= 0). An
interval in between (inside the deviation band) or without a verdict (too few calls, a source
down) breaks both runs: no data neither acts nor undoes (Flagger's trap). After each step both
counts restart.

Measurements come only from what the operator configured (xds_server/rollout/sources.py): the
caller sidecars' grpc_stats counters and the versions' runtime metrics URLs.

Actions, in `slo.actions` order: `shed` tightens the rate limits of the service's
lowest-priority tenants at the sidecars (the mesh-wide rate-limit service, xds_server/
ratelimit.py), only when a higher priority class also uses the service; `tighten_outlier`
halves the outlier detection thresholds (xds_server/resources/clusters.py `tightened`);
`scale_out` starts a replica through a `Scaler` and adds it by EDS (one per step, up to
`slo.max_replicas`). Every step is logged with its reason and kept in `status()`.

A replica takes a while to serve (a runtime loads its model: seconds to minutes), so a
scale-out starts it off the interval, in a thread of its own (as Kubernetes' HPA and Flagger
do): the loop keeps measuring and publishing every interval meanwhile. Stabilization: while a
start is in flight (`status()["pending"]`) the loop takes no action, neither the next step nor
an undo, and both hysteresis counts restart once it completes, as after every step: the next
decision is made on intervals measured with the new replica serving. The history gets the
`apply` when the start begins and a `ready` (added by EDS) or `failed` entry when it ends. A
failed start leaves nothing in force, so its step is taken back (the level drops by one): the
loop tries again after `slo.intervals` more breached intervals rather than counting a replica
that never served. `close()` and `undo_all()` wait for a start in flight (bounded by the
scaler's own timeout) and stop the replica it produced, so none is left running.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from xds_server import mesh as m
from xds_server.resources.names import outbound_cluster
from xds_server.rollout.gates.envoy_stats import EnvoyStatsSource, GrpcCounts, delta
from xds_server.rollout.gates.fetch import MeasurementError
from xds_server.rollout.gates.runtime_metrics import RuntimeMetricsSource
from xds_server.slo.scaler import START_TIMEOUT_S, Scaler, ScalerError

log = logging.getLogger("meshlm.slo")
PRIORITY_ORDER = ("high", "normal", "low")
HISTORY = 100


@dataclass(frozen=True)
class Reading:
    """One interval as callers saw it. None: not measured (a source down or not configured)."""

    requests: int | None = None
    success_rate: float | None = None
    ttft_p99: float | None = None  # seconds
    tpot_p99: float | None = None


def deviation(slo: m.Slo, r: Reading) -> tuple[float | None, str]:
    """The worst metric's relative distance past its target (0.2 = 20 % worse than the SLO,
    negative = within it) and what it is; None when this interval gives no verdict."""
    if r.requests is not None and r.requests < slo.min_requests:
        return None, f"too few calls ({r.requests} < min_requests {slo.min_requests})"
    parts: list[tuple[float, str]] = []
    for name, target, value in (
        ("TTFT p99", slo.ttft_p99, r.ttft_p99),
        ("TPOT p99", slo.tpot_p99, r.tpot_p99),
    ):
        if target is not None and value is not None:
            parts.append(
                (value / target - 1, f"{name} {value * 1e3:.0f}ms (SLO {target * 1e3:.0f}ms)")
            )
    if slo.success_rate is not None and r.success_rate is not None and r.requests:
        # Against the error budget: 99 % seen for a 99.5 % SLO spends it twice (+100 %).
        allowed = 100.0 - slo.success_rate
        parts.append(
            (
                (100.0 - r.success_rate) / allowed - 1,
                f"success {r.success_rate:.2f}% (SLO {slo.success_rate:g}%)",
            )
        )
    if not parts:
        return None, "no measurement for any objective"
    worst = max(parts)
    return worst[0], worst[1]


class Hysteresis:
    """The decision alone: +1 (take the next action), -1 (undo the last), 0 (hold)."""

    def __init__(self, slo: m.Slo, steps: int) -> None:
        self.slo, self.steps = slo, steps
        self.level = 0  # actions in force
        self.breached = self.met = 0

    def observe(self, dev: float | None) -> int:
        if dev is not None and dev > self.slo.deviation:
            self.breached, self.met = self.breached + 1, 0
        elif dev is not None and dev <= 0:
            self.breached, self.met = 0, self.met + 1
        else:  # inside the band, or no verdict: a run is broken either way
            self.breached = self.met = 0
        if self.breached >= self.slo.intervals and self.level < self.steps:
            self.level, self.breached = self.level + 1, 0
            return 1
        if self.met >= self.slo.recover_intervals and self.level > 0:
            self.level, self.met = self.level - 1, 0
            return -1
        return 0

    def restart(self) -> None:
        """Both runs start over: a step that completed later changed what is measured."""
        self.breached = self.met = 0

    def retract(self) -> None:
        """The last step did not take effect (a replica that never served)."""
        self.level = max(0, self.level - 1)
        self.restart()


def steps(slo: m.Slo) -> list[str]:
    """The actions in order, `scale_out` once per replica it may add."""
    out: list[str] = []
    for a in slo.actions:
        out += [a] * (slo.max_replicas if a == "scale_out" else 1)
    return out


def lowest_priority_tenants(mesh: m.Mesh, service: str) -> tuple[str, ...]:
    """Tenants allowed on `service` in its lowest priority class, when a higher class also
    uses it (shedding everyone would be an outage, not a protection)."""
    policy = mesh.tenants
    tenants = [t for t in getattr(policy, "tenants", ()) if policy.methods_for(t, service)]
    ranks = {t.name: PRIORITY_ORDER.index(t.priority) for t in tenants}
    if len(set(ranks.values())) < 2:
        return ()
    worst = max(ranks.values())
    return tuple(sorted(n for n, r in ranks.items() if r == worst))


class SloMemory(Protocol):
    """Where a loop's level, state and history outlive the process running it: the store, on
    replicas (xds_server/replica/leader.py StoreSlo), so the next leader continues the loop."""

    def load(self, service: str) -> dict[str, Any] | None: ...

    def save(self, service: str, doc: dict[str, Any]) -> None: ...


@dataclass
class _Start:
    """A scale-out in flight: the thread starting a replica of `version`, and its outcome."""

    version: str
    since: float
    reason: str
    thread: threading.Thread | None = None
    endpoint: str | None = None
    error: str | None = None
    cancelled: bool = False  # closed or undone meanwhile: stop the replica, do not add it

    def doc(self) -> dict[str, Any]:
        # cancelled: the loop is closing; the replica is stopped as soon as its start returns
        return {"action": "scale_out", "version": self.version, "since": self.since,
                "cancelled": self.cancelled}  # fmt: skip


class SloController:
    """One service's loop: `tick()` measures one interval, decides and acts. The control
    plane (`cp`) is what set_slo_state / add_endpoint / remove_endpoint are called on."""

    def __init__(
        self,
        cp: Any,  # xds_server.control_plane.ControlPlane
        service: str,
        *,
        scaler: Scaler | None = None,
        read: Callable[[], Reading] | None = None,
        clock: Callable[[], float] = time.time,
        memory: SloMemory | None = None,
    ) -> None:
        self.cp, self.service, self.scaler, self.clock = cp, service, scaler, clock
        self.memory = memory
        self.slo: m.Slo = cp.mesh.services[service].slo
        self.plan = steps(self.slo)
        self.decide = Hysteresis(self.slo, len(self.plan))
        self.state = m.SloState()
        self.replicas: list[tuple[str, str]] = []  # (version, endpoint) added by scale_out
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.last: dict[str, Any] = {}
        self._read = read or self._measure
        self._before: dict[str, dict[str, GrpcCounts]] = {}
        self._tick = threading.Lock()  # one interval (or a start's completion) at a time
        self._lock = threading.Lock()  # what status() reads: never held while acting
        self._pending: _Start | None = None  # set and cleared under both locks
        if memory is not None:
            self._adopt(memory.load(service))

    # -- memory ---------------------------------------------------------------------------------
    def _objectives(self) -> Any:
        return json.loads(json.dumps(asdict(self.slo)))  # tuples as JSON lists, as stored

    def _adopt(self, doc: dict[str, Any] | None) -> None:
        """The loop as the previous leader left it, when its objectives are these: without it
        a new leader's first interval took back every action in force (level 0, no state)."""
        if not doc or doc.get("slo") != self._objectives():
            return
        self.decide.level = max(0, min(int(doc.get("level", 0)), len(self.plan)))
        st = doc.get("state") or {}
        self.state = m.SloState(tuple(st.get("shed_tenants", ())),
                                bool(st.get("outlier_tightened", False)))  # fmt: skip
        self.replicas = [(str(v), str(e)) for v, e in doc.get("replicas", [])]
        self.history.extend(doc.get("history", []))
        in_force = ", ".join(self.plan[: self.decide.level]) or "nothing"
        log.warning("slo %s: continuing at level %d (%s in force)", self.service,
                    self.decide.level, in_force)  # fmt: skip

    def _remember(self) -> None:
        if self.memory is None:
            return
        self.memory.save(self.service, {
            "slo": self._objectives(), "level": self.decide.level, "state": asdict(self.state),
            "replicas": self.replicas, "history": list(self.history)[-20:],
        })  # fmt: skip

    # -- measuring ------------------------------------------------------------------------------
    def _measure(self) -> Reading:
        svc = self.cp.mesh.services[self.service]
        from xds_server.rollout import sources as discovery

        counts: GrpcCounts | None = GrpcCounts()
        try:
            for v in svc.versions:
                src = EnvoyStatsSource(
                    functools.partial(discovery.caller_admin_urls, self.cp),
                    outbound_cluster(self.service, v),
                )
                now = src.read()
                if v not in self._before:  # the first read is the baseline, not an interval
                    counts = None
                elif counts is not None:
                    counts = counts + delta(self._before[v], now)
                self._before[v] = now
        except MeasurementError as e:
            log.info("slo %s: gRPC counts unavailable: %s", self.service, e)
            counts = None
        urls = [u for ver in svc.versions.values() for u in ver.metrics_urls]
        # The replicas this loop added are measured too, or scaling out could never show.
        urls += [u for _, e in self.replicas if (u := self._replica_metrics(e)) is not None]
        ttft = tpot = None
        if urls:
            try:
                lat = RuntimeMetricsSource(urls).read()
                ttft, tpot = lat.ttft_p99, lat.tpot_p99
            except MeasurementError as e:
                log.info("slo %s: runtime metrics unavailable: %s", self.service, e)
        return Reading(
            requests=None if counts is None else counts.total,
            success_rate=None if counts is None else counts.success_rate,
            ttft_p99=ttft,
            tpot_p99=tpot,
        )

    # -- one interval ---------------------------------------------------------------------------
    def tick(self) -> dict[str, Any]:
        with self._tick:
            reading = self._read()
            dev, what = deviation(self.slo, reading)
            pending = self._pending
            # Stabilization: no decision while a replica starts (see the module docstring).
            step = 0 if pending is not None else self.decide.observe(dev)
            last = {
                "time": self.clock(),
                "reading": asdict(reading),
                "deviation": None if dev is None else round(dev, 4),
                "worst": what,
                "breached_intervals": self.decide.breached,
                "met_intervals": self.decide.met,
                "held": None if pending is None else f"a replica of {pending.version} is starting",
            }
            with self._lock:
                self.last = last
            if step > 0:
                action, why = self.plan[self.decide.level - 1], self._why("apply", what, dev)
                self._log(action, "apply", self._apply(action, why), why)
            elif step < 0:
                action = self.plan[self.decide.level]
                self._log(action, "undo", self._undo(action), self._why("undo", what, dev))
            if step:
                self._remember()
            self._reassert()
            return last

    def _why(self, direction: str, what: str, dev: float | None) -> str:
        if direction == "apply":
            return (f"{what}: {dev:+.0%} for {self.slo.intervals} intervals (threshold "
                    f"{self.slo.deviation:+.0%})")  # fmt: skip
        return f"SLO held for {self.slo.recover_intervals} intervals ({what})"

    def _log(self, action: str, direction: str, done: str, why: str) -> None:
        entry = {"time": self.clock(), "action": action, "direction": direction,
                 "level": self.decide.level, "reason": why, "done": done}  # fmt: skip
        with self._lock:
            self.history.append(entry)
        log.warning("slo %s: %s %s: %s; %s", self.service, direction, action, done, why)

    def _apply(self, action: str, why: str) -> str:
        if action == "shed":
            tenants = lowest_priority_tenants(self.cp.mesh, self.service)
            self.state = m.SloState(tenants, self.state.outlier_tightened)
            if not tenants:
                return "no lower-priority tenant to shed (one priority class uses the service)"
            return f"rate limits of {', '.join(tenants)} cut to a quarter"
        if action == "tighten_outlier":
            self.state = m.SloState(self.state.shed_tenants, True)
            return "outlier detection tightened"
        return self._scale_out(why)

    def _undo(self, action: str) -> str:
        if action == "shed":
            self.state = m.SloState((), self.state.outlier_tightened)
            return "rate limits restored"
        if action == "tighten_outlier":
            self.state = m.SloState(self.state.shed_tenants, False)
            return "outlier detection restored"
        return self._scale_in()

    def _scale_out(self, why: str) -> str:
        """Starts a replica off the interval (the tick lock is not held while it loads)."""
        if self.scaler is None:
            return "no scaler configured (meshlm xds-server --scaler)"
        version = _main_version(self.cp.mesh.services[self.service])
        start = _Start(version, self.clock(), why)
        start.thread = threading.Thread(
            target=self._start_replica, args=(start, self.scaler),
            name=f"slo-{self.service}-scale-out", daemon=True,
        )  # fmt: skip
        with self._lock:
            self._pending = start
        start.thread.start()
        return f"starting a replica of {version}"

    def _start_replica(self, start: _Start, scaler: Scaler) -> None:
        try:
            start.endpoint = scaler.scale_out(self.service, start.version)
        except ScalerError as e:
            start.error = str(e)
        except Exception as e:  # a scaler's bug must not leave the loop held for ever
            log.exception("slo %s: scale-out raised", self.service)
            start.error = f"{type(e).__name__}: {e}"
        with self._tick:
            try:
                self._started(start)
            finally:
                with self._lock:
                    self._pending = None

    def _started(self, start: _Start) -> None:
        """The scaler returned: add the replica by EDS, or record why there is none."""
        took = f"{self.clock() - start.since:.1f}s after the apply for {start.reason}"
        if start.cancelled:
            self._log("scale_out", "stopped", self._discard(start), took)
            return
        if start.endpoint is None:
            self.decide.retract()
            self._log("scale_out", "failed", f"scale-out failed: {start.error}; not in force",
                      took)  # fmt: skip
        else:
            self.decide.restart()
            self._log("scale_out", "ready",
                      f"replica {start.endpoint} added to {start.version}", took)  # fmt: skip
            self.replicas.append((start.version, start.endpoint))
            self.cp.add_endpoint(self.service, start.version, start.endpoint)
        self._remember()

    def _discard(self, start: _Start) -> str:
        """A start that returned after close() or undo_all(): its replica is not kept."""
        if start.endpoint is None:
            return f"scale-out failed: {start.error} (the loop was closed meanwhile)"
        failed = self._stop_replica(start.version, start.endpoint)
        closed = f"replica {start.endpoint} started after the loop was closed"
        return f"{closed}; stopping it failed: {failed}" if failed else f"{closed}: stopped"

    def _join_start(self) -> None:
        """Waits for a start in flight, marked cancelled first: it stops its replica itself."""
        with self._tick, self._lock:
            start = self._pending
            if start is not None:
                start.cancelled = True
        if start is None or start.thread is None:
            return
        # The scaler's own start timeout, and time for it to stop a replica that missed it.
        limit = getattr(self.scaler, "timeout", START_TIMEOUT_S) + 30.0
        start.thread.join(limit)
        if start.thread.is_alive():
            log.error("slo %s: a replica of %s still starting after %.0fs: it is stopped "
                      "when its start returns", self.service, start.version, limit)  # fmt: skip

    def _replica_metrics(self, endpoint: str) -> str | None:
        metrics_url = getattr(self.scaler, "metrics_url", None)
        return metrics_url(endpoint) if metrics_url is not None else None

    def _scale_in(self) -> str:
        if not self.replicas:
            return "no replica of ours to remove"
        version, endpoint = self.replicas.pop()
        svc = self.cp.mesh.services[self.service]
        if version in svc.versions and any(
            str(e) == endpoint for e in svc.versions[version].endpoints
        ):
            # Out of EDS first: no new call reaches the replica while it stops.
            self.cp.remove_endpoint(self.service, version, endpoint)
        failed = self._stop_replica(version, endpoint)
        if failed:
            return f"replica {endpoint} removed from {version}; stopping it failed: {failed}"
        return f"replica {endpoint} removed from {version}"

    def _stop_replica(self, version: str, endpoint: str) -> str | None:
        """Why stopping it failed, or None."""
        try:
            self.scaler.scale_in(self.service, version, endpoint)  # type: ignore[union-attr]
        except ScalerError as e:
            log.warning("slo %s: stopping replica %s failed: %s", self.service, endpoint, e)
            return str(e)
        return None

    def _reassert(self) -> None:
        """A `meshlm apply` replaces the mesh: what is in force is put back at once."""
        mesh = self.cp.mesh
        if self.service not in mesh.services:
            return
        svc = mesh.services[self.service]
        if svc.slo_state != self.state:
            self.cp.set_slo_state(self.service, self.state)
        for version, endpoint in self.replicas:
            ver = svc.versions.get(version)
            if ver is not None and not any(str(e) == endpoint for e in ver.endpoints):
                self.cp.add_endpoint(self.service, version, endpoint)

    # -- running ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.slo.interval):
            try:
                self.tick()
            except Exception:  # one bad interval must not end the loop
                log.exception("slo %s: interval failed", self.service)

    def close(self) -> None:
        """Stop the replicas this loop started (the control plane is going away)."""
        self._join_start()
        with self._tick:
            while self.replicas:
                self._scale_in()

    def undo_all(self) -> None:
        """Its slo block was removed or changed: take back every action in force."""
        self._join_start()
        with self._tick:
            while self.replicas:
                self._scale_in()
            self.state = m.SloState()
            self.decide.level = 0
            if self.service in self.cp.mesh.services:
                self.cp.set_slo_state(self.service, self.state)
            self._remember()

    def status(self) -> dict[str, Any]:
        with self._lock:
            pending = self._pending
            return {
                "service": self.service,
                "slo": asdict(self.slo),
                "level": self.decide.level,
                "in_force": self.plan[: self.decide.level],
                "state": asdict(self.state),
                "replicas": [e for _, e in self.replicas],
                # a scale-out in flight: no action is taken until it completes
                "pending": None if pending is None else pending.doc(),
                "last": self.last,
                "history": list(self.history),
            }


def _main_version(svc: m.Service) -> str:
    """The version carrying most of the traffic (the first on a tie)."""
    return max(svc.route.weights, key=lambda v: svc.route.weights[v])


class SloLoops:
    """Every service's loop in its own thread, and the admin API's `GET /slo[/service]`. The
    slo blocks are read from the live mesh every `poll` seconds, so a later `meshlm apply`
    counts: a new block gets a loop, a removed one's actions are undone and its loop ends, a
    changed one starts over (its actions undone) with the new objectives."""

    def __init__(
        self,
        cp: Any,
        scaler: Scaler | None = None,
        *,
        poll: float = 1.0,
        memory: SloMemory | None = None,
    ) -> None:
        """`memory`: each loop's state kept beyond this object (the store, on replicas)."""
        self.cp, self.scaler, self.poll, self.memory = cp, scaler, poll, memory
        self.loops: dict[str, SloController] = {}
        self._stops: dict[str, threading.Event] = {}
        self._stop = threading.Event()
        self._started = False
        self._sync = threading.Lock()
        self.sync()

    def sync(self) -> None:
        with self._sync:
            if self._stop.is_set():
                return
            services = self.cp.mesh.services
            want = {n: s.slo for n, s in services.items() if s.slo is not None}
            for name, loop in list(self.loops.items()):
                if want.get(name) == loop.slo:
                    continue
                self._stops.pop(name).set()
                del self.loops[name]
                log.warning("slo %s: slo block %s", name, "changed" if name in want else "removed")
                loop.undo_all()
            for name in want.keys() - self.loops.keys():
                self.loops[name] = SloController(
                    self.cp, name, scaler=self.scaler, memory=self.memory
                )
                self._stops[name] = threading.Event()
                if self._started:
                    self._run(name)

    def _run(self, name: str) -> None:
        threading.Thread(
            target=self.loops[name].run, args=(self._stops[name],), name=f"slo-{name}",
            daemon=True,
        ).start()  # fmt: skip

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.sync()
            except Exception:
                log.exception("slo: reading the slo blocks failed")

    def start(self) -> SloLoops:
        with self._sync:
            self._started = True
            for name in self.loops:
                self._run(name)
        threading.Thread(target=self._watch, name="slo-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        with self._sync:
            self._stop.set()
            for ev in self._stops.values():
                ev.set()
        for loop in list(self.loops.values()):
            loop.close()

    def handle(self, method: str, target: str, body: bytes = b"") -> tuple[int, Any]:
        parts = [p for p in target.split("?", 1)[0].split("/") if p][1:]
        if method != "GET" or len(parts) > 1:
            return 404, {"error": f"no such endpoint: {method} {target}"}
        loops = dict(self.loops)
        if not parts:
            return 200, {n: loop.status() for n, loop in loops.items()}
        if parts[0] not in loops:
            return 404, {"error": f"services.{parts[0]}: no slo block (known: {', '.join(loops)})"}
        return 200, loops[parts[0]].status()
