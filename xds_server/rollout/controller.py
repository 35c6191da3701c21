"""The canary rollout controller: moves route weights step by step, gated on measured SLOs.

One rollout per service: Pending -> Progressing (one analysis interval per step) -> Promoting ->
Succeeded, or -> RolledBack after `threshold` consecutive failed intervals (or an abort), or ->
Paused (operator, or a step whose weights some sidecar did not ACK in time). Failed: a rollback
that itself could not be applied. Every transition is kept with its time and reason.

Each weight change goes through `ControlPlane.set_weights`, which returns once every affected
sidecar ACKed (or names those that did not): an interval only starts on routes the whole mesh
has (Argo Rollouts' most-reported bug is 503s from acting before sidecars have the new routes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mesh_common.headers import CANARY_HEADER
from xds_server.mesh import Mirror
from xds_server.mesh.rollout_spec import RolloutSpec, RolloutSpecError, parse_rollout
from xds_server.rollout.gates.direct import NOT_ENOUGH_TRAFFIC, evaluate, traffic_hint
from xds_server.rollout.gates.envoy_stats import GrpcCounts, delta
from xds_server.rollout.gates.fetch import MeasurementError
from xds_server.rollout.gates.prometheus import PrometheusSource, evaluate_metrics, metrics_problem
from xds_server.rollout.gates.runtime_metrics import LatencySnapshot
from xds_server.rollout.gates.sources import Sources
from xds_server.rollout.liveness import not_live_reason
from xds_server.rollout.quality import with_quality
from xds_server.rollout.verdict import FAIL, HALT, PASS, Verdict
from xds_server.store.state_file import RolloutStore

log = logging.getLogger(__name__)

PENDING, PROGRESSING, PAUSED, PROMOTING = "Pending", "Progressing", "Paused", "Promoting"
SUCCEEDED, ROLLED_BACK, FAILED = "Succeeded", "RolledBack", "Failed"
TERMINAL = frozenset({SUCCEEDED, ROLLED_BACK, FAILED})
MAX_ANALYSES = 50  # analysis records kept per rollout (the history of transitions is kept whole)


class RolloutError(RuntimeError):
    """An operation that does not fit the rollout's state (HTTP 409) or names no rollout (404)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class ControlPlane(Protocol):
    def set_weights(self, service: str, weights: dict[str, int], *, timeout: float) -> Any:
        """Returns an ApplyResult once every affected sidecar ACKed, or after `timeout`."""
        ...


def ack_outcome(result: Any) -> tuple[bool, list[str]]:
    """(every sidecar ACKed, those that did not) from `xds_server.control_plane.ApplyResult`
    (`ok`, `missing`, `errors`: node -> NACK error)."""
    errors = getattr(result, "errors", None) or {}
    missing = [f"{n} (NACK: {errors[n]})" if n in errors else n for n in result.missing]
    return bool(result.ok), sorted(missing)


@dataclass
class Rollout:
    """The persisted record of one rollout (JSON-able through to_dict/from_dict)."""

    spec: RolloutSpec
    state: str = PENDING
    step: int = -1  # index into spec.steps of the weight applied now; -1 before the first
    canary_weight: int = 0
    stable: str = ""  # the version that is stable now (the canary once Succeeded)
    failures: int = 0  # consecutive failed intervals at this step
    message: str = ""
    lagging: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    analyses: list[dict[str, Any]] = field(default_factory=list)
    traffic: list[dict[str, Any]] = field(default_factory=list)  # canary calls seen per step
    paused_from: str = ""  # the state a Paused rollout resumes into

    def __post_init__(self) -> None:
        self.stable = self.stable or self.spec.stable

    def weights(self) -> dict[str, int]:
        s = self.spec
        if self.stable == s.canary:
            return {s.stable: 0, s.canary: 100}
        return {s.stable: 100 - self.canary_weight, s.canary: self.canary_weight}

    def to_dict(self) -> dict[str, Any]:
        return {
            "service": self.spec.service,
            "spec": self.spec.to_dict(),
            "state": self.state,
            "step": self.step,
            "canary_weight": self.canary_weight,
            "weights": self.weights(),
            "stable": self.stable,
            "failures": self.failures,
            "message": self.message,
            "lagging": list(self.lagging),
            "history": list(self.history),
            "analyses": list(self.analyses),
            "traffic": list(self.traffic),
            "paused_from": self.paused_from,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        spec = parse_rollout(d["service"], {k: v for k, v in d["spec"].items() if k != "service"})
        return cls(
            spec=spec,
            state=d["state"],
            step=int(d["step"]),
            canary_weight=int(d["canary_weight"]),
            stable=d.get("stable", spec.stable),
            failures=int(d.get("failures", 0)),
            message=d.get("message", ""),
            lagging=list(d.get("lagging", [])),
            history=list(d.get("history", [])),
            analyses=list(d.get("analyses", [])),
            traffic=list(d.get("traffic", [])),
            paused_from=d.get("paused_from", ""),
        )


@dataclass
class _Interval:
    """In memory only: after a restart a fresh interval starts (Envoy counters move on)."""

    started: float  # monotonic
    baseline: dict[str, GrpcCounts] | None
    stable_baseline: dict[str, GrpcCounts] | None = None
    latency_baseline: LatencySnapshot | None = None  # the canary's histograms at the start


SourcesFactory = Callable[[RolloutSpec], Sources]


class RolloutController:
    """Runs every rollout of one control plane. `autorun=False` leaves ticking to the caller
    (`tick()`), which tests use to step intervals deterministically."""

    def __init__(
        self,
        control_plane: ControlPlane,
        store_path: str | RolloutStore,
        sources_factory: SourcesFactory,
        *,
        autorun: bool = True,
        poll_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cp = control_plane
        # A path (one control plane), or any load()/save() store: replicas keep it in the
        # state store, fenced (xds_server/replica/leader.py StoreRollouts).
        self.store = store_path if hasattr(store_path, "save") else RolloutStore(store_path)
        self.sources_factory = sources_factory
        self.clock = clock
        self.poll_s = poll_s
        self._lock = threading.RLock()  # guards _rollouts and every transition
        self._rollouts: dict[str, Rollout] = {}
        self._sources: dict[str, Sources] = {}
        self._intervals: dict[str, _Interval] = {}
        self._measuring: set[str] = set()  # services whose interval is being measured
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for service, rec in self.store.load().items():
            self._rollouts[service] = Rollout.from_dict(rec)
        self._recover()
        if autorun:
            self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
            self._thread.start()

    # -- public API ---------------------------------------------------------------------------
    def start(self, spec: RolloutSpec | dict[str, Any]) -> dict[str, Any]:
        """Begin a rollout; returns once the first step is ACKed (or the rollout paused)."""
        if isinstance(spec, dict):
            d = dict(spec)
            spec = parse_rollout(d.pop("service", ""), d)
        with self._lock:
            old = self._rollouts.get(spec.service)
            if old is not None and old.state not in TERMINAL:
                raise RolloutError(f"{spec.service}: a rollout is already {old.state}")
            if old is not None and old.stable == spec.canary and self._serves_all(spec):
                raise RolloutError(f"{spec.service}: {spec.canary} is already stable")
            src = self.sources_factory(spec)
            g = spec.gates
            if src.latency is None and (g.ttft_p99_max is not None or g.tpot_p99_max is not None):
                raise RolloutError(
                    f"{spec.service}: latency gates need the canary runtime's metrics source",
                    status=400,
                )
            if spec.quality is not None and src.quality is None:
                raise RolloutError(
                    f"{spec.service}: the quality gate needs a source for its "
                    f"{spec.quality.mode} mode",
                    status=400,
                )
            refused = self._preflight(spec, src)
            if refused:
                raise RolloutError(f"{spec.service}: not started: {refused}")
            self._sources[spec.service] = src
            r = Rollout(spec=spec)
            self._rollouts[spec.service] = r
            self._transition(r, PENDING, f"rollout of {spec.canary} over {spec.stable} started")
            self._pin(r)
            self._apply_step(r, 0)
            return r.to_dict()

    def status(self, service: str | None = None) -> dict[str, Any]:
        with self._lock:
            if service is None:
                return {s: r.to_dict() for s, r in self._rollouts.items()}
            return self._get(service).to_dict()

    def pause(self, service: str) -> dict[str, Any]:
        with self._lock:
            r = self._get(service)
            if r.state not in (PENDING, PROGRESSING):
                raise RolloutError(f"{service}: cannot pause a rollout that is {r.state}")
            r.paused_from = r.state
            self._transition(r, PAUSED, "paused by operator")
            return r.to_dict()

    def resume(self, service: str) -> dict[str, Any]:
        """Re-apply the current step (waiting for every ACK again) and start a fresh interval."""
        with self._lock:
            r = self._get(service)
            if r.state != PAUSED:
                raise RolloutError(f"{service}: cannot resume a rollout that is {r.state}")
            self._apply_step(r, max(r.step, 0), reason="resumed by operator")
            return r.to_dict()

    def abort(self, service: str) -> dict[str, Any]:
        with self._lock:
            r = self._get(service)
            if r.state in TERMINAL:
                raise RolloutError(f"{service}: cannot abort a rollout that is {r.state}")
            self._rollback(r, "aborted by operator")
            return r.to_dict()

    def promote(self, service: str) -> dict[str, Any]:
        """Skip the remaining steps: 100 % to the canary now."""
        with self._lock:
            r = self._get(service)
            if r.state in TERMINAL:
                raise RolloutError(f"{service}: cannot promote a rollout that is {r.state}")
            self._apply_step(r, len(r.spec.steps) - 1, reason="promoted by operator")
            return r.to_dict()

    def tick(self, service: str | None = None, *, force: bool = False) -> None:
        """Analyse every rollout whose interval has elapsed (`force`: now, elapsed or not).
        The measurements (HTTP to sidecars and runtimes; the quality gate's replay or joins
        take seconds) run without the lock, so status, pause and abort answer meanwhile; the
        verdict is applied under it only if the rollout is still in that same interval."""
        with self._lock:
            names = [service] if service else list(self._rollouts)
            due = []
            for name in names:
                r = self._get(name)
                iv = self._intervals.get(name)
                if r.state != PROGRESSING or iv is None or name in self._measuring:
                    continue
                if force or self.clock() - iv.started >= r.spec.interval:
                    self._measuring.add(name)
                    due.append((r, iv))
        for r, iv in due:
            try:
                v = self._measure(r, iv)
                with self._lock:
                    if self._rollouts.get(r.spec.service) is r and self._current(r, iv):
                        self._analyse(r, v)
            finally:
                with self._lock:
                    self._measuring.discard(r.spec.service)

    def _current(self, r: Rollout, iv: _Interval) -> bool:
        """Still progressing in interval `iv`: no pause, abort, promotion or resume since."""
        return r.state == PROGRESSING and self._intervals.get(r.spec.service) is iv

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> RolloutController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the machine --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception:  # one bad tick must not end the controller
                log.exception("rollout tick failed")

    def _get(self, service: str) -> Rollout:
        r = self._rollouts.get(service)
        if r is None:
            raise RolloutError(f"{service}: no rollout", status=404)
        return r

    def _transition(self, r: Rollout, state: str, reason: str) -> None:
        r.history.append(
            {"time": time.time(), "from": r.state if r.history else None, "to": state,
             "reason": reason, "canary_weight": r.canary_weight}
        )  # fmt: skip
        log.info("rollout %s: %s -> %s: %s", r.spec.service, r.state, state, reason)
        r.state = state
        r.message = reason
        self._save()

    def _save(self) -> None:
        self.store.save({s: r.to_dict() for s, r in self._rollouts.items()})

    def _set_weights(self, r: Rollout, canary_weight: int) -> tuple[bool, list[str], str]:
        """(all ACKed, lagging sidecars, error) after asking the control plane for new weights."""
        weights = {r.spec.stable: 100 - canary_weight, r.spec.canary: canary_weight}
        try:
            result = self.cp.set_weights(r.spec.service, weights, timeout=r.spec.ack_timeout)
        except Exception as e:  # e.g. MeshError: the version vanished from the mesh file
            return False, [], f"control plane refused weights {weights}: {e}"
        ok, lagging = ack_outcome(result)
        return ok, lagging, ""

    def _apply_step(self, r: Rollout, step: int, reason: str = "") -> None:
        """Move to `step` (its weight), wait for every ACK, then start its interval. The last
        step is the promotion: only after 100 % is ACKed does the canary become stable."""
        weight = r.spec.steps[step]
        promoting = step == len(r.spec.steps) - 1
        if promoting and r.state != PROMOTING:
            self._transition(r, PROMOTING, reason or f"all analysis steps passed; {weight} %")
        if step != r.step:
            r.failures = 0  # consecutive failures count per step
        r.step, r.canary_weight = step, weight
        ok, lagging, error = self._set_weights(r, weight)
        r.lagging = lagging
        if error:
            self._rollback(r, error, final_state=FAILED)
            return
        if not ok:
            r.paused_from = PROMOTING if promoting else PROGRESSING
            self._transition(
                r,
                PAUSED,
                f"step {weight} % not ACKed within {r.spec.ack_timeout:g}s by: "
                f"{', '.join(lagging) or '?'} (step not counted; resume to retry)",
            )
            return
        if promoting:
            r.stable = r.spec.canary
            self._mirror(r, on=False)
            self._pin(r)
            self._intervals.pop(r.spec.service, None)
            self._transition(
                r, SUCCEEDED, f"promoted: 100 % on {r.spec.canary} ACKed by every sidecar; "
                f"{r.spec.canary} is now stable"
            )  # fmt: skip
            return
        self._mirror(r, on=True)
        self._new_interval(r)
        self._transition(
            r, PROGRESSING, (reason + ": " if reason else "") + f"step {weight} % ACKed by every "
            f"sidecar; analysing for {r.spec.interval:g}s"
        )  # fmt: skip

    def _pin(self, r: Rollout) -> None:
        """`x-canary: never` -> the stable now (the canary once Succeeded), `always` -> the
        other. Routes read these pins from the desired state (else from the mesh file, which
        a promotion does not change). A control plane holding no mesh (a test fake) has none."""
        set_pins = getattr(self.cp, "set_pins", None)
        if set_pins is None:
            return
        s = r.spec
        try:
            set_pins(s.service, r.stable, s.stable if r.stable == s.canary else s.canary,
                     timeout=s.ack_timeout)  # fmt: skip
        except Exception as e:  # the pins are a tester's aid: never fail a rollout over them
            log.warning("rollout %s: x-canary pins not updated: %s", s.service, e)

    def _mirror(self, r: Rollout, *, on: bool) -> None:
        """The quality gate's mirror mode: callers' sidecars copy safe-marked calls to the
        canary's shadow while a step runs (on), never after promotion or rollback (off). A
        mirror that some sidecar lacks yields fewer samples: the interval halts, never passes."""
        q, set_mirror = r.spec.quality, getattr(self.cp, "set_mirror", None)
        if q is None or q.mode != "mirror" or set_mirror is None:
            return
        mirror = Mirror(r.spec.canary, q.mirror_percent) if on else None
        try:
            result = set_mirror(r.spec.service, mirror, timeout=r.spec.ack_timeout)
            ok, lagging = ack_outcome(result) if result is not None else (True, [])
            if not ok:
                log.warning("rollout %s: mirror %s not ACKed by: %s", r.spec.service,
                            "on" if on else "off", ", ".join(lagging))  # fmt: skip
        except Exception as e:
            log.warning("rollout %s: mirror not %s: %s", r.spec.service,
                        "set" if on else "removed", e)  # fmt: skip

    def _rollback(self, r: Rollout, reason: str, final_state: str = ROLLED_BACK) -> None:
        """0 % canary. Old endpoints were never removed, so stable takes all traffic at once."""
        r.canary_weight = 0
        self._intervals.pop(r.spec.service, None)
        ok, lagging, error = self._set_weights(r, 0)
        self._mirror(r, on=False)
        r.lagging = lagging
        if error or not ok:
            why = error or f"not ACKed within {r.spec.ack_timeout:g}s by: {', '.join(lagging)}"
            self._transition(r, FAILED, f"{reason}; rollback to {r.spec.stable} {why}")
            return
        self._transition(r, final_state, f"{reason}; 100 % back on {r.spec.stable}")

    def _new_interval(self, r: Rollout) -> None:
        src = self._sources_for(r)
        try:
            baseline: dict[str, GrpcCounts] | None = src.grpc.read()
        except MeasurementError as e:
            log.warning("rollout %s: no baseline: %s", r.spec.service, e)
            baseline = None
        stable_baseline = latency_baseline = None
        if src.stable is not None:
            with contextlib.suppress(MeasurementError):
                stable_baseline = src.stable.read()
        if src.latency is not None:
            try:
                latency_baseline = src.latency.snapshot()
            except MeasurementError as e:
                log.warning("rollout %s: no latency baseline: %s", r.spec.service, e)
        begin = getattr(src.quality, "begin", None)  # the mirror: no copy from before the start
        if begin is not None:
            try:
                begin()
            except MeasurementError as e:
                log.warning("rollout %s: mirrored records not read: %s", r.spec.service, e)
        self._intervals[r.spec.service] = _Interval(
            self.clock(), baseline, stable_baseline, latency_baseline
        )

    def _preflight(self, spec: RolloutSpec, src: Sources) -> str | None:
        """Why a rollout cannot start, or None: the canary must have a live endpoint (else its
        first step sends calls to a dead port) and every gate's source must answer (else no
        interval could ever be judged)."""
        if src.live is not None:
            seen = src.live.read()
            down = not_live_reason(spec.canary, seen)
            if down and any(not r.listening for r in seen):
                return f"canary {down}"  # it asks whether they run
            if down:
                return f"canary {down}; start it (and its sidecar) first"
        g = spec.gates
        if g.provider is not None:  # the gates are the provider's queries
            return metrics_problem(spec, PrometheusSource(g.provider))
        reads: list[tuple[str, Callable[[], object]]] = [("gRPC counts", src.grpc.read)]
        if src.latency is not None and (g.ttft_p99_max is not None or g.tpot_p99_max is not None):
            reads.append(("canary runtime metrics", src.latency.snapshot))
        for what, read in reads:
            try:
                read()
            except MeasurementError as e:
                return f"{what} cannot be read: {e}"
        return None

    def _sources_for(self, r: Rollout) -> Sources:
        src = self._sources.get(r.spec.service)
        if src is None:
            src = self._sources[r.spec.service] = self.sources_factory(r.spec)
        return src

    def _measure(self, r: Rollout, iv: _Interval) -> Verdict:
        """Runs without the lock: reads only the spec and `iv`, both unchanged by transitions."""
        with self._lock:
            src = self._sources_for(r)
        counts = latency = None
        counts_error = latency_error = None
        try:
            now = src.grpc.read()
            counts = delta(iv.baseline, now) if iv.baseline is not None else None
            if counts is None:
                counts_error = "no baseline at interval start"
        except MeasurementError as e:
            counts_error = str(e)
        if src.latency is not None:
            try:
                now_latency = src.latency.snapshot()
                if iv.latency_baseline is None:
                    latency_error = "no baseline at interval start"
                else:  # the percentiles of exactly this interval's calls
                    latency = now_latency.since(iv.latency_baseline)
            except MeasurementError as e:
                latency_error = str(e)
        if src.stable is not None:
            try:
                now_stable = src.stable.read()
                stable_n = delta(iv.stable_baseline, now_stable).total
            except MeasurementError:
                stable_n = None
        else:
            stable_n = None
        if r.spec.gates.provider is not None:  # the gates are the provider's queries
            v = evaluate_metrics(r.spec, PrometheusSource(r.spec.gates.provider))
            if counts is not None:  # the traffic split per step, where the sidecars answer
                v.measurements["requests"] = counts.total
        else:
            errors = {"counts_error": counts_error, "latency_error": latency_error}
            v = evaluate(r.spec.gates, counts, latency, **errors)
        down = not_live_reason(r.spec.canary, src.live.read()) if src.live is not None else None
        if down:  # calls routed to it are lost: a failed interval, whatever the counters say
            v = Verdict(FAIL, f"canary {down}", v.measurements)
        if stable_n is not None:
            v.measurements["stable_requests"] = stable_n
        if src.quality is not None:  # last: its replay falls between two intervals' counters
            v = with_quality(v, src.quality.verdict())
        return v

    def _analyse(self, r: Rollout, v: Verdict) -> None:
        rec = {"time": time.time(), "step": r.step, "canary_weight": r.canary_weight,
               "outcome": v.outcome, "reason": v.reason, **v.measurements}  # fmt: skip
        r.analyses = [*r.analyses, rec][-MAX_ANALYSES:]
        self._count_traffic(r, v)
        if v.outcome == PASS:
            r.failures = 0
            self._apply_step(r, r.step + 1, reason="")
            return
        if v.outcome == FAIL:
            r.failures += 1
            if r.failures >= r.spec.threshold:
                self._rollback(
                    r,
                    f"gates failed {r.failures} consecutive interval(s) at {r.canary_weight} %: "
                    f"{v.reason}",
                )
                return
            r.message = (
                f"gate failed ({r.failures}/{r.spec.threshold}) at {r.canary_weight} %: {v.reason}"
            )
        else:
            assert v.outcome == HALT
            r.message = f"{v.reason}; staying at {r.canary_weight} %"
            if v.reason.startswith(NOT_ENOUGH_TRAFFIC) and r.spec.gates.provider is None:
                header = self._canary_header(r.spec.service)
                hint = traffic_hint(r.spec.gates, r.canary_weight, r.spec.interval, header)
                r.message += f"; {hint}"
        self._new_interval(r)  # stay at this weight: never beyond the current step
        self._save()

    def _serves_all(self, spec: RolloutSpec) -> bool:
        """Whether the live weights send all of the service's traffic to `spec.canary`: a
        version promoted once and since weighted back down (`meshlm weights`) can roll out
        again. Without a mesh (a test fake), the last rollout's word stands."""
        mesh = getattr(self.cp, "mesh", None)
        svc = mesh.services.get(spec.service) if mesh is not None else None
        return svc is None or svc.route.weights.get(spec.canary) == 100

    def _canary_header(self, service: str) -> str:
        """The header that pins a version (a control plane holding no mesh, a test fake: the
        mesh file's default)."""
        mesh = getattr(self.cp, "mesh", None)
        svc = mesh.services.get(service) if mesh is not None else None
        return svc.route.canary_header if svc is not None else CANARY_HEADER

    def _count_traffic(self, r: Rollout, v: Verdict) -> None:
        n = int(v.measurements.get("requests", 0))
        ns = v.measurements.get("stable_requests")
        if not (r.traffic and r.traffic[-1]["step"] == r.step):
            r.traffic.append({"step": r.step, "canary_weight": r.canary_weight,
                              "canary_requests": 0, "stable_requests": None})  # fmt: skip
        t = r.traffic[-1]
        t["canary_requests"] += n
        if ns is not None:
            t["stable_requests"] = (t["stable_requests"] or 0) + ns

    def _recover(self) -> None:
        """After a restart: re-apply each rollout's current weights (a restarted control plane
        starts from the mesh file) and carry on where it was; a fresh interval starts."""
        for r in self._rollouts.values():
            self._pin(r)
            if r.state in TERMINAL:
                self._mirror(r, on=False)
                _, _, error = self._set_weights(r, 100 if r.stable == r.spec.canary else 0)
                if error:
                    log.warning("rollout %s: final weights not kept: %s", r.spec.service, error)
                continue
            note = f"control plane restarted while {r.state}"
            if r.state == PAUSED:
                ok, lagging, error = self._set_weights(r, r.canary_weight)
                r.lagging = lagging
                r.message = f"{note}; weights {r.weights()} re-applied, still paused" + (
                    "" if ok else f" ({error or 'not ACKed by: ' + ', '.join(lagging)})"
                )
                self._save()
            elif r.state == PENDING:
                self._apply_step(r, 0, reason=note)
            else:
                self._apply_step(r, max(r.step, 0), reason=note)


__all__ = ["RolloutController", "RolloutError", "RolloutSpecError", "Sources"]
