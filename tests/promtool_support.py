"""`promtool check metrics` (Debian's prometheus package) on an exposition: the check every
Prometheus endpoint of the mesh must pass (issue 16). A missing promtool fails, never skips."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest


def check_metrics(exposition: bytes) -> None:
    # On PATH (apt-get install prometheus) or beside the venv's python (make test-tools).
    exe = shutil.which("promtool") or shutil.which(
        "promtool", path=str(Path(sys.executable).parent)
    )
    if exe is None:
        pytest.fail("promtool not found: run `make test-tools` or `apt-get install prometheus`")
    r = subprocess.run([exe, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert r.returncode == 0, f"promtool check metrics:\n{r.stdout.decode()}{r.stderr.decode()}"


def scrape(url: str, context=None) -> tuple[str, bytes]:
    """GET a /metrics URL as Prometheus does: (content type, body)."""
    req = urllib.request.Request(url, headers={"accept": "text/plain;version=0.0.4"})
    with urllib.request.urlopen(req, timeout=10, context=context) as r:
        return r.headers["content-type"], r.read()
