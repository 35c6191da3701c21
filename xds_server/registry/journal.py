"""The registrations of a control plane alone on its state dir, saved on every change so a
restart keeps them: one private file (0600 in a 0700 dir: `registrations/hosts.json` in the state
dir), replaced atomically.

    {"format": 1, "registrations": [record, ...]}   (registry/record.py)

Read back at start, each record is checked like a registration message against the mesh; one
that does not fit (a service the mesh no longer has, a bad field) is logged and left out. A file
that cannot be read as one is moved aside (`.bad`) and named in the log, never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from mesh_common.private_files import PrivateFileError, read_private, write_private
from xds_server import mesh as m
from xds_server.registry.record import from_record, to_record
from xds_server.registry.table import Entry
from xds_server.store.base import decode

log = logging.getLogger("meshlm.registry")
FORMAT = 1
WHAT = "workload registrations"


class RegistrationFile:
    """The file, written by a thread of its own: `save` hands it the entries, and it writes
    the newest it was given (many changes at once make one write, none waits for the disk)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._pending: list[Entry] | None = None
        self._wake = threading.Event()
        self._closed = False
        self._failed = ""  # the last write's error, "" once one succeeds
        self._thread = threading.Thread(target=self._run, name="registrations-file", daemon=True)
        self._thread.start()

    def load(self, mesh: m.Mesh) -> list[Entry]:
        """The entries saved last that still fit `mesh` (none when there is no file)."""
        try:
            raw = read_private(self.path, WHAT)
        except FileNotFoundError:
            return []
        except (OSError, PrivateFileError) as e:
            log.error("registrations in %s not restored: %s", self.path, e)
            return []
        try:
            doc = decode(raw, str(self.path))
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"{self.path}: not a registrations file of format {FORMAT}")
            rows = doc.get("registrations")
            if not isinstance(rows, list):
                raise ValueError(f"{self.path}.registrations: expected a list")
        except ValueError as e:
            bad = self.path.with_name(self.path.name + ".bad")
            with contextlib.suppress(OSError):
                os.replace(self.path, bad)
            log.error("registrations not restored: %s (moved to %s)", e, bad)
            return []
        entries = []
        for i, row in enumerate(rows):
            try:
                entries.append(from_record(row, mesh, 0, f"{self.path.name}.registrations[{i}]"))
            except ValueError as e:
                log.warning("registration not restored: %s", e)
        return entries

    def save(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            if not self._closed:
                self._pending = list(entries)
                self._wake.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                entries, self._pending = self._pending, None
                closed = self._closed
            if entries is not None:
                self._write(entries)
            if closed:
                return

    def _write(self, entries: list[Entry]) -> None:
        """Replace the file by `entries`; a failure is logged (the registrations stay in
        memory, and the next change tries again)."""
        rows = sorted((to_record(e) for e in entries), key=lambda r: r["address"])
        data = json.dumps({"format": FORMAT, "registrations": rows}, indent=1, sort_keys=True)
        try:
            write_private(self.path, data.encode(), WHAT)
        except (OSError, PrivateFileError) as e:
            if str(e) != self._failed:  # said once, not at every change
                log.error("registrations not saved to %s: %s", self.path, e)
            self._failed = str(e)
            return
        if self._failed:
            log.warning("registrations saved to %s again", self.path)
            self._failed = ""
