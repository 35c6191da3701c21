"""What greedy calls produced, per request id, for the quality-gated canary.

A bounded LRU: request id -> the prompt's token ids (kept in memory only, never served) and the
generated token ids. The control plane joins the stable's and the canary's records by id and asks
the canary to score the stable's tokens (teacher-forced, one prefill), so the prompt never leaves
the runtime. Only greedy (temperature 0), complete, non-resumed calls are recorded: a sampled or
partial answer says nothing about agreement. A mirrored copy (`x-meshlm-shadow: 1`, set by the
canary's sidecar) is recorded with `shadow: true`. Each record gets a sequence number, monotonic
in this process (`instance` names the process: a new one restarts the sequence), so the control
plane polls only what is new.

The key is the call's body `request_id` (a mirrored call carries the same body, and a replay sets
it), else the `x-request-id` header Envoy sends (and copies to a mirror's shadow).

Served on the runtime's loopback metrics port (telemetry.py MetricsServer):
    GET /records?ids=a,b[&shadow=1|0]     {"instance": ..., "records": {id: RECORD}}
    GET /records?since=SEQ[&shadow=1|0]   {"instance": ..., "records": {id: RECORD} (seq > SEQ,
                                           ascending, at most MAX_IDS), "next_since": the SEQ to
                                           ask next, "more": whether more matched than were sent}
        RECORD = {"seq": n, "shadow": bool, "token_ids": [...], "finish_reason": "stop"|"length"}
    GET /score?request_id=a&token_ids=1,2,3   {"logprobs": [...], "argmax": [...]}
/score's forward runs on the engine's thread between two steps (Engine.run), never beside one;
every stream waits while it runs, so it is bounded: prompt + token_ids of at most
SCORE_MAX_FORWARD_TOKENS (400 beyond), and the engine's own bounds on waiting tasks (503 when
full) and on their share of its time.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

DEFAULT_CAPACITY = 1024
MAX_IDS = 256  # ids per /records query
MAX_SCORE_TOKENS = 8192  # a GET line of ~16 KB at most
SCORE_MAX_FORWARD_TOKENS = 2048  # prompt + continuation in one /score forward


@dataclass(frozen=True)
class Record:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    seq: int = 0
    shadow: bool = False

    def view(self) -> dict[str, Any]:
        """What /records serves (never the prompt)."""
        return {
            "seq": self.seq,
            "shadow": self.shadow,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
        }


class Records:
    """Thread-safe; `model` (set once a model serves) scores continuations, on the thread of
    `engine` (its `run(fn)`) when one is set."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, max_forward_tokens: int = SCORE_MAX_FORWARD_TOKENS
    ) -> None:
        if capacity < 1:
            raise ValueError(f"records capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self.max_forward_tokens = max_forward_tokens
        self.model: Any = None
        self.engine: Any = None
        self.instance = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Record] = OrderedDict()  # ascending seq
        self._seq = 0

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        token_ids: list[int],
        finish: str,
        *,
        shadow: bool = False,
    ) -> None:
        if not request_id:
            return
        with self._lock:
            self._seq += 1
            rec = Record(tuple(prompt_ids), tuple(token_ids), finish, self._seq, shadow)
            self._items[request_id] = rec
            self._items.move_to_end(request_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, request_id: str) -> Record | None:
        with self._lock:
            return self._items.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def since(
        self, seq: int, shadow: bool | None = None, limit: int = MAX_IDS
    ) -> tuple[list[tuple[str, Record]], int, bool]:
        """Records with a seq above `seq` (ascending, at most `limit`), the seq to ask from
        next time, and whether more matched than were returned."""
        out: list[tuple[str, Record]] = []
        with self._lock:
            for rid, rec in self._items.items():
                if rec.seq <= seq or (shadow is not None and rec.shadow != shadow):
                    continue
                if len(out) == limit:
                    return out, out[-1][1].seq, True
                out.append((rid, rec))
            return out, max(seq, self._seq), False

    def score(self, request_id: str, token_ids: list[int]) -> dict[str, list]:
        """Log-probabilities of `token_ids` after the prompt recorded under `request_id`, and the
        model's own greedy choice at each position (both teacher-forced, one forward pass)."""
        rec = self.get(request_id)
        if rec is None:
            raise KeyError(request_id)
        if self.model is None:
            raise RuntimeError("no model is serving yet")
        room = self.model.args.context_length - len(rec.prompt_ids)
        if len(token_ids) > room:
            raise ValueError(f"token_ids: {len(token_ids)} ids overrun the context ({room} left)")
        if len(rec.prompt_ids) + len(token_ids) > self.max_forward_tokens:
            raise ValueError(
                f"token_ids: the prompt's {len(rec.prompt_ids)} tokens and {len(token_ids)} ids "
                f"pass the {self.max_forward_tokens} tokens one /score may run (a forward that "
                "pauses every stream)"
            )
        model, prompt = self.model, list(rec.prompt_ids)
        if self.engine is None:
            return teacher_forced(model, prompt, token_ids)
        return self.engine.run(lambda: teacher_forced(model, prompt, token_ids))

    # --- the HTTP pages (GET only, loopback) ------------------------------------------------

    def page(self, path: str, query: str) -> tuple[int, bytes]:
        """(HTTP status, JSON body) for /records and /score; bad input answers 400 naming it."""
        q = parse_qs(query)
        try:
            if path == "/records":
                return self._records_page(q)
            # /score
            rid = (q.get("request_id") or [""])[0]
            if not rid:
                return _err(400, "request_id: expected ?request_id=ID")
            tokens = _token_ids((q.get("token_ids") or [""])[0])
            vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
            if vocab is not None and any(t >= vocab for t in tokens):
                return _err(400, f"token_ids: every id must be < the vocabulary size {vocab}")
            try:
                return 200, json.dumps(self.score(rid, tokens)).encode()
            except KeyError:
                return _err(404, f"request_id: no record of {rid!r} (greedy calls only; LRU)")
            except (RuntimeError, TimeoutError) as e:  # no model yet; the engine stopped
                return _err(503, str(e))
        except ValueError as e:
            return _err(400, str(e))

    def _records_page(self, q: dict[str, list[str]]) -> tuple[int, bytes]:
        shadow = _flag(q, "shadow")
        ids = [i for v in q.get("ids", []) for i in v.split(",") if i]
        body: dict[str, Any] = {"instance": self.instance}
        if "since" in q:
            if ids:
                return _err(400, "ids: give either ?ids= or ?since=, not both")
            raw = q["since"][0]
            if not raw.isdigit():
                return _err(400, f"since: expected a record seq >= 0, got {raw[:40]!r}")
            found, body["next_since"], body["more"] = self.since(int(raw), shadow)
        elif ids:
            if len(ids) > MAX_IDS:
                return _err(400, f"ids: at most {MAX_IDS} per query, got {len(ids)}")
            got = ((i, self.get(i)) for i in ids)
            found = [(i, r) for i, r in got if r and (shadow is None or r.shadow == shadow)]
        else:
            return _err(400, "ids: expected ?ids=ID[,ID...] or ?since=SEQ")
        body["records"] = {i: r.view() for i, r in found}
        return 200, json.dumps(body).encode()


def _flag(q: dict[str, list[str]], name: str) -> bool | None:
    raw = (q.get(name) or [""])[0].lower()
    if raw == "":
        return None
    if raw not in ("0", "1", "true", "false"):
        raise ValueError(f"{name}: expected 1 or 0, got {raw[:40]!r}")
    return raw in ("1", "true")


def _token_ids(raw: str) -> list[int]:
    try:
        ids = [int(t) for t in raw.split(",") if t != ""]
    except ValueError:
        raise ValueError(
            f"token_ids: expected comma-separated integers, got {raw[:40]!r}"
        ) from None
    if not ids or len(ids) > MAX_SCORE_TOKENS or any(t < 0 for t in ids):
        raise ValueError(f"token_ids: expected 1..{MAX_SCORE_TOKENS} ids >= 0")
    return ids


def _err(status: int, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": message}).encode()


def teacher_forced(model: Any, prompt_ids: list[int], token_ids: list[int]) -> dict[str, list]:
    """One prefill of prompt + continuation: each continuation token's log-probability and the
    argmax the model would have chosen there. Outside the engine (no KV cache, no slot)."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([prompt_ids + token_ids], device=model.device)
        logits = model(x, all_logits=True)[0, len(prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(token_ids, device=logp.device)
        chosen = logp.gather(1, target.view(-1, 1)).view(-1)
        return {"logprobs": chosen.tolist(), "argmax": logp.argmax(dim=-1).tolist()}
