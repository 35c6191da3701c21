"""The quality gate's part of a rollout spec (`quality:`): replay mode's golden prompts and
replay tenant, mirror mode's share of copied calls, both modes' bounds on disagreement."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xds_server.mesh.rollout_fields import RolloutSpecError, parse_duration

MAX_PROMPTS = 256
MAX_MIRRORED = 1024  # the runtime keeps its newest 1024 records (model_runtime/serving/records.py)


MODES = ("replay", "mirror")


@dataclass(frozen=True)
class QualityGate:
    replay_via: str = ""  # replay: host:port of a caller sidecar's outbound listener
    prompts: tuple[str, ...] = ()  # replay: the golden set (`prompts`, or `prompts_file`)
    api_key_env: str = ""  # replay: the environment variable holding the replay tenant's key
    max_new_tokens: int = 16  # replay
    min_samples: int = 8  # fewer joined answers than this halts the interval
    max_token_disagreement: float = 0.05  # fraction of the stable's tokens
    max_logprob_drift: float | None = None  # nats per token
    timeout: float = 60.0  # replay: per replayed call
    mode: str = "replay"
    mirror_percent: float = 10.0  # mirror: share of the safe-marked calls copied to the canary

    def to_dict(self) -> dict[str, Any]:
        """The mesh file's form (parse_quality reads it back): the mode's own fields."""
        d = {k: getattr(self, k) for k in _COMMON if k != "prompts_file"}
        d.update({k: getattr(self, k) for k in _ONLY[self.mode] if k != "prompts_file"})
        d["prompts"] = list(self.prompts) if self.mode == "replay" else None
        return {k: v for k, v in d.items() if v is not None}


_COMMON = {"mode", "min_samples", "max_token_disagreement", "max_logprob_drift"}
_ONLY = {
    "replay": {"replay_via", "prompts", "prompts_file", "api_key_env", "max_new_tokens", "timeout"},
    "mirror": {"mirror_percent"},
}
_KNOWN = _COMMON | _ONLY["replay"] | _ONLY["mirror"]


def _fraction(v: Any, where: str) -> float:
    """0.05 or '5%' -> 0.05."""
    raw = v
    if isinstance(v, str) and v.strip().endswith("%"):
        try:
            v = float(v.strip()[:-1]) / 100
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
        raise RolloutSpecError(f"{where}: expected a fraction 0..1 or a percentage, got {raw!r}")
    return float(v)


def _count(v: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RolloutSpecError(f"{where}: expected an integer {lo}..{hi}, got {v!r}")
    return v


def _prompts(d: dict[str, Any], where: str) -> tuple[str, ...]:
    if ("prompts" in d) == ("prompts_file" in d):
        raise RolloutSpecError(f"{where}: give either prompts (a list) or prompts_file (a path)")
    if "prompts_file" in d:
        path = d["prompts_file"]
        try:  # one prompt a line; blank lines skipped
            text = Path(str(path)).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RolloutSpecError(f"{where}.prompts_file: cannot read {path!r}: {e}") from None
        prompts: Any = [line.strip() for line in text.splitlines() if line.strip()]
        field = "prompts_file"
    else:
        prompts, field = d["prompts"], "prompts"
    if not isinstance(prompts, list | tuple) or not prompts or len(prompts) > MAX_PROMPTS:
        raise RolloutSpecError(f"{where}.{field}: expected 1..{MAX_PROMPTS} prompts")
    if not all(isinstance(p, str) and p.strip() for p in prompts):
        raise RolloutSpecError(f"{where}.{field}: every prompt must be a non-empty string")
    return tuple(prompts)


def parse_quality(d: Any, where: str) -> QualityGate | None:
    """The rollout's `quality:` block -> a QualityGate (None when absent)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise RolloutSpecError(f"{where}: expected a mapping, got {type(d).__name__}")
    for k in d:
        if k not in _KNOWN:
            raise RolloutSpecError(
                f"{where}.{k}: unknown field (known: {', '.join(sorted(_KNOWN))})"
            )
    mode = d.get("mode", "replay")
    if mode not in MODES:
        raise RolloutSpecError(f"{where}.mode: expected one of {', '.join(MODES)}, got {mode!r}")
    other = next(m for m in MODES if m != mode)
    for k in d:
        if k in _ONLY[other]:
            raise RolloutSpecError(f"{where}.{k}: a field of mode {other}, not of mode {mode}")
    if mode == "mirror":
        return _mirror_gate(d, where)
    via = d.get("replay_via")
    host, _, port = str(via or "").rpartition(":")
    if not isinstance(via, str) or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RolloutSpecError(
            f"{where}.replay_via: expected a caller sidecar's HOST:PORT, got {via!r}"
        )
    prompts = _prompts(d, where)
    env = d.get("api_key_env", "")
    if not isinstance(env, str):
        raise RolloutSpecError(f"{where}.api_key_env: expected an environment variable's name")
    min_samples = _count(
        d.get("min_samples", min(8, len(prompts))), f"{where}.min_samples", 1, MAX_PROMPTS
    )
    limits = _limits(d, where)
    if min_samples > len(prompts):
        raise RolloutSpecError(
            f"{where}.min_samples: {min_samples} is more than the {len(prompts)} prompts replayed"
        )
    timeout = parse_duration(d.get("timeout", "60s"), f"{where}.timeout")
    if timeout <= 0:
        raise RolloutSpecError(f"{where}.timeout: must be positive")
    return QualityGate(
        replay_via=via,
        prompts=prompts,
        api_key_env=env,
        max_new_tokens=_count(d.get("max_new_tokens", 16), f"{where}.max_new_tokens", 1, 512),
        min_samples=min_samples,
        timeout=timeout,
        **limits,
    )


def _limits(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Both modes' bounds on disagreement."""
    drift = d.get("max_logprob_drift")
    if drift is not None and (
        isinstance(drift, bool) or not isinstance(drift, int | float) or drift < 0
    ):
        raise RolloutSpecError(
            f"{where}.max_logprob_drift: expected nats per token >= 0, got {drift!r}"
        )
    return {
        "max_token_disagreement": _fraction(
            d.get("max_token_disagreement", 0.05), f"{where}.max_token_disagreement"
        ),
        "max_logprob_drift": None if drift is None else float(drift),
    }


def _mirror_gate(d: dict[str, Any], where: str) -> QualityGate:
    """Mirror mode: no prompts and no replay tenant; the samples are live calls' copies."""
    pct = d.get("mirror_percent", 10)
    if isinstance(pct, bool) or not isinstance(pct, int | float) or not 0 < pct <= 100:
        raise RolloutSpecError(
            f"{where}.mirror_percent: expected a percentage of the safe-marked calls, "
            f"0 < p <= 100, got {pct!r}"
        )
    return QualityGate(
        mode="mirror",
        mirror_percent=float(pct),
        min_samples=_count(d.get("min_samples", 8), f"{where}.min_samples", 1, MAX_MIRRORED),
        **_limits(d, where),
    )
