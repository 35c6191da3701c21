"""The engine: a scheduler thread that runs continuous batching over the paged KV cache.

Each loop iteration: apply cancels, admit waiting requests (highest priority first, then a fair
share of tokens per tenant: fair.py) while the adaptive batch limit, the per-tenant
stream limit and the KV pool allow, then one step: a decode row for every running sequence and a
chunk of the oldest prompt still prefilling, PREFILL_CHUNK tokens at most. With
`mixed_step=True` (stall-free batching) a chunk beside running streams is sized by the step
budget (budget.py, toward the TPOT target) and rides in the same forward as the decode rows, so
a long prompt never holds the streams for a whole chunk; where decode runs natively (the int4
step, which has its own arithmetic) the budgeted chunk is a call before the decode step. Off by
default: on 2 cores a batch-8 decode step is already compute-bound, so smaller chunks cut the
inter-token p99 about 3x but cost output tokens/s and the p50 (BENCHMARKS.md, serving).
Requests join and leave between steps; `Engine.steps` keeps each step's composition.
`static_batching=True` admits a batch only when the previous one has finished entirely (kept for
the benchmark's comparison).

Speculative decoding (`speculate_lookup=K`): a greedy stream drafts up to K tokens by prompt
lookup (speculate.py); the decode step checks every draft in the same forward, each
draft position as one more decode row of the batch (the kernels of plain decoding), and the
stream keeps the drafts the model's own argmax agrees with plus the model's next token. The K/V
of rejected drafts lie past `written` and are overwritten by the next step. Greedy output is the
same tokens as without drafts wherever batching leaves it the same (draft rows lengthen the
attention's padded length as a longer neighbour in the batch does).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from model_runtime.engine.budget import ChunkBudget
from model_runtime.engine.fair import FairQueue
from model_runtime.engine.kvcache import (
    BlockPool,
    SeqCache,
    block_keys,
    layout_decode,
    layout_mixed,
    layout_prefill,
)
from model_runtime.engine.omp import own_thread
from model_runtime.engine.sampling import generator_at, greedy_ids, sample
from model_runtime.engine.speculate import PromptLookup
from model_runtime.llm.model import KVCache


@dataclass
class GenerateParams:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop sequences (text)
    resume_ids: list[int] = field(default_factory=list)  # already delivered (a resumed stream)
    priority: int = 0  # higher first
    tenant: str = ""  # the verified tenant (fair share and per-tenant limits key on it)


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]
    text_delta: str
    finish_reason: str | None  # None while streaming; "stop" | "length" | "cancelled" | "error"
    queue_wait_s: float  # set on the first event
    ttft_s: float | None  # set on the first event that carries a token
    error: str | None = None
    shed: bool = False  # dropped from the queue under overload (the caller: RESOURCE_EXHAUSTED)


class EngineFull(Exception):
    """Admission control refused the request (queue full, shutting down)."""


class TasksFull(EngineFull, RuntimeError):
    """Engine.run refused a task: MAX_TASKS wait already."""


@dataclass
class _Request:
    rid: str
    params: GenerateParams
    on_event: Callable[[TokenEvent], None]
    submitted: float
    gen: torch.Generator | None
    detok: object
    cache: SeqCache = field(default_factory=SeqCache)
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    n_generated: int = 0
    pending: int | None = None  # sampled, not yet written to the KV cache
    first_event_sent: bool = False
    first_token_at: float | None = None
    admitted_at: float | None = None
    text: str = ""  # text produced but not yet emitted (held back for stop sequences)
    finished: bool = False
    seed: int = 0  # the base of every sampled token's generator (sampling.generator_at)
    n_resumed: int = 0  # tokens delivered before a resume (counted in n_generated)
    # resume ids not yet in the KV cache: each goes in by a decode step of its own, as it did in
    # the uninterrupted stream (a prefill computes them otherwise, so a near-tie could later
    # break the other way and the resumed stream differ from the one it resumes)
    forced: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None  # greedy streams when speculating


PREFILL_CHUNK = 256  # a prompt's chunk when no stream runs beside it
# the step time the chunk budget aims at when no TPOT target is set (the serving SLO's
# inter-token bound)
STEP_TARGET_S = 0.05
STEP_LOG = 512  # steps kept in Engine.steps


@dataclass(frozen=True)
class Step:
    """One iteration's forward work: which streams decoded and how many prompt tokens were
    prefilled beside them, in one forward (`fused`) or a chunk then a decode step."""

    decode: tuple[str, ...]  # request ids that got a decode row
    prefill: int  # prompt tokens prefilled
    prefill_rid: str | None
    fused: bool
    budget: int  # the budget's tokens (decode rows + chunk) when the chunk was chosen


_TPOT_WINDOW = 32
# Forwards outside the batch (Engine.run: a /score) stall every stream while they run: at most
# MAX_TASKS wait, one runs between two steps, and while streams run, tasks take at most
# TASK_SHARE of the engine's time (after a task of d seconds the next waits d / share - d).
MAX_TASKS = 4
TASK_SHARE = 0.25


class Engine:
    def __init__(
        self,
        loaded,
        *,
        max_batch: int = 8,
        kv_blocks: int | None = None,
        block_size: int = 16,
        max_queue: int = 64,
        tpot_target_ms: float | None = None,
        static_batching: bool = False,
        tenant_isolation: bool = True,
        tenant_max_streams: int | None = None,
        tenant_max_queued_tokens: int = 16384,
        slow_decode: float = 1.0,
        speculate_lookup: int = 0,
        mixed_step: bool = False,
    ):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        if tenant_max_streams is None:  # leave room for another tenant's call to start at once
            tenant_max_streams = max(1, max_batch * 3 // 4)
        if tenant_max_streams < 1 or tenant_max_queued_tokens < 1:
            raise ValueError("tenant_max_streams and tenant_max_queued_tokens must be >= 1")
        if not slow_decode >= 1.0:
            raise ValueError(f"slow_decode factor {slow_decode} must be >= 1")
        if speculate_lookup < 0:
            raise ValueError(f"speculate_lookup {speculate_lookup} must be >= 0 (0 = off)")
        self.loaded = loaded
        self.model = loaded.model
        self.tok = loaded.tokenizer
        self.ctx = loaded.info.context_length
        self.block_size = block_size
        if kv_blocks is None:
            kv_blocks = max(64, math.ceil(max_batch * 1280 / block_size))
        self.pool = BlockPool(kv_blocks, block_size)
        self.device = self.model.device
        # zero-filled on a thread of its own: not the caller's, which must keep no OpenMP pool
        # beside the engine's thread (omp.py)
        self.kv = own_thread(
            KVCache, self.model.args, kv_blocks * block_size, self.model.dtype, self.device
        )
        self.max_batch_limit = max_batch
        self.max_batch = max_batch  # adaptive, 1..max_batch_limit
        self.max_queue = max_queue
        self.tpot_target = None if tpot_target_ms is None else tpot_target_ms / 1000
        self.static = static_batching
        # Tenant isolation: fair share of tokens inside a priority class, per-tenant
        # limits, shedding of the lowest priority when the queue is full. Off: priority + FIFO.
        self.isolation = tenant_isolation
        self.tenant_max_streams = tenant_max_streams
        self.tenant_max_queued_tokens = tenant_max_queued_tokens
        self.slow_decode = slow_decode
        self.speculate_lookup = speculate_lookup  # most draft tokens per step (0 = off)
        # stall-free batching: a prompt's chunk, sized by the budget, in the step that decodes
        # every running stream (off: a chunk of PREFILL_CHUNK, then the decode step)
        self.mixed_step = mixed_step
        self.budget = ChunkBudget(self.tpot_target or STEP_TARGET_S)
        self.steps: collections.deque[Step] = collections.deque(maxlen=STEP_LOG)
        self._lock = threading.Condition()
        self._waiting = FairQueue(fair=tenant_isolation)
        self._cancels: set[str] = set()
        self._tasks: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._tasks_after = 0.0  # monotonic time before which no task runs beside streams
        self._known: dict[str, _Request] = {}
        self._prefilling: list[_Request] = []
        self._running: list[_Request] = []
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._tpot = collections.deque(maxlen=_TPOT_WINDOW)
        self._steps_since_adapt = 0
        self._batch_size = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.tokens_generated = 0
        self.requests_admitted = 0  # accepted by submit(), monotonic
        self.requests_finished = 0  # admitted and ended other than shed (ORCA rps)
        self.requests_shed = 0
        self.draft_tokens = 0  # drafted by prompt lookup and checked
        self.draft_accepted = 0  # of those, equal to the model's own choice
        self._step_tokens = 0  # tokens the last decode step emitted (TPOT per token)

    # ---- public API (any thread) ----

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="meshlm-engine", daemon=True)
            self._thread.start()

    def submit(
        self, request_id: str, params: GenerateParams, on_event: Callable[[TokenEvent], None]
    ) -> None:
        self._validate(params)
        gen = torch.Generator() if params.temperature > 0 else None
        req = _Request(request_id, params, on_event, time.monotonic(), gen, self.tok.detokenizer())
        req.seed = params.seed if params.seed is not None else secrets.randbits(64)
        req.tokens = list(params.prompt_ids)
        req.forced = list(params.resume_ids)
        if self.speculate_lookup and params.temperature <= 0:
            req.lookup = PromptLookup()
        if params.resume_ids and self._replay(req):
            return
        with self._lock:
            if not self._accepting:
                raise EngineFull("engine is shutting down and admits no new requests")
            if request_id in self._known:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            cost = len(params.prompt_ids) + params.max_new_tokens
            if self.isolation and params.tenant:  # untenanted: a direct call, global limits only
                self._check_tenant(params, cost)
            victim = None
            if len(self._waiting) >= self.max_queue:
                victim = None
                if self.isolation:
                    victim = self._waiting.victim_for(params.priority, params.tenant, cost)
                if victim is None:
                    raise EngineFull(
                        f"queue full: {len(self._waiting)} requests waiting (max_queue "
                        f"{self.max_queue}), {len(self._running) + len(self._prefilling)} "
                        f"running; none waiting has a priority below this one's "
                        f"({params.priority}) nor is another tenant's backlog larger"
                    )
                self._waiting.pop(victim[0], served=False)
            self._known[request_id] = req
            self._waiting.push(req, params.tenant, params.priority, cost)
            self.requests_admitted += 1
            self._lock.notify_all()
        if victim is not None:
            self._shed(victim[0].request, victim[1])

    def run(self, fn: Callable[[], Any], timeout: float | None = 120.0) -> Any:
        """`fn()` on the engine's thread between two steps, its result or its exception: a
        forward outside the batch (a /score, serving/records.py) never runs on the model beside
        a prefill or decode step. Inline where no engine thread runs. RuntimeError once the
        engine stops; TasksFull (a RuntimeError) at once when MAX_TASKS wait already;
        TimeoutError if it has not started `fn` within `timeout` seconds."""
        fut: Future = Future()
        with self._lock:
            if self._stop:
                raise RuntimeError("the engine has stopped")
            if self._thread is None:
                inline = True
            elif len(self._tasks) >= MAX_TASKS:
                raise TasksFull(
                    f"engine tasks: {len(self._tasks)} wait already (at most {MAX_TASKS}, one "
                    "runs between two decode steps); try again later"
                )
            else:
                inline = False
                self._tasks.append((fn, fut))
                self._lock.notify_all()
        if inline:
            with torch.inference_mode():
                return fn()
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()  # not started yet: the engine skips it
            raise

    def _run_tasks(self) -> None:
        """One waiting task, unless streams run and the tasks' share of time is spent."""
        busy = bool(self._running or self._prefilling)
        if busy and time.monotonic() < self._tasks_after:
            return
        while True:
            with self._lock:
                if not self._tasks:
                    return
                fn, fut = self._tasks.popleft()
            if fut.set_running_or_notify_cancel():  # else cancelled by run()'s timeout
                break
        t0 = time.monotonic()
        try:
            fut.set_result(fn())
        except BaseException as e:  # the caller gets it; the engine goes on
            fut.set_exception(e)
        now = time.monotonic()
        self._tasks_after = now + (now - t0) * (1 / TASK_SHARE - 1)

    def _fail_tasks(self) -> None:
        with self._lock:
            tasks, self._tasks = list(self._tasks), collections.deque()
        for _, fut in tasks:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine has stopped"))

    def _check_tenant(self, params: GenerateParams, cost: int) -> None:
        queued = self._waiting.queued_tokens(params.tenant)
        if queued + cost > self.tenant_max_queued_tokens:
            raise EngineFull(
                f"tenant queue full: tenant {params.tenant or '(none)'!r} has {queued} tokens "
                f"queued and this call asks for {cost} (tenant_max_queued_tokens "
                f"{self.tenant_max_queued_tokens})"
            )

    def _shed(self, req: _Request, why: str) -> None:
        self.requests_shed += 1
        msg = f"shed under overload: queue full (max_queue {self.max_queue}); {why}"
        waited = time.monotonic() - req.submitted
        ev = TokenEvent(req.rid, [], "", "error", waited, None, msg, shed=True)
        req.first_event_sent = True
        try:
            req.on_event(ev)
        finally:
            req.finished = True
            with self._lock:
                self._known.pop(req.rid, None)
                self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Frees the request's KV blocks and emits finish_reason "cancelled" (no-op if done)."""
        with self._lock:
            if request_id not in self._known:
                return
            self._cancels.add(request_id)
            self._lock.notify_all()
            if threading.current_thread() is self._thread or self._thread is None:
                return
            self._lock.wait_for(lambda: request_id not in self._known or self._stop, timeout=5)

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        with self._lock:
            self._accepting = False
            self._lock.notify_all()
            self._lock.wait_for(lambda: not self._known, timeout=drain_timeout)
            self._cancels.update(self._known)
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        else:
            self._apply_cancels()

    def stats(self) -> dict:
        with self._lock:
            tp = sorted(self._tpot)
            return {
                "queue_depth": len(self._waiting),
                "running": len(self._running) + len(self._prefilling),
                "batch_size": self._batch_size,
                "max_batch": self.max_batch,
                "kv_blocks_used": self.pool.used(),
                "kv_blocks_cached": self.pool.cached(),
                "kv_blocks_total": self.pool.n_blocks,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_query_tokens": self.prefix_query_tokens,
                "nonfinite_fallbacks": self.loaded.guard.fallbacks if self.loaded.guard else 0,
                "tokens_generated": self.tokens_generated,
                "requests_admitted": self.requests_admitted,
                "requests_finished": self.requests_finished,
                "requests_shed": self.requests_shed,
                "draft_tokens": self.draft_tokens,
                "draft_accepted": self.draft_accepted,
                "tenants": self._tenant_stats(),
                "tpot_p95_ms": 1000 * tp[int(0.95 * (len(tp) - 1))] if tp else None,
            }

    def _tenant_stats(self) -> dict[str, dict[str, int]]:
        """Running streams and queued tokens per tenant that has either (caller holds the lock)."""
        out: dict[str, dict[str, int]] = {}
        for r in (*tuple(self._running), *tuple(self._prefilling)):
            t = out.setdefault(r.params.tenant, {"running": 0, "queued_tokens": 0})
            t["running"] += 1
        for e in self._waiting.ordered():
            t = out.setdefault(e.tenant, {"running": 0, "queued_tokens": 0})
            t["queued_tokens"] += e.cost
        return out

    # ---- validation ----

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _validate(self, p: GenerateParams) -> None:
        if not p.prompt_ids:
            raise ValueError("prompt_ids: empty prompt")
        v = self.model.args.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= v for t in p.prompt_ids):
            raise ValueError(f"prompt_ids: token ids must be integers in [0, {v})")
        if len(p.prompt_ids) >= self.ctx:
            raise ValueError(
                f"prompt_ids: prompt of {len(p.prompt_ids)} tokens leaves no room in the "
                f"context length {self.ctx}"
            )
        if p.max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        if len(p.resume_ids) > p.max_new_tokens:
            raise ValueError(
                f"resume_token_ids: {len(p.resume_ids)} ids already delivered exceed "
                f"max_new_tokens {p.max_new_tokens}"
            )
        if any(not isinstance(t, int) or t < 0 or t >= v for t in p.resume_ids):
            raise ValueError(f"resume_token_ids: token ids must be integers in [0, {v})")
        if len(p.prompt_ids) + len(p.resume_ids) >= self.ctx:
            raise ValueError(
                f"resume_token_ids: {len(p.resume_ids)} ids after a prompt of "
                f"{len(p.prompt_ids)} tokens leave no room in the context length {self.ctx}"
            )
        if not (p.temperature >= 0 and math.isfinite(p.temperature)):
            raise ValueError("temperature: must be a finite number >= 0")
        if not 0 < p.top_p <= 1:
            raise ValueError("top_p: must be in (0, 1]")
        if p.top_k < 0:
            raise ValueError("top_k: must be >= 0")
        if any(not isinstance(s, str) or not s for s in p.stop):
            raise ValueError("stop: stop sequences must be non-empty strings")
        need = self._blocks_for(min(len(p.prompt_ids) + p.max_new_tokens, self.ctx))
        if need > self.pool.n_blocks:
            raise ValueError(
                f"max_new_tokens: prompt + max_new_tokens need {need} KV blocks, the pool has "
                f"{self.pool.n_blocks} in all"
            )

    # ---- scheduler thread ----

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    self._lock.wait_for(
                        lambda: (
                            self._stop
                            or self._cancels
                            or self._running
                            or self._prefilling
                            or self._waiting
                            or self._tasks
                        )
                    )
                    stopped = self._stop and not self._cancels
                if stopped:
                    self._fail_tasks()
                    return
                try:
                    self._iteration()
                except Exception as e:  # a scheduler bug fails the requests, not the thread
                    for r in [*self._prefilling, *self._running]:
                        self._finish(r, "error", error=f"engine: {type(e).__name__}: {e}")
                with self._lock:
                    if self._waiting and not (self._running or self._prefilling):
                        # blocked on KV blocks with nothing running cannot happen (validated),
                        # but never spin: wait for a change
                        self._lock.wait(timeout=0.01)

    def _iteration(self) -> None:
        self._run_tasks()
        self._apply_cancels()
        self._admit()
        t0 = time.monotonic()
        busy = bool(self._running)
        reqs = list(self._running)
        pre = self._prefilling[0] if self._prefilling else None
        n, budget, left, native = 0, 0, 0, False
        mixed = bool(pre is not None and reqs and self.mixed_step)
        if mixed:
            native = self.model.decodes_natively()
        if pre is not None:
            left = len(pre.tokens) - pre.cache.written
            n = min(PREFILL_CHUNK, left)
            if mixed:
                budget = int(self.budget.tokens)
                n = self.budget.chunk(len(reqs), left)
        fused = mixed and not native
        per_stream = 1.0  # tokens each stream got from the decode step (speculation: more)
        self._step_tokens = 0
        if fused:
            self._guarded([*reqs, pre], lambda _: self._mixed_step(reqs, pre, n))
        else:
            if pre is not None:
                self._guarded([pre], lambda _: self._prefill_step(pre, n))
            if reqs:
                t1 = time.monotonic()
                self._guarded(reqs, self._decode_step)
                if self.slow_decode > 1.0:  # fault: --fault-slow-decode
                    time.sleep((time.monotonic() - t1) * (self.slow_decode - 1.0))
        if reqs:
            per_stream = max(1.0, self._step_tokens / len(reqs))
        dt = time.monotonic() - t0
        if pre is not None:
            self.steps.append(Step(tuple(r.rid for r in reqs), n, pre.rid, fused, budget))
            if mixed and n < left:  # a chunk the prompt's end cut short
                self.budget.observe(len(reqs) + n, dt)  # says nothing of the budget
        if busy:
            self._record_tpot(dt / per_stream)

    def _guarded(self, reqs: list[_Request], step: Callable) -> None:
        try:
            step(reqs)
        except Exception as e:  # a failing step ends its requests, never the engine
            for r in reqs:
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")

    def _apply_cancels(self) -> None:
        with self._lock:
            ids, self._cancels = self._cancels, set()
            if not ids:
                return
            waiting = self._waiting.remove_requests(lambda r: r.rid in ids)
        for r in waiting:
            self._finish(r, "cancelled")
        for r in [*self._prefilling, *self._running]:
            if r.rid in ids:
                self._finish(r, "cancelled")

    def _admit(self) -> None:
        with self._lock:
            if self.static and (self._running or self._prefilling):
                return
            while self._waiting and len(self._running) + len(self._prefilling) < self.max_batch:
                entry = self._waiting.first(self._may_start)
                if entry is None:
                    break  # every waiting tenant is at its stream limit
                req = entry.request
                p = req.params
                total = min(len(p.prompt_ids) + p.max_new_tokens, self.ctx)
                context = [*req.tokens, *req.forced]  # the prompt and any resume ids
                hit = self.pool.match_prefix(block_keys(context, self.block_size))
                if len(hit) * self.block_size >= len(context):
                    hit = hit[:-1]  # the last token is always computed (its logits)
                need = self._blocks_for(total) - len(hit)
                if need > self.pool.available() - self.pool.unreferenced(hit):
                    break  # wait for blocks to be freed
                self._waiting.pop(entry)
                self.pool.acquire(hit)
                req.cache.blocks = hit + self.pool.allocate(need)
                req.cache.written = len(hit) * self.block_size
                req.cache.registered = len(hit)
                self.prefix_hit_tokens += req.cache.written
                self.prefix_query_tokens += len(context)
                req.admitted_at = time.monotonic()
                cached = req.cache.written - len(req.tokens)  # resume ids already in the cache
                if cached < 0:
                    self._prefilling.append(req)
                    continue
                # The prompt is cached whole (a resume here): on from the cache by decode steps.
                req.tokens += req.forced[:cached]
                del req.forced[:cached]
                self._force(req)
                self._running.append(req)

    def _may_start(self, entry) -> bool:
        if not self.isolation or not entry.tenant:
            return True
        mine = sum(r.params.tenant == entry.tenant for r in (*self._running, *self._prefilling))
        return mine < self.tenant_max_streams

    def _prefill_step(self, req: _Request, n: int) -> None:
        start = req.cache.written
        lay = layout_prefill(req.cache, start, n, self.block_size).to(self.device)
        tokens = torch.tensor([req.tokens[start : start + n]], device=self.device)
        self._prefilled(req, n, self.model(tokens, self.kv, lay)[0])

    def _prefilled(self, req: _Request, n: int, logits: torch.Tensor) -> None:
        """`n` more prompt tokens of `req` are in the cache; `logits`: its last one's."""
        c = req.cache
        c.written += n
        self._register_full_blocks(req)
        if c.written == len(req.tokens):  # the prompt: nothing sampled yet
            self._prefilling.remove(req)
            self._running.append(req)
            if req.forced:
                self._force(req)
            else:
                self._accept_token(req, logits.cpu())

    def _mixed_step(self, reqs: list[_Request], pre: _Request, n: int) -> None:
        """One forward: a decode row of every running stream and `n` of `pre`'s prompt tokens
        (no speculative drafts in it: the prompt's chunk takes their place)."""
        self._batch_size = len(reqs)
        start = pre.cache.written
        lay = layout_mixed([r.cache for r in reqs], pre.cache, start, n, self.block_size)
        ids = [*(r.pending for r in reqs), *pre.tokens[start : start + n]]
        logits = self.model(torch.tensor([ids], device=self.device), self.kv, lay.to(self.device))
        self._decoded(reqs, [[] for _ in reqs], logits[: len(reqs)])
        self._prefilled(pre, n, logits[len(reqs)])

    def _decode_step(self, reqs: list[_Request]) -> None:
        self._batch_size = len(reqs)
        drafts = [self._draft(r, len(reqs)) for r in reqs]
        seqs, tokens = [], []
        for r, d in zip(reqs, drafts, strict=True):
            seqs.append(r.cache)
            tokens.append(r.pending)
            for j, t in enumerate(d):  # draft j is one more decode row, at position written+j+1
                seqs.append(dataclasses.replace(r.cache, written=r.cache.written + j + 1))
                tokens.append(t)
        lay = layout_decode(seqs, self.block_size).to(self.device)
        logits = self.model(torch.tensor(tokens, device=self.device).view(-1, 1), self.kv, lay)
        self._decoded(reqs, drafts, logits)

    def _decoded(self, reqs: list[_Request], drafts: list[list[int]], logits: torch.Tensor):
        """Take each stream's token(s) from a decode step's `logits` (its rows, then its
        drafts' rows, in `reqs` order)."""
        greedy = greedy_ids(logits)
        if any(r.params.temperature > 0 for r in reqs):
            logits = logits.cpu()
        row = 0
        for r, d in zip(reqs, drafts, strict=True):
            accepted = 0
            for j in range(len(d) + 1):  # row + j: the model's choice after draft j - 1
                r.cache.written += 1  # the K/V of the token before this choice is kept
                self._register_full_blocks(r)
                if r.forced:  # a resume id: the caller has it, the cache takes it next
                    self._force(r)
                    break
                sampled = r.params.temperature > 0
                chosen = None if sampled else greedy[row + j]
                self._accept_token(r, logits[row + j], chosen)
                self._step_tokens += 1
                if r.finished or j == len(d) or chosen != d[j] or r.rid in self._cancels:
                    break
                accepted += 1
            if r.lookup is not None:
                r.lookup.feedback(len(d), accepted)
            self.draft_tokens += len(d)
            self.draft_accepted += accepted
            row += len(d) + 1

    def _draft(self, r: _Request, batch: int) -> list[int]:
        """Prompt-lookup drafts for a greedy stream, no more than it can still emit."""
        if r.lookup is None or r.forced:
            return []
        room = min(
            self.speculate_lookup,
            r.params.max_new_tokens - r.n_generated - 1,  # the step emits drafts + 1 at most
            self.ctx - len(r.tokens) - 1,
        )
        return r.lookup.draft(r.tokens, room, batch)

    def _register_full_blocks(self, req: _Request) -> None:
        c = req.cache
        full = c.written // self.block_size
        if full > c.registered:
            keys = block_keys(req.tokens[: full * self.block_size], self.block_size)
            for i in range(c.registered, full):
                self.pool.register(c.blocks[i], keys[i])
            c.registered = full

    def _force(self, req: _Request) -> None:
        """The next resume id is the stream's next token (already delivered: not emitted)."""
        token = req.forced.pop(0)
        req.tokens.append(token)
        req.pending = token

    def _accept_token(self, req: _Request, logits: torch.Tensor, chosen: int | None = None):
        p = req.params
        if chosen is None:
            gen = None if req.gen is None else generator_at(req.gen, req.seed, req.n_generated)
            chosen = sample(logits, p.temperature, p.top_k, p.top_p, gen)
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
        self.tokens_generated += 1
        req.n_generated += 1
        if chosen in self.tok.stop_ids:
            self._finish(req, "stop")
            return
        req.tokens.append(chosen)
        req.pending = chosen
        out, reason = self._text_after(req, chosen)
        self._emit(req, [chosen], out, reason)
        if reason is not None:
            self._release(req)

    def _text_after(self, req: _Request, token: int) -> tuple[str, str | None]:
        """Advance the stream's text by `token` (already counted in n_generated and tokens):
        the text delta to send with it, and the finish reason if it ends the stream."""
        p = req.params
        req.text += req.detok.push([token])
        reason = None
        if p.stop:
            hit = min((i for i in (req.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if hit >= 0:
                req.text = req.text[:hit]
                reason = "stop"
        if reason is None and req.n_generated >= p.max_new_tokens:
            reason = "length"
        if reason is None and len(req.tokens) >= self.ctx:
            reason = "length"
        if reason is not None:
            if reason == "length":
                req.text += req.detok.flush()
            out, req.text = req.text, ""
            return out, reason
        hold = max((len(s) - 1 for s in p.stop), default=0)
        out = req.text[: max(0, len(req.text) - hold)]
        req.text = req.text[len(out) :]
        return out, None

    def _replay(self, req: _Request) -> bool:
        """Resume: run the ids the caller already got through the text state, so
        the resumed stream's deltas are exactly what the uninterrupted stream's would have been
        from there (no byte or space lost at the boundary; stop sequences match across it).
        True if those ids had already ended the stream: the final event is sent, nothing runs.
        """
        for token in req.params.resume_ids:
            req.n_generated += 1
            _, reason = self._text_after(req, token)
            if reason is not None:
                req.finished = True
                self._emit(req, [], "", reason)
                return True
        req.n_resumed = req.n_generated
        return False

    def _emit(self, req: _Request, ids: list[int], text: str, reason: str | None, error=None):
        first = not req.first_event_sent
        req.first_event_sent = True
        qw = (req.admitted_at or time.monotonic()) - req.submitted if first else 0.0
        ttft = None
        if ids and req.first_token_at is not None and req.n_generated == req.n_resumed + 1:
            ttft = req.first_token_at - req.submitted
        ev = TokenEvent(req.rid, ids, text, reason, qw, ttft, error)
        try:
            req.on_event(ev)
        except Exception:  # a broken consumer must not take the engine down
            if reason is None:
                with self._lock:
                    self._cancels.add(req.rid)

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        if req.finished:
            return
        text = req.text + (req.detok.flush() if reason == "stop" else "")
        req.text = ""
        self._emit(req, [], text, reason, error)
        self._release(req)

    def _release(self, req: _Request) -> None:
        req.finished = True
        if req in self._running:
            self._running.remove(req)
        if req in self._prefilling:
            self._prefilling.remove(req)
        if req.cache.blocks:
            self.pool.release(req.cache.blocks)
            req.cache.blocks = []
        with self._lock:
            if self._known.pop(req.rid, None) is not None:
                self.requests_finished += 1
            self._lock.notify_all()

    def _record_tpot(self, dt: float) -> None:
        with self._lock:
            self._tpot.append(dt)
        if self.tpot_target is None or self.static:
            return
        self._steps_since_adapt += 1
        if self._steps_since_adapt < 8 or len(self._tpot) < 8:
            return
        self._steps_since_adapt = 0
        tp = sorted(self._tpot)
        p95 = tp[int(0.95 * (len(tp) - 1))]
        if p95 > 1.2 * self.tpot_target and self.max_batch > 1:
            self.max_batch -= 1
            self._tpot.clear()
        elif (
            p95 < 0.8 * self.tpot_target
            and self.max_batch < self.max_batch_limit
            and self._batch_size >= self.max_batch  # grow only when the limit is what binds
        ):
            self.max_batch += 1
            self._tpot.clear()
