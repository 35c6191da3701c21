"""Logging for every `meshlm` command (issue 16 item 4): `--log-level` and `--log-format
text|json`, one setup on the root logger.

JSON lines carry the time, level, logger and message, plus the structured fields a line was
logged with (`extra={"event": "nack", "node": ...}`), so a log shipper needs no parsing."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# LogRecord's own attributes: everything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`--log-level` (unless the command has its own) and `--log-format`."""
    if "--log-level" not in p._option_string_actions:
        p.add_argument("--log-level", default="info", type=str.lower, choices=LEVELS,
                       help="lowest level of log line written (to stderr)")  # fmt: skip
    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="text lines, or one JSON object a line for log shippers")  # fmt: skip


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each line, not as it was at set-up: `meshlm.cli.main`
    run in-process (tests, embedding) must not leave the root logger writing to a stream that
    was swapped and closed (pytest's capture: "I/O operation on closed file" from a thread)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup(level: str = "info", fmt: str = "text") -> None:
    """Route every logger's lines at `level` and above to stderr in `fmt`."""
    handler = _Stderr()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
