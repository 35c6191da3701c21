"""Rollout state on disk, so a rollout survives a control-plane restart.

One JSON file, replaced atomically: write a temp file in the same directory, fsync it, rename it
over the old one, fsync the directory. A crash leaves either the old or the new file, never half.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

FORMAT = 1


class RolloutStoreError(RuntimeError):
    pass


class RolloutStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def load(self) -> dict[str, dict[str, Any]]:
        """service -> rollout record; empty when no file exists yet. A corrupt file raises and is
        left untouched (nothing is overwritten until an operator looks)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise RolloutStoreError(f"{self.path}: not valid JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise RolloutStoreError(f"{self.path}: not a rollout store of format {FORMAT}")
        rollouts = doc.get("rollouts")
        if not isinstance(rollouts, dict):
            raise RolloutStoreError(f"{self.path}: 'rollouts' must be a mapping")
        return rollouts

    def save(self, rollouts: dict[str, dict[str, Any]]) -> None:
        data = json.dumps({"format": FORMAT, "rollouts": rollouts}, indent=1, sort_keys=True)
        with self._lock:
            write_atomic(self.path, data)


def write_atomic(path: Path, data: str) -> None:
    """Replace `path` by `data`: a temp file beside it, fsynced, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the rename itself durable
    finally:
        os.close(dfd)
