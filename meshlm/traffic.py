"""Tenants' traffic for the demo: real gRPC Generate (or Info) calls through a caller-side
sidecar, open loop at a fixed rate per tenant, every outcome recorded by gRPC status. Generate
goes through the caller library (meshlm/caller.py: stalled streams resume on another replica);
`resume=False` uses the bare client instead (what plain Envoy retries give)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from meshlm.caller import Caller
from meshlm.sla import percentile
from model_runtime.client import Client

PROMPTS = (
    "What is the capital of France? Answer with one word.",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What animal says moo?",
)


@dataclass(frozen=True)
class TenantLoad:
    name: str
    api_key: str
    rate: float  # requests per second, open loop
    method: str = "Generate"
    prompts: tuple[str, ...] = PROMPTS  # sent in turn


@dataclass(frozen=True)
class Outcome:
    at: float  # monotonic start time
    tenant: str
    status: str  # gRPC status code name, "OK" when the stream finished
    ttft_ms: float | None
    latency_ms: float
    prompt: str = ""
    token_ids: tuple[int, ...] = ()  # what the caller received
    resumes: int = 0
    detail: str = ""  # the error's details (never the prompt)


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
        self.clients = {t.name: kind(target, api_key=t.api_key, authority=authority) for t in loads}
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="traffic")
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
        for c in self.clients.values():
            c.close()

    def _pace(self, load: TenantLoad) -> None:
        n = 0
        start = time.monotonic()
        while not self._stop.is_set():
            self._pool.submit(self._call, load, load.prompts[n % len(load.prompts)])
            n += 1
            self._stop.wait(max(0.0, start + n / load.rate - time.monotonic()))

    def _call(self, load: TenantLoad, prompt: str) -> None:
        client = self.clients[load.name]
        t0 = time.monotonic()
        ttft = None
        status, detail = "OK", ""
        ids: list[int] = []
        stream = None
        try:
            if load.method == "Info":
                client.info(timeout=30)
            else:
                chat = [{"role": "user", "content": prompt}]
                stream = client.generate(
                    messages=chat, max_new_tokens=self.max_new_tokens, timeout=60
                )
                for chunk in stream:
                    if ttft is None and len(chunk.token_ids):
                        ttft = (time.monotonic() - t0) * 1000
                    ids.extend(int(t) for t in chunk.token_ids)
        except grpc.RpcError as e:
            status, detail = e.code().name, e.details() or ""
        resumes = len(getattr(stream, "resumes", ()))
        latency = (time.monotonic() - t0) * 1000
        outcome = Outcome(t0, load.name, status, ttft, latency, prompt, tuple(ids), resumes, detail)
        with self._lock:
            self.outcomes.append(outcome)

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.at >= t]


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts by tenant and status, TTFT p50/p99 of successful streams."""
    by_tenant: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_tenant.setdefault(o.tenant, Counter())[o.status] += 1
    ttfts = sorted(o.ttft_ms for o in outcomes if o.ttft_ms is not None)
    return {
        "requests": len(outcomes),
        "ok": sum(o.status == "OK" for o in outcomes),
        "by_tenant": {t: dict(c) for t, c in sorted(by_tenant.items())},
        "ttft_ms": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
    }
