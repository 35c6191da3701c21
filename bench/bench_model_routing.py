"""Routing by model name: what it costs the caller sidecar per call, in real Envoy under h2load.

One caller sidecar configured by the control plane (`build_server` + ADS, the outbound listener
with the classify filter and the routes by model) in front of an Envoy that answers every call
with an empty gRPC OK stream, so the figures are the caller sidecar's own. Two modelled
services (three names) share that upstream. Arms, all on the same caller Envoy, in interleaved
rounds (medians; cost over the baseline paired round by round, so drift cancels):

- gRPC Generate, `:authority` names the service, no model in the body: today's path;
- the same with `model` in the body: the filter reads it and sets x-meshlm-model, Host routes;
- `:authority` names no service, `model` in the body: routed by model (the RE2 header match);
- the same three over the OpenAI API (`/v1/chat/completions` JSON).

Caller access logs are off (`access_log: false`): they cost every arm alike and only add noise.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

from bench import h2load
from bench.machine import describe
from bench.sidecar_parts import grpc_ok_upstream
from mesh_common.ports import free_port
from schemas import codec
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

GEN = "/meshlm.inference.v1.Inference/Generate"
CHAT = "/v1/chat/completions"
ANSWERED = r"^http\.upstream\.rq_direct_response$"  # the gRPC OK upstream's replies
ROUTED = r"^cluster\.outbound\|small\|v1\.upstream_rq_total$"
NAMED = r"meshlm_classify\.model_named$"
MODEL = "smollm2-int4"
HOST = ":authority: small"
BASE, GRPC_NAMED, GRPC_ROUTED = (
    "gRPC, Host names the service, no model in the body",
    "gRPC, Host names the service, model in the body",
    "gRPC, no service in Host, routed by the body's model",
)
JSON_BASE, JSON_NAMED, JSON_ROUTED = (
    "OpenAI JSON, Host names the service, no model in the body",
    "OpenAI JSON, Host names the service, model in the body",
    "OpenAI JSON, no service in Host, routed by the body's model",
)
PAIRS = {GRPC_NAMED: BASE, GRPC_ROUTED: BASE, JSON_NAMED: JSON_BASE, JSON_ROUTED: JSON_BASE}


def _generate(model: str) -> bytes:
    req = codec.GenerateRequest(
        messages=[codec.ChatMessage(role="user", content="Name a colour.")],
        max_new_tokens=8,
        model=model,
    )
    return h2load.grpc_frame(codec.encode_generate_request(req))


def _chat(model: str | None) -> bytes:
    body: dict = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    if model:
        body["model"] = model
    return json.dumps(body).encode()


# arm -> (path, headers, body, whether the body names a model)
ARMS = {
    BASE: (GEN, (*h2load.GRPC_HEADERS, HOST), _generate(""), False),
    GRPC_NAMED: (GEN, (*h2load.GRPC_HEADERS, HOST), _generate(MODEL), True),
    GRPC_ROUTED: (GEN, h2load.GRPC_HEADERS, _generate(MODEL), True),
    JSON_BASE: (CHAT, ("content-type: application/json", HOST), _chat(None), False),
    JSON_NAMED: (CHAT, ("content-type: application/json", HOST), _chat(MODEL), True),
    JSON_ROUTED: (CHAT, ("content-type: application/json",), _chat(MODEL), True),
}


def main(quick: bool = False) -> str:
    h2load.h2load_path()  # fail first, with the install hint
    rounds, secs = (2, 1) if quick else (7, 3)
    clients, streams = 4, 8
    placed = h2load.cores()
    load_cpu, envoy_cpu = placed if placed else (None, None)
    load_at_start = os.getloadavg()
    sat: dict[str, list[h2load.Run]] = {a: [] for a in ARMS}
    with ExitStack() as stack:
        up_port, port = free_port(), free_port()
        upstream = stack.enter_context(EnvoyProcess(grpc_ok_upstream(up_port)))
        v1 = {"v1": {"endpoints": [f"127.0.0.1:{up_port}"]}}
        mesh = parse_mesh(
            {
                "services": {
                    "small": {"versions": v1, "model": MODEL, "aliases": ["smollm2-q4"]},
                    "dense": {"versions": v1, "model": "smollm2-bf16"},
                },
                "access_log": False,
            }
        )
        cp = stack.enter_context(build_server(mesh))
        boot = ads_bootstrap("caller", xds_address=("127.0.0.1", cp.grpc_port), outbound_port=port)
        caller = stack.enter_context(EnvoyProcess(boot))
        assert caller.proc is not None and upstream.proc is not None
        if envoy_cpu is not None:
            for e in (caller, upstream):
                h2load.pin(e.proc.pid, envoy_cpu)  # type: ignore[union-attr]

        def counted(envoy: EnvoyProcess, regex: str) -> int:
            return sum(envoy.stats(regex).values())

        def drive(arm: str, seconds: int) -> h2load.Run:
            path, headers, body, names_model = ARMS[arm]
            before = [counted(upstream, ANSWERED), counted(caller, ROUTED), counted(caller, NAMED)]
            r = h2load.run(
                f"http://127.0.0.1:{port}{path}",
                seconds=seconds,
                clients=clients,
                streams=streams,
                headers=headers,
                body=body,
                pids=[caller.proc.pid],  # type: ignore[union-attr]
                cpu=load_cpu,
            )
            after = [counted(upstream, ANSWERED), counted(caller, ROUTED), counted(caller, NAMED)]
            answered, routed, named = (a - b for a, b in zip(after, before, strict=True))
            if answered < r.succeeded or routed < r.succeeded:
                raise RuntimeError(f"{arm}: not every call went to service small's upstream")
            if (named >= r.succeeded) != names_model or (not names_model and named):
                raise RuntimeError(
                    f"{arm}: the filter named {named} models for {r.succeeded} calls"
                )
            return r

        for arm in ARMS:  # warm up the VM, the connections and the route cache
            drive(arm, 1)
        for _ in range(rounds):
            for arm in ARMS:
                sat[arm].append(drive(arm, secs))
    return _report(sat, rounds, secs, clients, streams, placed, quick, load_at_start)


def _report(
    sat: dict[str, list[h2load.Run]],
    rounds: int,
    secs: int,
    clients: int,
    streams: int,
    placed: tuple[int, int] | None,
    quick: bool,
    load_at_start: tuple[float, float, float],
) -> str:
    med = h2load.median

    def cpus(arm: str) -> list[float]:
        return [r.cpu_us_per_request(next(iter(r.cpu_s))) for r in sat[arm]]

    def diffs(arm: str) -> list[float]:
        return [a - b for a, b in zip(cpus(arm), cpus(PAIRS[arm]), strict=True)]

    rows = []
    for arm in ARMS:
        cs = cpus(arm)
        extra = "- | -"
        if arm in PAIRS:
            d = diffs(arm)
            extra = f"{med(d):+.1f} | {min(d):+.0f} to {max(d):+.0f}"
        rows.append(
            f"| {arm} | {med(r.rps for r in sat[arm]):,.0f} | {med(cs):.1f} "
            f"({min(cs):.0f}-{max(cs):.0f}) | {extra} |"
        )
    worst = max(med(diffs(a)) for a in PAIRS)
    cmd = "python -m bench model_routing" + (" --quick" if quick else "")
    pinning = (
        f"h2load pinned to core {placed[0]}, both Envoys to core {placed[1]} (sched_setaffinity)"
        if placed
        else "one core: h2load and Envoy share it (no pinning)"
    )
    load_end = os.getloadavg()
    return "\n".join(
        [
            "## Routing by model name: the caller sidecar's CPU per call",
            "",
            f"- Machine: {describe()}; load average {load_at_start[0]:.1f} at the start, "
            f"{load_end[0]:.1f} at the end.",
            f"- Command: `{cmd}` (needs h2load: `make bench-tools`).",
            "- What: one caller sidecar (Envoy 1.40, one worker) configured by the control plane "
            "over ADS (classify filter, routes by model; access logs off), in front of an Envoy "
            "that answers every call with an empty gRPC OK stream. Two modelled services, three "
            "names. Every call checked to reach service `small`'s cluster and the upstream.",
            f"- Load: h2load (nghttp2), HTTP/2 cleartext, {clients} connections x {streams} "
            f"streams, closed loop; {pinning}. {rounds} interleaved rounds of {secs} s per arm, "
            "medians. Caller CPU = the caller Envoy's utime+stime over the run / calls; the cost "
            "over the baseline is paired round by round (gRPC arms against the gRPC baseline, "
            "the OpenAI arms against the OpenAI baseline), then the median.",
            "",
            "| arm | calls/s at saturation | caller Envoy CPU us/call (range) "
            "| over its baseline, us (median) | rounds' differences, us |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
            f"**Routing by model adds at most {worst:+.1f} us of caller-sidecar CPU per call** "
            "(the goal: <= 10 us).",
            "",
        ]
    )
