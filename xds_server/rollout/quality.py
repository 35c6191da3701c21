"""The quality gate of a canary rollout: does the canary say what the stable says?

Replay mode: each analysis interval, after the traffic gates' counters were read, the control plane
sends a golden prompt set through a caller sidecar (`replay_via`, authority = the service) twice,
greedy: once pinned to the stable (`x-canary: never`), once to the canary (`always`). Each call
carries a request id in its body; the runtimes keep what greedy calls produced under it
(model_runtime/serving/records.py), so the control plane finds the record on whichever replica
served it and asks that runtime to score the stable's tokens (teacher-forced, one prefill). Per
interval:

- exact_match_rate: the share of prompts whose two answers are identical;
- first_divergence: the mean position of the first differing token, over answers that differ;
- token_disagreement: the share of positions of the stable's answer where the canary's choice
  differs from the stable's, both teacher-forced on the stable's prefix (one early divergence
  does not count every later token; both choices come from the same kind of forward pass, so a
  canary with the stable's weights scores 0 even where a near-tie made the stable's own
  incremental decode pick another token);
- logprob_drift: mean over the stable's tokens of log p_stable - log p_canary (nats per token).

Replay calls are excluded from the traffic gates by timing: they run after the interval's counts
and latency were read and before the next interval's baseline, so neither interval sees them.
They go through the sidecar like any call, so the replay tenant's key (`api_key_env`) meets that
tenant's rate limits and quotas: give replay a tenant of its own, so it never spends a customer's.
"""

from __future__ import annotations

import json
import os
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from mesh_common.headers import API_KEY_HEADER, CANARY_HEADER
from schemas import codec
from schemas.codec import ChatMessage, GenerateRequest
from xds_server.mesh.quality_spec import QualityGate
from xds_server.rollout.gates.fetch import MeasurementError, get_json
from xds_server.rollout.verdict import FAIL, HALT, PASS, Verdict

GENERATE = "/meshlm.inference.v1.Inference/Generate"

# --- the comparison ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One prompt answered by both: the generated ids, and the stable's tokens scored by each."""

    stable: list[int]
    canary: list[int]
    stable_argmax: list[int]  # the stable's choice at each position, teacher-forced
    canary_argmax: list[int]  # the canary's choice there
    stable_logprobs: list[float]
    canary_logprobs: list[float]


def agreement(samples: list[Sample]) -> dict[str, Any]:
    """The interval's figures (module doc); None where there is nothing to average."""
    n_tokens = sum(len(s.stable) for s in samples)
    firsts = [
        next((i for i, (a, b) in enumerate(zip(s.stable, s.canary, strict=False)) if a != b),
             min(len(s.stable), len(s.canary)))
        for s in samples
        if s.stable != s.canary
    ]  # fmt: skip
    disagree = sum(
        a != b for s in samples for a, b in zip(s.stable_argmax, s.canary_argmax, strict=True)
    )
    drift = sum(
        ls - lc
        for s in samples
        for ls, lc in zip(s.stable_logprobs, s.canary_logprobs, strict=True)
    )
    return {
        "samples": len(samples),
        "exact_match_rate": sum(s.stable == s.canary for s in samples) / len(samples)
        if samples
        else None,
        "first_divergence": sum(firsts) / len(firsts) if firsts else None,
        "token_disagreement": disagree / n_tokens if n_tokens else None,
        "logprob_drift": drift / n_tokens if n_tokens else None,
    }


def judge(gate: QualityGate, figures: dict[str, Any], errors: list[str]) -> Verdict:
    m = {"quality": {"mode": gate.mode, **figures, "errors": len(errors)}}
    if figures["samples"] < gate.min_samples:
        why = f"; first error: {errors[0]}" if errors else ""
        what = "replay answered" if gate.mode == "replay" else "mirror joined"
        unit = "prompts" if gate.mode == "replay" else "calls (min_samples)"
        return Verdict(
            HALT, f"halted: quality {what} {figures['samples']} of the "
            f"{gate.min_samples} {unit} it needs{why}", m,
        )  # fmt: skip
    failed = []
    td, drift = figures["token_disagreement"], figures["logprob_drift"]
    if td is not None and td > gate.max_token_disagreement:
        failed.append(f"token disagreement {td:.1%} > max {gate.max_token_disagreement:.1%}")
    if gate.max_logprob_drift is not None and drift is not None and drift > gate.max_logprob_drift:
        failed.append(f"logprob drift {drift:.3f} > max {gate.max_logprob_drift:g} nats/token")
    if failed:
        return Verdict(FAIL, "quality: " + "; ".join(failed), m)
    return Verdict(PASS, f"quality passed: token disagreement {td:.1%}", m)


# --- the replay -------------------------------------------------------------------------------


class ReplaySource:
    """Replays the golden set through `gate.replay_via` and joins the runtimes' records.
    `stable_urls` / `canary_urls`: each version's runtime metrics base URLs (one per replica)."""

    def __init__(
        self,
        gate: QualityGate,
        service: str,
        stable_urls: Callable[[], list[str]],
        canary_urls: Callable[[], list[str]],
        timeout: float = 10.0,
        canary_header: str = CANARY_HEADER,  # the service's route.canary_header
    ) -> None:
        self.gate, self.service = gate, service
        self.canary_header = canary_header
        self.urls = {"never": stable_urls, "always": canary_urls}
        self.http_timeout = timeout

    def verdict(self) -> Verdict:
        samples, errors = self.replay()
        return judge(self.gate, agreement(samples), errors)

    def replay(self) -> tuple[list[Sample], list[str]]:
        nonce = uuid.uuid4().hex[:12]
        key = os.environ.get(self.gate.api_key_env, "") if self.gate.api_key_env else ""
        md = [(API_KEY_HEADER, key)] if key else []
        channel = grpc.insecure_channel(
            self.gate.replay_via, options=[("grpc.default_authority", self.service)]
        )
        call = channel.unary_stream(GENERATE)
        try:
            with ThreadPoolExecutor(max_workers=4) as pool:
                jobs = [pool.submit(self._one, call, md, f"replay-{nonce}-{i}", p)
                        for i, p in enumerate(self.gate.prompts)]  # fmt: skip
                results = [j.result() for j in jobs]
        finally:
            channel.close()
        samples = [r for r in results if isinstance(r, Sample)]
        return samples, [r for r in results if isinstance(r, str)]

    def _one(self, call: Any, md: list, rid: str, prompt: str) -> Sample | str:
        """Both answers and both scores of one prompt; a string says why not."""
        try:
            out = {}
            for pin in ("never", "always"):
                req = GenerateRequest(
                    request_id=f"{rid}-{pin}",
                    messages=[ChatMessage("user", prompt)],
                    max_new_tokens=self.gate.max_new_tokens,
                    temperature=0.0,
                )
                stream = call(codec.encode_generate_request(req), timeout=self.gate.timeout,
                              metadata=[*md, (self.canary_header, pin)])  # fmt: skip
                chunks = (codec.decode_token_chunk(buf).token_ids for buf in stream)
                out[pin] = [int(t) for ids in chunks for t in ids]
            stable = out["never"]
            if not stable:
                return f"{rid}: the stable answered no token"
            s_score = self._score("never", f"{rid}-never", stable)
            c_score = self._score("always", f"{rid}-always", stable)
        except grpc.RpcError as e:
            return f"{rid}: {e.code().name}: {e.details()}"
        except MeasurementError as e:
            return f"{rid}: {e}"
        return Sample(stable, out["always"], s_score["argmax"], c_score["argmax"],
                      s_score["logprobs"], c_score["logprobs"])  # fmt: skip

    def _score(self, pin: str, rid: str, token_ids: list[int]) -> dict[str, list]:
        """Score on the replica that holds `rid` (the join by request id)."""
        bases = runtime_bases(self.urls[pin]())
        for base in bases:
            if find_records(base, [rid], self.http_timeout):
                return score_at(base, rid, token_ids, self.http_timeout)
        raise MeasurementError(f"no runtime of {len(bases)} holds a record of {rid}")


# --- the runtimes' records (model_runtime/serving/records.py, on each runtime's metrics port)

MAX_IDS = 256  # ids per GET /records?ids= (the runtime's limit)


def runtime_bases(metrics_urls: list[str]) -> list[str]:
    """`http://h:p/metrics.json` (a version's metrics_urls) -> `http://h:p`."""
    return [u.rstrip("/").removesuffix("/metrics.json") for u in metrics_urls]


def find_records(base: str, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """The records among `ids` that the runtime at `base` holds."""
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(ids), MAX_IDS):
        q = urllib.parse.quote(",".join(ids[i : i + MAX_IDS]))
        out.update(get_json(f"{base}/records?ids={q}", timeout).get("records", {}))
    return out


def score_at(base: str, rid: str, token_ids: list[int], timeout: float) -> dict[str, list]:
    """`token_ids` teacher-forced after the prompt recorded under `rid` at `base`."""
    q = urllib.parse.urlencode({"request_id": rid, "token_ids": ",".join(map(str, token_ids))})
    got = get_json(f"{base}/score?{q}", timeout)
    if len(got.get("logprobs", ())) != len(token_ids):
        raise MeasurementError(f"{base}/score: answered {json.dumps(got)[:200]}")
    return got


# --- the mirror -------------------------------------------------------------------------------


class MirrorSource:
    """Mirror mode: while a step runs, the callers' sidecars copy `mirror_percent` of the calls
    marked `x-meshlm-mirror: safe` to the canary (Envoy's request_mirror_policies to the shadow
    cluster, xds_server/resources/routes.py); the canary's runtime records each copy with
    `shadow: true` under the call's request id (the body's, else the x-request-id Envoy copied).
    Each interval: the canary runtimes' new shadow records (`GET /records?shadow=1&since=SEQ`),
    the stable's record of the same call (`GET /records?ids=`), the stable's tokens scored on
    both, judged as the replay is. A copy whose stable answer is not recorded yet (the canary
    was faster) waits for up to WAIT_ROUNDS verdicts; one that never finds it (the split sent
    the call to the canary, or the stable refused it) is unmatched, not a sample. `begin()`
    skips the copies made before the rollout started."""

    WAIT_ROUNDS = 3
    MAX_WAITING = 1024

    def __init__(
        self,
        gate: QualityGate,
        stable_urls: Callable[[], list[str]],
        canary_urls: Callable[[], list[str]],
        timeout: float = 10.0,
        max_samples: int | None = None,  # joined calls scored per interval: 2 x min_samples
    ) -> None:
        self.gate = gate
        self.stable_urls, self.canary_urls = stable_urls, canary_urls
        self.http_timeout = timeout
        self.max_samples = max_samples or 2 * gate.min_samples
        self._cursors: dict[str, tuple[str, int]] = {}  # canary base -> (instance, next since)
        # request id -> (canary base, its token ids, verdicts left to find the stable's record)
        self._waiting: dict[str, tuple[str, list[int], int]] = {}

    def begin(self) -> None:
        for base in runtime_bases(self.canary_urls()):
            if base not in self._cursors:  # once per canary runtime
                self._shadows(base)

    def verdict(self) -> Verdict:
        samples, errors, counts = self.collect()
        return judge(self.gate, {**agreement(samples), **counts}, errors)

    def collect(self) -> tuple[list[Sample], list[str], dict[str, int]]:
        """(the joined samples, why others failed, {mirrored: the new shadow copies, unmatched:
        copies given up on, waiting: copies still waiting for the stable's record})."""
        new: dict[str, tuple[str, list[int], int]] = {}
        errors: list[str] = []
        for base in runtime_bases(self.canary_urls()):
            try:
                for rid, rec in self._shadows(base).items():
                    ids = [int(t) for t in rec.get("token_ids", ())]
                    new[rid] = (base, ids, self.WAIT_ROUNDS)
            except MeasurementError as e:
                errors.append(str(e))
        shadows = {**self._waiting, **new}
        stable: dict[str, tuple[str, list[int]]] = {}
        for base in runtime_bases(self.stable_urls()):
            try:
                for rid, rec in find_records(base, list(shadows), self.http_timeout).items():
                    if not rec.get("shadow"):
                        stable[rid] = (base, [int(t) for t in rec.get("token_ids", ())])
            except MeasurementError as e:
                errors.append(str(e))
        joined = [r for r in shadows if r in stable][: self.max_samples]
        # One call at a time, its two scores side by side: a score is a forward on the runtime's
        # engine thread, between decode steps, so a burst of them would delay the canary's live
        # calls, whose TTFT the next interval's gate reads.
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = [self._sample(r, shadows[r], stable[r], pool) for r in joined]
        samples = [r for r in results if isinstance(r, Sample)]
        errors += [r for r in results if isinstance(r, str)]
        alone = {r: (b, ids, n - 1) for r, (b, ids, n) in shadows.items() if r not in stable}
        waiting = {r: w for r, w in alone.items() if w[2] > 0}
        self._waiting = dict(list(waiting.items())[-self.MAX_WAITING :])
        counts = {"mirrored": len(new), "unmatched": len(alone) - len(self._waiting),
                  "waiting": len(self._waiting)}  # fmt: skip
        return samples, errors, counts

    def _sample(self, rid: str, copy: tuple, primary: tuple, pool: Any) -> Sample | str:
        """One joined call: the stable's tokens scored on both; a string says why not."""
        (c_base, canary, _), (s_base, tokens) = copy, primary
        if not tokens:  # nothing to score: an answer of its own, as the canary's is
            return Sample([], canary, [], [], [], [])
        jobs = [pool.submit(score_at, b, rid, tokens, self.http_timeout) for b in (s_base, c_base)]
        try:
            s, c = (j.result() for j in jobs)
        except MeasurementError as e:
            return str(e)
        return Sample(tokens, canary, s["argmax"], c["argmax"], s["logprobs"], c["logprobs"])

    def _shadows(self, base: str) -> dict[str, dict[str, Any]]:
        """The shadow records `base` added since this source last asked (all, the first time);
        a runtime that restarted (a new `instance`) is read from its start."""
        instance, since = self._cursors.get(base, ("", 0))
        out: dict[str, dict[str, Any]] = {}
        for _ in range(64):  # the runtime keeps 1024 records, 256 a page
            doc = get_json(f"{base}/records?shadow=1&since={since}", self.http_timeout)
            if instance and doc.get("instance") != instance:
                instance, since, out = str(doc.get("instance", "")), 0, {}
                continue
            instance = str(doc.get("instance", ""))
            out.update(doc.get("records", {}))
            since = int(doc.get("next_since", since))
            if not doc.get("more"):
                break
        self._cursors[base] = (instance, since)
        return out


def with_quality(traffic: Verdict, quality: Verdict) -> Verdict:
    """The interval's verdict from the traffic gates' and the quality gate's: the worse wins
    (FAIL over HALT over PASS), and when both have that outcome both reasons are given; the
    quality figures join the measurements either way."""
    m = {**traffic.measurements, **quality.measurements}
    rank = {PASS: 0, HALT: 1, FAIL: 2}
    worst = max((traffic, quality), key=lambda v: rank[v.outcome])
    if traffic.outcome == quality.outcome:
        return Verdict(worst.outcome, f"{traffic.reason}; {quality.reason}", m)
    return Verdict(worst.outcome, worst.reason, m)
