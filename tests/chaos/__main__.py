"""`python -m tests.chaos [pytest args]`: run the chaos suite and write RELIABILITY.md."""

from __future__ import annotations

import os
import sys
import time

import pytest

if __name__ == "__main__":
    os.environ["MESHLM_CHAOS"] = "1"
    t0 = time.monotonic()
    here = os.path.dirname(os.path.abspath(__file__))
    rc = pytest.main(["-q", "-p", "no:cacheprovider", here, *sys.argv[1:]])
    print(f"chaos suite: {time.monotonic() - t0:.0f} s, exit status {int(rc)}")
    sys.exit(int(rc))
