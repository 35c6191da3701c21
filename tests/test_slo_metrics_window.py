"""`meshlm serve --metrics-window`: the SLO loop's intervals need percentiles over recent calls
only (a 60 s window hides a recovery for 60 s); a window that is not above 0 is refused."""

from __future__ import annotations

from tests.test_cli_errors import assert_clear, meshlm


def test_serve_refuses_a_metrics_window_not_above_zero_before_loading() -> None:
    for value in ("0", "-5", "nan"):
        r = meshlm("serve", "--port", "0", "--metrics-window", value)
        assert_clear(r, 2, "--metrics-window", "above 0")
