"""Tenants' traffic for the demo: real gRPC Generate (or Info) calls through a caller-side
sidecar, open loop at a fixed rate per tenant, every outcome recorded by gRPC status. Generate
goes through the caller library (meshlm.client: stalled streams resume on another replica);
`resume=False` uses the bare client instead (what plain Envoy retries give). A load with
`api="openai"` streams chat completions with the `openai` SDK through the same sidecar (the
OpenAI HTTP API); its failures are recorded by the gRPC status their HTTP status
stands for (model_runtime/serving/openai_api.py's mapping), so a tenant's outcomes read alike."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mesh_common.headers import REPLICA_HEADER
from meshlm.client.caller import Caller
from meshlm.demo.sla import percentile
from model_runtime.serving.client import Client

SESSION_HEADER = "x-meshlm-session"  # examples/mesh.yaml's route.hash_policy header

PROMPTS = (
    "What is the capital of France? Answer with one word.",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What animal says moo?",
)


# HTTP status of an OpenAI call -> the gRPC status it stands for (openai_api.py answers these).
HTTP_AS_GRPC = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip


@dataclass(frozen=True)
class TenantLoad:
    name: str
    api_key: str
    rate: float  # requests per second, open loop
    method: str = "Generate"
    prompts: tuple[str, ...] = PROMPTS  # sent in turn
    api: str = "grpc"  # or "openai": streamed chat completions with the openai SDK
    # x-meshlm-session of each call, in turn beside `prompts` (gRPC only); empty: none sent
    sessions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    at: float  # monotonic time the open loop sent it (its latencies count from then)
    tenant: str
    status: str  # gRPC status code name, "OK" when the stream finished
    ttft_ms: float | None
    latency_ms: float
    prompt: str = ""
    token_ids: tuple[int, ...] = ()  # what the caller received
    resumes: int = 0
    detail: str = ""  # the error's details (never the prompt)
    replica: str = ""  # x-meshlm-replica of the replica that sent the first token
    queue_wait_ms: float | None = None  # as the runtime reported it with the first token
    server_ttft_ms: float | None = None  # the runtime's own TTFT (from the call's arrival)
    api: str = "grpc"


class Traffic:
    def __init__(
        self,
        target: str,
        loads: list[TenantLoad],
        *,
        authority: str,
        max_new_tokens: int = 8,
        resume: bool = True,
    ) -> None:
        self.loads = loads
        self.max_new_tokens = max_new_tokens
        kind = Caller if resume else Client
        grpc_loads = [t for t in loads if t.api == "grpc"]
        self.clients = {
            t.name: kind(target, api_key=t.api_key, authority=authority) for t in grpc_loads
        }
        self.openai = {t.name: _openai_client(target, t.api_key, authority) for t in loads
                       if t.api == "openai"}  # fmt: skip
        self.model = authority  # LocalMesh serves the model as the service's name
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # One worker per call in flight: at 5 calls/s and 10 s per call under overload, 50.
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="traffic")
        self._threads: list[threading.Thread] = []

    def start(self) -> Traffic:
        for load in self.loads:
            t = threading.Thread(target=self._pace, args=(load,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._pool.shutdown(wait=True)
        for c in [*self.clients.values(), *self.openai.values()]:
            c.close()

    def _pace(self, load: TenantLoad) -> None:
        n = 0
        start = time.monotonic()
        while not self._stop.is_set():
            due = start + n / load.rate
            session = load.sessions[n % len(load.sessions)] if load.sessions else ""
            self._pool.submit(self._call, load, load.prompts[n % len(load.prompts)], due, session)
            n += 1
            self._stop.wait(max(0.0, start + n / load.rate - time.monotonic()))

    def _call(self, load: TenantLoad, prompt: str, due: float, session: str = "") -> None:
        if load.api == "openai":
            self._openai_call(load, prompt, due)
            return
        client = self.clients[load.name]
        # Timed from when the open loop meant to send it: a call that waited for a free worker
        # counts that wait (else a slow mesh would slow the offered load and hide its latency).
        t0 = due
        ttft = None
        status, detail = "OK", ""
        ids: list[int] = []
        stream = None
        first = None
        try:
            if load.method == "Info":
                client.info(timeout=30)
            else:
                chat = [{"role": "user", "content": prompt}]
                meta = ((SESSION_HEADER, session),) if session else ()
                stream = client.generate(
                    messages=chat, max_new_tokens=self.max_new_tokens, timeout=60, metadata=meta
                )
                for chunk in stream:
                    if ttft is None and len(chunk.token_ids):
                        ttft = (time.monotonic() - t0) * 1000
                        first = chunk
                    ids.extend(int(t) for t in chunk.token_ids)
        except grpc.RpcError as e:
            status, detail = e.code().name, e.details() or ""
        latency = (time.monotonic() - t0) * 1000
        replicas = getattr(stream, "replicas", None)  # the caller library's streams only
        outcome = Outcome(
            t0, load.name, status, ttft, latency, prompt, tuple(ids),
            len(getattr(stream, "resumes", ())), detail, replicas[0] if replicas else "",
            None if first is None else first.queue_wait_us / 1000,
            None if first is None or first.ttft_us is None else first.ttft_us / 1000,
        )  # fmt: skip
        with self._lock:
            self.outcomes.append(outcome)

    def _openai_call(self, load: TenantLoad, prompt: str, due: float) -> None:
        """One streamed chat completion with the openai SDK; the serving replica from the
        response's x-meshlm-replica header."""
        import openai

        t0, ttft, status, detail, replica = due, None, "OK", "", ""
        try:
            raw = self.openai[load.name].chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_new_tokens,
                stream=True,
            )
            replica = raw.headers.get(REPLICA_HEADER, "")
            for event in raw.parse():
                if ttft is None and event.choices and event.choices[0].delta.content:
                    ttft = (time.monotonic() - t0) * 1000
        except openai.APIStatusError as e:
            status = HTTP_AS_GRPC.get(e.status_code, f"HTTP {e.status_code}")
            detail = str(e.code or "")
        except openai.APITimeoutError:
            status = "DEADLINE_EXCEEDED"
        except openai.APIError as e:  # the connection failed, or an error event mid-stream
            status, detail = "UNAVAILABLE", type(e).__name__
        latency = (time.monotonic() - t0) * 1000
        outcome = Outcome(
            t0, load.name, status, ttft, latency, prompt, detail=detail, replica=replica,
            api="openai",
        )  # fmt: skip
        with self._lock:
            self.outcomes.append(outcome)

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.at >= t]


def summarize(outcomes: list[Outcome], versions: dict[str, str] | None = None) -> dict:
    """Counts by tenant and status, TTFT p50/p99 of successful streams; with `versions`
    (replica id -> version) also the client's TTFT per version that answered, beside the
    runtime's own TTFT and queue wait for the same calls."""
    by_tenant: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_tenant.setdefault(o.tenant, Counter())[o.status] += 1
    ok = [o for o in outcomes if o.status == "OK" and o.ttft_ms is not None]
    out = {
        "requests": len(outcomes),
        "ok": sum(o.status == "OK" for o in outcomes),
        "by_tenant": {t: dict(c) for t, c in sorted(by_tenant.items())},
        "ttft_ms": _p50_p99([o.ttft_ms for o in ok]),
    }
    if versions is not None:
        out["by_version"] = _by_version(ok, versions)
        # The same per API: gRPC (FlatBuffers) and the OpenAI HTTP API through the same mesh.
        out["by_api"] = {
            api: {
                "requests": sum(o.api == api for o in outcomes),
                "ok": sum(o.api == api and o.status == "OK" for o in outcomes),
                "by_version": _by_version([o for o in ok if o.api == api], versions),
            }
            for api in sorted({o.api for o in outcomes})
        }
    return out


def _by_version(ok: list[Outcome], versions: dict[str, str]) -> dict[str, dict]:
    by_version: dict[str, list[Outcome]] = {}
    for o in ok:
        by_version.setdefault(versions.get(o.replica, "?"), []).append(o)
    return {
        v: {
            "count": len(calls),
            "ttft_ms": _p50_p99([o.ttft_ms for o in calls]),
            "server_ttft_ms": _p50_p99([o.server_ttft_ms for o in calls]),
            "queue_wait_ms": _p50_p99([o.queue_wait_ms for o in calls]),
        }
        for v, calls in sorted(by_version.items())
    }


def _openai_client(target: str, api_key: str, authority: str) -> Any:  # openai.OpenAI
    import openai  # the demo's OpenAI share only (in requirements.lock, which `make demo` installs)

    for name in ("httpx", "httpx2"):  # its HTTP client logs every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)

    return openai.OpenAI(
        base_url=f"http://{target}/v1",
        api_key=api_key,  # sent as Authorization: Bearer, which the sidecar's authz accepts
        max_retries=0,
        timeout=60,
        default_headers={"Host": authority},  # the caller sidecar routes by Host, as by :authority
    )


def write_calls(path: Path, outcomes: list[Outcome], versions: dict[str, str]) -> None:
    """One JSON line per call, in start order (seconds from the first call): when, who, how it
    ended and how long each part took. No prompt, no tokens."""
    rows = sorted(outcomes, key=lambda o: o.at)
    t0 = rows[0].at if rows else 0.0
    with path.open("w") as f:
        for o in rows:
            row = {
                "t_s": round(o.at - t0, 3), "tenant": o.tenant, "api": o.api, "status": o.status,
                "version": versions.get(o.replica), "replica": o.replica,
                "ttft_ms": _ms(o.ttft_ms), "server_ttft_ms": _ms(o.server_ttft_ms),
                "queue_wait_ms": _ms(o.queue_wait_ms), "latency_ms": _ms(o.latency_ms),
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def _p50_p99(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    return {"p50": percentile(vals, 50), "p99": percentile(vals, 99)}


def tenant_traffic(
    target: str, tenant: str, key: str, rate: float, tokens: int, prompts: Any = None
) -> Traffic:
    """One tenant's open-loop calls to the demo service at `target`, with the bare client: a
    caller that resumes slow streams elsewhere would hide what the runtime's scheduler did."""
    from meshlm.demo.launcher import SERVICE

    load = TenantLoad(tenant, key, rate=rate, prompts=prompts or PROMPTS)
    return Traffic(target, [load], authority=SERVICE, max_new_tokens=tokens, resume=False)
