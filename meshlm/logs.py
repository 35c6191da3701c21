"""Logging for every `meshlm` command: `--log-level` and `--log-format
text|json`, one setup on the root logger.

JSON lines carry the time, level, logger and message, plus the structured fields a line was
logged with (`extra={"event": "nack", "node": ...}`), so a log shipper needs no parsing.

Messages carry peers' strings (node ids, NACK details, request paths, SPIFFE IDs, tenant
names): both formats write a message's control characters as escapes (`escape`), so one record
is one line and no peer can forge a line or drive the terminal."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import traceback

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# LogRecord's own attributes: everything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# C0 and C1 controls, line and paragraph separators, zero-width and bidirectional formatting
# characters, lone surrogates.
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ud800-\udfff]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """`text` with its control characters written as Python escapes (\\n, \\x1b, \\u2028)."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(_escaped, text)


def _escaped(m: re.Match) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`--log-level` (unless the command has its own) and `--log-format`."""
    if "--log-level" not in p._option_string_actions:
        p.add_argument("--log-level", default="info", type=str.lower, choices=LEVELS,
                       help="lowest level of log line written (to stderr)")  # fmt: skip
    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="text lines, or one JSON object a line for log shippers")  # fmt: skip


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT with the message escaped; a traceback keeps its lines, and the messages of
    its exceptions are escaped too (they often quote what a peer sent)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        te = traceback.TracebackException(*ei)
        _escape_exception_texts(te)
        return "\n".join(map(escape, "".join(te.format()).rstrip("\n").split("\n")))


def _escape_exception_texts(te: traceback.TracebackException) -> None:
    # `_str` is the exception's message as TracebackException will print it (CPython 3.8+).
    if isinstance(getattr(te, "_str", None), str):
        te._str = escape(te._str)
    if getattr(te, "__notes__", None):
        te.__notes__ = [escape(str(n)) for n in te.__notes__]
    for sub in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())):
        if sub is not None:
            _escape_exception_texts(sub)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": escape(record.getMessage()),
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
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
