"""`meshlm demo --scenario stall`: streams that survive a replica that stalls, then dies.

Two int4 replicas of v1 behind their sidecars, the caller-side sidecar, the usual tenants'
traffic through the caller library (meshlm.client). Replica v1-1 first stalls every stream
after a few tokens (for good: `--fault-stall-after`), then is restarted with `--fault-exit-after`
and dies hard in the middle of its first stream; the launcher does not restart it. With resume on
(the service's `stall` block) the caller resumes each broken stream on v1-0 with the tokens it
already has; off, only plain Envoy retries and outlier detection act. Every resumed stream is
replayed afterwards on v1-0 without faults and compared token by token (greedy decoding: the
resumed stream must be the same stream). Unresumed streams are compared too: a greedy stream is
the same whatever it was batched with and whatever the replica's prefix cache held (prefill
attention is native: native_attention.py), so any difference there is a runtime defect.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections import Counter
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report

BENCH_TITLE = "Token-stall resume: a replica stalls mid-stream, then dies"
# Sized for a 2-core machine, where a loaded replica's first token may take seconds and its
# inter-token gaps half a second: a hard limit under the worst TTFT would retry healthy calls.
STALL = {"gap": "1s", "consecutive": 3, "hard_limit": "5s", "max_resumes": 2}
STALL_AFTER = 4  # tokens before v1-1 stalls (phase 1) or exits (phase 2)
MAX_NEW_TOKENS = 10
FAULTY, HEALTHY = "v1-1", "v1-0"
CLUSTER = "outbound|llm|v1"


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "stall: a replica stalls, then dies, in the middle of streams",
        lambda: _run(mechanism=True, phase_s=40.0, workdir=args.workdir, say=say),
    )
    if report is None:
        return 1
    ok = (
        report["resumed_streams"] > 0
        and report["resume_token_mismatches"] == 0
        and report["unresumed_token_mismatches"] == 0
        and report["exiting_replica"]["exited"]
    )
    return 0 if ok else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    r = _run(mechanism=mechanism, phase_s=20.0 if quick else 40.0, workdir=None, say=lambda m: None)
    return {k: r[k] for k in ("sla", "streams_lost", "resumed_streams", "resume_token_mismatches")}


def _mesh(mechanism: bool) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, scenario_mesh

    mesh = scenario_mesh({"v1": 100})
    svc = mesh["services"][SERVICE]
    svc["route"]["stream_idle_timeout"] = "15s"
    # A replica that stalls streams after their headers never trips a consecutive-failure
    # counter (each stream records a 200, then the timeout); its share of failures does.
    svc["outlier_detection"] = {
        **svc["outlier_detection"],
        "failure_percentage_threshold": 30,
        "failure_percentage_request_volume": 5,
        "base_ejection_time": "10s",  # back in rotation for the exit phase
    }
    if mechanism:
        svc["stall"] = dict(STALL)
    return mesh


def _run(*, mechanism: bool, phase_s: float, workdir: Any, say: Any) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.sla import DENIALS, sla
    from meshlm.demo.traffic import TenantLoad, Traffic

    stall = ["--fault-stall-after", str(STALL_AFTER)]
    mesh = LocalMesh(_mesh(mechanism), workdir=workdir, replicas={"v1": 2}, faults={FAULTY: stall})
    say(f"logs and report in {mesh.workdir}; resume {'on' if mechanism else 'off'}")
    loads = [
        TenantLoad("acme", "demo-acme-key", rate=1.5),
        TenantLoad("free", "demo-free-key", rate=0.5),  # over its bucket now and then: 429s
        TenantLoad("free", "demo-free-key", rate=0.2, method="Info"),  # not allowed: 403
        TenantLoad("intruder", "not-a-key", rate=0.2),  # unknown key: 401
    ]
    with running(mesh, say) as stops:
        traffic = Traffic(
            mesh.caller_target,
            loads,
            authority=SERVICE,
            max_new_tokens=MAX_NEW_TOKENS,
            resume=mechanism,
        ).start()
        stops.callback(traffic.stop)
        t0 = time.monotonic()
        say(f"phase 1: {FAULTY} stalls every stream after {STALL_AFTER} tokens")
        ejected_at = _watch_ejection(mesh, t0, phase_s)
        to_stalled = _host_requests(mesh, mesh.runtimes[FAULTY].inbound_port)
        say(f"phase 2: {FAULTY} restarted to exit hard after {STALL_AFTER} tokens of a stream")
        proc = mesh.restart_runtime(FAULTY, ["--fault-exit-after", str(STALL_AFTER)], say=say)
        # Phase 2 lasts until the replica has died holding a stream (up to 2 x phase_s): it can
        # still be ejected from phase 1 (the ejection time grows with each ejection), so a
        # fixed window sometimes ended before any stream reached it. Then a few seconds for the
        # streams it broke to finish elsewhere.
        t2 = time.monotonic()
        while proc.alive() and time.monotonic() - t2 < 2 * phase_s:
            time.sleep(0.2)
        time.sleep(min(5.0, phase_s / 3))
        phase_2_s = round(time.monotonic() - t2, 1)
        traffic.stop()
        outcomes = traffic.outcomes
        gen = [o for o in outcomes if o.prompt]
        lost = [o for o in gen if o.status != "OK" and o.status not in DENIALS]
        done = [o for o in gen if o.status == "OK"]
        replay = _replay(mesh.runtimes[HEALTHY].port, done)
        resumed = [o for o in done if o.resumes]
        mismatches = sum(o.token_ids != replay[o.prompt] for o in resumed)
        # The control group: streams never resumed, against the same replay (batched, beside
        # other prompts' cached prefixes: still the same stream).
        control = sum(o.token_ids != replay[o.prompt] for o in done if not o.resumes)
        # What a resume would add of its own: a stream no uninterrupted call produced.
        seen = {(o.prompt, o.token_ids) for o in done if not o.resumes} | set(replay.items())
        novel = sum((o.prompt, o.token_ids) not in seen for o in resumed)
        report = {
            "scenario": "stall",
            "resume": mechanism,
            "workdir": str(mesh.workdir),
            "sla": sla(outcomes),
            "streams_lost": len(lost),
            "lost_by_status": _count(o.status for o in lost),
            "lost_details": sorted(_count(f"{o.status}: {o.detail}"[:160] for o in lost).items()),
            "resumed_streams": len(resumed),
            "resume_token_mismatches": mismatches,
            "unresumed_token_mismatches": control,
            "resumed_unlike_any_uninterrupted": novel,
            "streams_by_prompt": _variants(done, replay),
            "stalling_replica": {
                "streams_sent_in_phase_1": to_stalled,
                "phase_1_s": phase_s,
                "ejected_after_s": ejected_at,
            },
            "exiting_replica": {
                "phase_2_s": phase_2_s,
                "exited": not proc.alive(),
                "exit_code": proc.popen.poll() if proc.popen else None,
                "restarted_by_launcher": False,
            },
        }
        write_report(mesh.workdir, report)
        return report


def _watch_ejection(mesh: Any, t0: float, phase_s: float) -> float | None:
    """Seconds from the stall's start to the caller Envoy's first outlier ejection, if any."""
    regex = "outlier_detection.ejections_enforced_total"
    while time.monotonic() - t0 < phase_s:
        try:
            if sum(mesh.envoy_stats(mesh.caller_admin, regex).values()):
                at = round(time.monotonic() - t0, 1)
                time.sleep(max(0.0, phase_s - (time.monotonic() - t0)))
                return at
        except OSError:
            pass
        time.sleep(0.5)
    return None


def _host_requests(mesh: Any, port: int) -> int | None:
    """rq_total of one host of the caller Envoy's v1 cluster (its /clusters view)."""
    url = f"{mesh.caller_admin_url()}/clusters?format=json"
    with urllib.request.urlopen(url, timeout=5) as r:
        clusters = json.loads(r.read())["cluster_statuses"]
    for c in clusters:
        if c["name"] != CLUSTER:
            continue
        for h in c.get("host_statuses", []):
            if h["address"]["socket_address"].get("port_value") == port:
                stats = {s["name"]: int(s.get("value", 0)) for s in h.get("stats", [])}
                return stats.get("rq_total")
    return None


def _replay(port: int, outcomes: list[Any]) -> dict[str, tuple[int, ...]]:
    """Each prompt once more, straight to the healthy runtime, alone and without faults."""
    from model_runtime.serving.client import Client

    out = {}
    with Client(f"127.0.0.1:{port}") as c:
        for prompt in sorted({o.prompt for o in outcomes}):
            chat = [{"role": "user", "content": prompt}]
            chunks = c.generate(messages=chat, max_new_tokens=MAX_NEW_TOKENS, timeout=60)
            out[prompt] = tuple(int(t) for ch in chunks for t in ch.token_ids)
    return out


def _variants(done: list[Any], replay: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """Per prompt, each distinct token sequence the callers got: how many streams, how many of
    them resumed, and whether it is the replay's."""
    out = []
    for i, prompt in enumerate(sorted(replay)):
        seqs = Counter(o.token_ids for o in done if o.prompt == prompt)
        for ids, n in seqs.most_common():
            resumed = sum(
                1 for o in done if o.prompt == prompt and o.token_ids == ids and o.resumes
            )
            out.append(
                {"prompt": i, "streams": n, "resumed": resumed, "replay": ids == replay[prompt]}
            )
    return out


def _count(items: Any) -> dict[str, int]:
    return dict(Counter(items))
