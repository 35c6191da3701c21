"""`meshlm demo --scenario poison`: a query of death, and the semantic circuit breaker.

Two int4 replicas of v1 (the main pool) and one of `q` (the isolation pool, weight 0), every
runtime started with `--fault-poison POISON-PILL` (a matching request makes it exit hard), the
caller-side sidecar classifying every Generate call (`x-meshlm-class`). Healthy tenants' traffic
runs alone for a baseline, then a poison request arrives every second. Dead runtimes are
restarted by the demo's launcher (`LocalMesh.keep_runtimes_alive`, as a pod's restartPolicy,
with its CrashLoopBackOff); `q` runs at a lower CPU priority (a best-effort pool). A call whose
runtime died holding it is not retried (the inbound sidecar answers UNKNOWN), so the first
poison request kills one replica, not the pool. With isolation on (the service's `isolation`
block), the control plane sees the class fail in the caller sidecar's access logs, quarantines
it and routes it to `q`; off, each poison request kills a main-pool replica while healthy calls
ride on whatever is left.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from mesh_common.headers import CLASS_HEADER
from meshlm.demo.scenario import report_of, running, say, write_report

BENCH_TITLE = "Semantic circuit breaking: a query of death at 1/s"
POISON_REGEX = "POISON-PILL"
POISON_PROMPT = "POISON-PILL: repeat the word pill forever."
POISON_RATE = 1.0  # per second
ISOLATION = {
    # The seed's 0.8 % needs thousands of calls per class to mean anything; at a 2-core demo's few
    # calls per second a class is a handful of calls. A query of death fails every call that reaches
    # a live runtime; calls that find the pool down or were mid-stream when a runtime died do not
    # count against their class (xds_server/slo/access_log_service.py). One call is enough here: it
    # has killed the replica it reached, and waiting for a second one means the other replica down
    # too; a healthy class has many good calls in its window.
    "error_rate": "50%",
    "window": "60s",
    "min_requests": 1,
    "pool": "q",
    "cooldown": "60s",
    "max_classes": 10000,
}
MAX_NEW_TOKENS = 8
# The quarantine pool is best effort: every poison call kills it, and its model reloads must
# not take the CPU the main pool serves healthy traffic with (a lower-priority pod on a node).
QUARANTINE_NICE = 10
GENERATE = "/meshlm.inference.v1.Inference/Generate"


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "poison: a query of death arrives every second",
        lambda: _run(mechanism=True, phases=(15.0, 60.0), workdir=args.workdir, say=say),
    )
    return 0 if report is not None and report["quarantined_classes"] else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    phases = (10.0, 40.0) if quick else (15.0, 60.0)
    r = _run(mechanism=mechanism, phases=phases, workdir=None, say=lambda m: None)
    return {
        "healthy_availability": r["healthy_availability"],
        "healthy_failed": len(r["healthy_failures"]),
        "healthy_baseline_e2e_ms": r["healthy_baseline"]["e2e_ms"],
        "healthy_e2e_ms": r["healthy"]["e2e_ms"],
        "healthy_after_quarantine_e2e_ms": r["healthy_after_quarantine"]["e2e_ms"],
        "runtime_restarts": r["runtime_restarts_total"],
        "time_to_quarantine_s": r["time_to_quarantine_s"],
        "healthy_classes_quarantined": r["healthy_classes_quarantined"],
        "main_restarts_at_quarantine": r["main_restarts_at_quarantine"],
        "poison_calls_before_quarantine": r["poison_calls_before_quarantine"],
        "restarts_of_main_after_quarantine": r["restarts_of_main_after_quarantine"],
    }


def _mesh(mechanism: bool) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, scenario_mesh

    mesh = scenario_mesh({"v1": 100, "q": 0})
    if mechanism:
        mesh["services"][SERVICE]["isolation"] = dict(ISOLATION)
    return mesh


def _run(*, mechanism: bool, phases: tuple[float, float], workdir: Any, say: Any) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.sla import DENIALS, sla
    from meshlm.demo.traffic import TenantLoad, Traffic

    baseline_s, poison_s = phases
    fault = ["--fault-poison", POISON_REGEX]
    replicas, faults = {"v1": 2, "q": 1}, {"v1": fault, "q": fault}
    mesh = LocalMesh(_mesh(mechanism), workdir=workdir, replicas=replicas, faults=faults)
    mesh.nice = {"q": QUARANTINE_NICE}
    say(f"logs and report in {mesh.workdir}; isolation {'on' if mechanism else 'off'}")
    loads = [
        TenantLoad("acme", "demo-acme-key", rate=2.0),
        TenantLoad("free", "demo-free-key", rate=0.5),  # over its bucket now and then: 429s
    ]
    with running(mesh, say) as stops:
        mesh.keep_runtimes_alive(say=say)
        traffic = Traffic(
            mesh.caller_target, loads, authority=SERVICE, max_new_tokens=MAX_NEW_TOKENS,
            resume=False,
        ).start()  # fmt: skip
        stops.callback(traffic.stop)
        say(f"baseline: healthy traffic alone for {baseline_s:.0f} s")
        time.sleep(baseline_s)
        poison = PoisonTrickle(mesh.caller_target, SERVICE).start()
        stops.callback(poison.stop)
        say(f"a poison request every {1 / POISON_RATE:g} s for {poison_s:.0f} s")
        t_poison = time.monotonic()
        quarantined_at = _watch_quarantine(mesh, t_poison, poison_s) if mechanism else None
        main_restarts = None
        if quarantined_at is not None:
            time.sleep(2.0)  # a runtime the poison killed before the ACK is noticed by now
            main_restarts = _main_restarts(mesh)
        time.sleep(max(0.0, t_poison + poison_s - time.monotonic()))
        poison.stop()
        traffic.stop()
        healthy = traffic.outcomes
        base = [o for o in healthy if o.at < t_poison]
        after = [o for o in healthy if quarantined_at is not None and o.at >= quarantined_at]
        quarantined = _quarantined(mesh) if mechanism else []
        key = poison_class()
        report = {
            "scenario": "poison",
            "isolation": mechanism,
            "workdir": str(mesh.workdir),
            "sla": sla([*healthy, *poison.outcomes]),
            "healthy_availability": sla(healthy)["availability"],
            "healthy": sla(healthy),
            "healthy_baseline": sla(base),
            "healthy_after_quarantine": sla(after),
            "healthy_failures": [
                {
                    "at_s": round(o.at - t_poison, 1),
                    "tenant": o.tenant,
                    "status": o.status,
                    "detail": o.detail[:120],
                }
                for o in healthy
                if o.status != "OK" and o.status not in DENIALS
            ],
            "poison_calls": dict(Counter(o.status for o in poison.outcomes)),
            "quarantined_classes": quarantined,
            "poison_class": key,
            "healthy_classes_quarantined": sum(q["key"] != key for q in quarantined),
            "time_to_quarantine_s": (
                None if quarantined_at is None else round(quarantined_at - t_poison, 1)
            ),
            "runtime_restarts": dict(mesh.restarts),
            "runtime_restarts_total": sum(mesh.restarts.values()),
            # Each poison call before the quarantine may kill the replica it reached, no more:
            # a call whose runtime died holding it is not retried on the next one.
            "main_restarts_at_quarantine": main_restarts,
            "poison_calls_before_quarantine": (
                None
                if quarantined_at is None
                else sum(o.at < quarantined_at for o in poison.outcomes)
            ),
            "restarts_of_main_after_quarantine": (
                None if main_restarts is None else _main_restarts(mesh) - main_restarts
            ),
            "restarted_by": "the demo's launcher (LocalMesh.keep_runtimes_alive)",
        }
        write_report(mesh.workdir, report)
        return report


def poison_class() -> str:
    """The class the caller sidecar's filter gives the poison request (the same Wasm module,
    run in-process by wasm_filters.host)."""
    from schemas.codec import ChatMessage, GenerateRequest, encode_generate_request
    from wasm_filters.host import CLASSIFY_WASM_PATH, WasmHost

    host = WasmHost(CLASSIFY_WASM_PATH)
    host.configure(b"")
    msg = encode_generate_request(
        GenerateRequest(
            messages=[ChatMessage("user", POISON_PROMPT)], max_new_tokens=MAX_NEW_TOKENS
        )
    )
    frame = b"\0" + len(msg).to_bytes(4, "big") + msg  # one gRPC message
    d = host.request({":authority": "llm"}, path=GENERATE, body=frame)
    return (d.header(CLASS_HEADER) or b"").decode()


def _main_restarts(mesh: Any) -> int:
    return sum(n for name, n in mesh.restarts.items() if mesh.runtimes[name].version == "v1")


def _quarantined(mesh: Any) -> list[dict[str, Any]]:
    from meshlm.demo.launcher import SERVICE

    doc = mesh.admin("GET", "/isolation").get(SERVICE) or {}
    return [
        {"key": q["key"], "when": q["since_iso"], "why": q["why"], "state": q["state"]}
        for q in doc.get("quarantined", [])
    ]


def _watch_quarantine(mesh: Any, t0: float, limit_s: float) -> float | None:
    """The monotonic time at which a quarantine was ACKed by every sidecar, if it was."""
    from meshlm.demo.launcher import SERVICE

    while time.monotonic() - t0 < limit_s:
        try:
            doc = mesh.admin("GET", "/isolation", timeout=5).get(SERVICE) or {}
            if any(q.get("applied") for q in doc.get("quarantined", [])):
                return time.monotonic()
        except OSError:
            pass
        time.sleep(0.2)
    return None


class PoisonTrickle:
    """A query of death every 1 / POISON_RATE s, open loop, each call on its own thread."""

    def __init__(self, target: str, authority: str) -> None:
        from model_runtime.serving.client import Client

        self.client = Client(target, api_key="demo-ops-key", authority=authority)
        self.outcomes: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="poison")
        self._thread = threading.Thread(target=self._pace, daemon=True)

    def start(self) -> PoisonTrickle:
        self._thread.start()
        return self

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._pool.shutdown(wait=True)
            self.client.close()

    def _pace(self) -> None:
        n, start = 0, time.monotonic()
        while not self._stop.is_set():
            self._pool.submit(self._call)
            n += 1
            self._stop.wait(max(0.0, start + n / POISON_RATE - time.monotonic()))

    def _call(self) -> None:
        from meshlm.demo.traffic import Outcome

        t0, status = time.monotonic(), "OK"
        try:
            chat = [{"role": "user", "content": POISON_PROMPT}]
            for _ in self.client.generate(messages=chat, max_new_tokens=MAX_NEW_TOKENS, timeout=30):
                pass
        except grpc.RpcError as e:
            status = e.code().name
        outcome = Outcome(t0, "poison", status, None, (time.monotonic() - t0) * 1000)
        with self._lock:
            self.outcomes.append(outcome)
