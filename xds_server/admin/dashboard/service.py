"""A live dashboard on the admin port: `GET /dashboard/` is a page (this
folder's index.html, dashboard.js, dashboard.css: no build step, nothing fetched from
elsewhere, so it works offline) that carries the state as of its serving, so it shows the mesh
at once; `GET /dashboard/state` is that state as JSON, and `GET /dashboard/events` the same
state as server-sent events, pushed within POLL seconds of a change (a `: keepalive` comment
every KEEPALIVE seconds otherwise).

The state is read while someone watches: one thread compares the in-memory state
(state.live) every POLL seconds, another reads the sidecars' and runtimes' metrics
(state.measured) every MEASURE_EVERY seconds; both end when the last page closes. The traffic
split over time is recorded at every push of the control plane's snapshot cache, watched or
not, so a rollout run before a page opened is on its chart."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xds_server.admin.dashboard import state

log = logging.getLogger(__name__)

POLL = 0.2  # seconds between two readings of the in-memory state
MEASURE_EVERY = 2.0  # seconds between two readings of the sidecars' and runtimes' metrics
KEEPALIVE = 10.0  # seconds
MAX_SUBSCRIBERS = 8  # event streams at once: each holds one of the admin API's connections
SPLIT_POINTS = 500  # traffic-split changes kept per service
_STATIC = Path(__file__).parent
# Where index.html takes the state it is served with: JSON in a data block, never run.
_FIRST_STATE = b"<!-- first state -->"
_JSON_IN_HTML = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})
_FILES = {
    "": ("index.html", "text/html; charset=utf-8"),
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


class Busy(Exception):
    """MAX_SUBSCRIBERS event streams are open already."""


class Dashboard:
    """`sources()` -> (RolloutController or None, SloLoops or None), asked at every reading
    (they appear after the admin server starts, and move with the leader on replicas)."""

    def __init__(self, cp: Any, sources: Callable[[], tuple[Any, Any]]) -> None:
        self.cp = cp
        self.sources = sources
        self.cond = threading.Condition()
        self._seq = 0
        self._live: dict[str, Any] = {}
        self._measured: dict[str, Any] = {"versions": {}, "tenants": {}, "errors": []}
        self._splits: dict[str, deque[tuple[float, dict[str, int]]]] = {}
        self._changed_at = time.time()
        self._subscribers = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._record_splits()  # the split at start, then every pushed change
        self._unwatch = cp.cache.watch(self._record_splits)

    # -- what the admin server serves --------------------------------------------------------
    def file(self, name: str) -> tuple[str, bytes] | None:
        """(content type, body) of one of the page's files, or None; the page itself with
        the state now in it."""
        if name not in _FILES:
            return None
        path, content_type = _FILES[name]
        body = (_STATIC / path).read_bytes()
        if path == "index.html":
            doc = json.dumps(self.snapshot(), default=str).translate(_JSON_IN_HTML)
            body = body.replace(_FIRST_STATE, doc.encode())
        return content_type, body

    def snapshot(self) -> dict[str, Any]:
        """The state now (read afresh when no page keeps it current)."""
        with self.cond:
            watched = self._subscribers > 0
        if not watched:
            self._read_live()
            self._read_measured()
        with self.cond:
            return self._doc()

    def stream(self, send: Callable[[bytes], None]) -> None:
        """Send the state as server-sent events until the admin server stops or `send` fails
        (OSError: the page went away). Raises Busy when too many streams are open."""
        with self.cond:
            if self._closed:
                return
            if self._subscribers >= MAX_SUBSCRIBERS:
                raise Busy(f"at most {MAX_SUBSCRIBERS} dashboards at once")
            self._subscribers += 1
            if not any(t.is_alive() for t in self._threads):
                self._start()
        try:
            self._read_live()  # the first event is current
            seen = -1
            while True:
                with self.cond:
                    self.cond.wait_for(self._news(seen), KEEPALIVE)
                    if self._closed:
                        return
                    fresh = self._seq != seen
                    seen, doc = self._seq, self._doc()
                if fresh:
                    send(b"data: " + json.dumps(doc, default=str).encode() + b"\n\n")
                else:
                    send(b": keepalive\n\n")
        finally:
            with self.cond:
                self._subscribers -= 1

    def _news(self, seen: int) -> Callable[[], bool]:
        return lambda: self._seq != seen or self._closed

    def close(self) -> None:
        self._unwatch()
        with self.cond:
            self._closed = True
            self.cond.notify_all()

    # -- readings ----------------------------------------------------------------------------
    def _start(self) -> None:
        self._threads = [
            threading.Thread(target=self._every, args=(POLL, self._read_live), daemon=True,
                             name="dashboard-live"),
            threading.Thread(target=self._every, args=(MEASURE_EVERY, self._read_measured),
                             daemon=True, name="dashboard-metrics"),
        ]  # fmt: skip
        for t in self._threads:
            t.start()

    def _every(self, period: float, read: Callable[[], None]) -> None:
        while True:
            with self.cond:
                if self._closed or self._subscribers == 0:
                    return
            try:
                read()
            except Exception:  # keep the page going; the next reading may succeed
                log.exception("dashboard: %s failed", read.__name__)
            with self.cond:
                self.cond.wait_for(lambda: self._closed, period)

    def _record_splits(self) -> None:
        """Add each service's weights where they changed (the cache calls it at every push,
        from one thread or another: read under the lock, so the points keep their order)."""
        with self.cond:
            now = time.time()
            for name, svc in self.cp.mesh.services.items():
                points = self._splits.setdefault(name, deque(maxlen=SPLIT_POINTS))
                weights = dict(svc.route.weights)
                if not points or points[-1][1] != weights:
                    points.append((now, weights))

    def _read_live(self) -> None:
        rollouts, slo = self.sources()
        doc = state.live(self.cp, rollouts, slo)
        with self.cond:
            if doc != self._live:
                self._live = doc
                self._changed()

    def _read_measured(self) -> None:
        doc = state.measured(self.cp)
        with self.cond:
            if doc != self._measured:
                self._measured = doc
                self._changed()

    def _changed(self) -> None:  # under self.cond
        self._seq += 1
        self._changed_at = time.time()
        self.cond.notify_all()

    def _doc(self) -> dict[str, Any]:  # under self.cond
        services = {}
        for name, svc in self._live.get("services", {}).items():
            services[name] = {
                **svc,
                "splits": [[t, w] for t, w in self._splits.get(name, ())],
                "measured": self._measured["versions"].get(name, {}),
            }
        return {
            **self._live,
            "services": services,
            "tenants": self._measured["tenants"],
            "errors": self._measured["errors"],
            "changed_at": self._changed_at,
        }
