"""The chaos suite: collected only when MESHLM_CHAOS=1 (`python -m tests.chaos`, `make chaos`),
so the default `pytest` run stays fast. Writes RELIABILITY.md at the end of the session."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.chaos import record

ENABLED = os.environ.get("MESHLM_CHAOS") == "1"
if not ENABLED:
    collect_ignore_glob = ["test_*.py"]

_STARTED = time.monotonic()


def pytest_sessionfinish(session, exitstatus) -> None:
    if not ENABLED or not record.RECORDS:
        return
    out = Path(os.environ.get("MESHLM_RELIABILITY", Path(__file__).parents[2] / "RELIABILITY.md"))
    outcome = "all passed" if exitstatus == 0 else f"exit status {int(exitstatus)}"
    record.write_report(out, elapsed_s=time.monotonic() - _STARTED, outcome=outcome)
