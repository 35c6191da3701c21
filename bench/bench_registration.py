"""Workload registration: how soon a host that turns SERVING is held by every caller.

One join: a host's runtime turns SERVING (a real gRPC server's grpc.health.v1 status, set at a
recorded instant); the sidecar's registration client (sidecar/registration.py, woken by its
Watch stream) registers it on the control plane's gRPC port; the control plane stages the host
into EDS and answers once every caller sidecar ACKed it; each caller Envoy then lists the host
healthy in its /clusters. Measured per join: SERVING -> answer (= ACKed by every caller) and
SERVING -> healthy in every caller's /clusters, for joins one at a time and in bursts (hosts
turning SERVING together), in one run. A real model runtime per host would be 50 model loads on
this machine: the registered hosts are gRPC servers that answer health only (the runtime's part
in a join is that answer).

The peer design is Istio's WorkloadEntry auto-registration: istiod coalesces pushes with
PILOT_DEBOUNCE_AFTER 100 ms of quiet, at most PILOT_DEBOUNCE_MAX 10 s (cited, not run here).
"""

from __future__ import annotations

import os
import threading
import time
from statistics import median
from typing import Any

from bench.machine import describe

CALLERS = 3
JOINS = 50
CLUSTER = "outbound|llm|v1"


def _healthy_everywhere(envoys: list[Any]) -> set[str]:
    """Addresses every caller Envoy lists healthy in llm/v1."""
    held: set[str] | None = None
    for envoy in envoys:
        ok = {a for a, flags in envoy.host_health(CLUSTER).items() if flags == "healthy"}
        held = ok if held is None else held & ok
    return held or set()


def run_joins(burst: int, joins: int) -> dict[str, Any]:
    """`joins` hosts, turned SERVING `burst` at a time; one control plane and CALLERS caller
    Envoys, fresh for the run. Per join: seconds from SERVING to the answer and to healthy in
    every caller."""
    from sidecar.registration import Registration, RuntimeHealth
    from tests.registration_support import reg_mesh
    from tests.test_xds_support import eventually, sidecar, upstreams
    from xds_server.compose import build_server

    mesh = reg_mesh(max_per_service=joins + 8, max_total=joins + 8)
    cp = build_server(mesh).start()
    envoys = [sidecar(cp, f"caller-{i}")[0].start() for i in range(CALLERS)]
    names = [f"h{i}" for i in range(joins)]
    clients: list[Registration] = []
    watches: list[RuntimeHealth] = []
    serving_at: dict[str, float] = {}
    answered_at: dict[str, float] = {}
    held_at: dict[str, float] = {}
    try:
        for e in envoys:
            e.wait_ready(60)
        with upstreams(*names, health=True) as hosts:
            by_address = {hosts[n].address: n for n in names}
            for n in names:
                hosts[n].set_serving(False)
                health = RuntimeHealth(hosts[n].address)
                client = Registration(
                    f"{n}-node", hosts[n].address, "llm", "v1", [("127.0.0.1", cp.grpc_port)],
                    health, on_event=lambda msg, n=n: _answered(msg, n, answered_at),
                )  # fmt: skip
                health.watch(client.wake)
                watches.append(health)
                clients.append(client.start())
            stop = threading.Event()
            poller = threading.Thread(
                target=_poll, args=(envoys, by_address, held_at, stop), daemon=True
            )
            poller.start()
            for start in range(0, joins, burst):
                group = names[start : start + burst]
                for n in group:
                    serving_at[n] = time.perf_counter()
                    hosts[n].set_serving(True)
                eventually(
                    lambda g=group: all(n in held_at and n in answered_at for n in g),
                    timeout=60,
                    what=f"hosts {group[0]}..{group[-1]} held by every caller",
                )
            stop.set()
            poller.join(timeout=5)
            for c in clients:
                c.stop()
    finally:
        for w in watches:
            w.close()
        for e in envoys:
            e.stop()
        cp.stop()
    answer = sorted(answered_at[n] - serving_at[n] for n in names)
    held = sorted(held_at[n] - serving_at[n] for n in names)
    return {"burst": burst, "joins": joins, "answer": answer, "held": held}


def _answered(msg: str, name: str, answered_at: dict[str, float]) -> None:
    if msg.startswith("registered") and name not in answered_at:
        answered_at[name] = time.perf_counter()


def _poll(
    envoys: list[Any], by_address: dict[str, str], held_at: dict[str, float], stop: threading.Event
) -> None:
    while not stop.is_set():
        try:
            now_held = _healthy_everywhere(envoys)
        except OSError:
            now_held = set()
        now = time.perf_counter()
        for address in now_held:
            name = by_address.get(address)
            if name is not None and name not in held_at:
                held_at[name] = now
        stop.wait(0.01)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(quick: bool = False) -> str:
    load0 = os.getloadavg()[0]
    runs = [run_joins(1, JOINS), run_joins(10, JOINS), run_joins(JOINS, JOINS)]
    load = os.getloadavg()[0]
    base = runs[0]
    lines = [
        "## Workload registration: SERVING to held by every caller",
        "",
        f"Machine: {describe()}. Load average at the start {load0:.1f}, at the end {load:.1f}.",
        "",
        "Command: `python -m bench registration`. One control plane (the mesh's default push "
        f"debounce), {CALLERS} real caller Envoys, {JOINS} registered hosts per row, each a real "
        "gRPC server whose grpc.health.v1 status turns SERVING at the instant measured, "
        "registered by the sidecar's own client (sidecar/registration.py, woken by its Watch "
        "stream). 'answer' = the control plane's answer, sent once every caller sidecar ACKed "
        "the EDS holding the host; 'held' = the host healthy in every caller Envoy's /clusters "
        "(polled every 10 ms). A model runtime's part in a join is its health answer, so "
        "hosts here run none. The peer design is Istio's WorkloadEntry auto-registration, "
        "whose pushes istiod debounces (PILOT_DEBOUNCE_AFTER 100 ms, PILOT_DEBOUNCE_MAX 10 s); "
        "cited, not run.",
        "",
        "| hosts turning SERVING together | joins | answer p50 / p99 / max (s) | held p50 / p99 / max (s) | held p99 vs one at a time |",  # noqa: E501
        "|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        a, h = r["answer"], r["held"]
        lines.append(
            f"| {r['burst']} | {r['joins']} | {median(a):.2f} / {_pct(a, 0.99):.2f} / "
            f"{a[-1]:.2f} | {median(h):.2f} / {_pct(h, 0.99):.2f} / {h[-1]:.2f} | "
            f"{_pct(h, 0.99) / _pct(base['held'], 0.99):.2f}x |"
        )
    worst = max(_pct(r["held"], 0.99) for r in runs)
    lines += [
        "",
        f"Goal: held by every caller within 1 s p99 of SERVING; worst p99 here {worst:.2f} s.",
        "",
    ]
    return "\n".join(lines)
