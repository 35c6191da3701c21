"""`--watch [SECONDS]` of `meshlm status` and `meshlm rollout status`: redraw until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

DEFAULT_INTERVAL = 2.0
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase the screen


def add_watch_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--watch",
        nargs="?",
        type=_seconds,
        const=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"redraw every SECONDS (default when given without a value: {DEFAULT_INTERVAL:g}) "
        "until Ctrl-C",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected 0.1 to 3600 seconds, got {text!r}")
    return value


def watch(draw: Callable[[], int], interval: float | None) -> int:
    """`draw()` once (its exit code), or every `interval` seconds until Ctrl-C (then 0). On a
    terminal each frame replaces the last; piped, frames follow each other under a time line."""
    if interval is None:
        return draw()
    tty = sys.stdout.isatty()
    try:
        while True:
            header = f"every {interval:g}s, Ctrl-C to stop: {time.strftime('%H:%M:%S')}"
            print((_CLEAR if tty else "\n") + header + "\n", flush=True)
            draw()
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
