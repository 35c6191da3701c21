"""The leader's work on replicas: rollouts and the SLO loop run on the elected replica
only, their writes fenced by its term, and stop the moment it may no longer lead.

`LeaderWork` starts the work when the election says this replica leads and stops it when that
ends (lease lost, quorum lost, another leader); the transitions run on a thread of their own,
since starting a rollout controller re-applies each rollout's step and waits for ACKs, which must
never hold up the election's keep-alives. `FencedChanges` is the control plane as the leader's
work sees it: each change it makes carries the term's fence, so a deposed leader's late write
fails (Fenced) instead of landing. `StoreRollouts` keeps rollout state in the store
(`rollouts/<service>`), fenced, so the next leader continues each rollout from its step;
`StoreSlo` does the same for each SLO loop's level and actions in force (`slo/<service>`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xds_server.replica.election import Election
from xds_server.rollout.controller import Rollout
from xds_server.store import keys
from xds_server.store.base import Check, Conflict, Delete, Put, Store, StoreError, encode
from xds_server.store.state_file import RolloutStore

log = logging.getLogger("meshlm.leader")
# ControlPlane methods that change desired state: fenced when the leader's work calls them.
CHANGES = (
    "set_weights",
    "set_pins",
    "set_mirror",
    "add_endpoint",
    "remove_endpoint",
    "set_slo_state",
)


class FencedChanges:
    """`cp` whose changes carry `election`'s fence (NotLeader when it does not lead)."""

    def __init__(self, cp: Any, election: Election) -> None:
        self._cp, self._election = cp, election

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cp, name)
        if name not in CHANGES:
            return attr

        def fenced(*args: Any, **kwargs: Any) -> Any:
            with self._cp.fenced(self._election.fence()):
                return attr(*args, **kwargs)

        return fenced


class StoreRollouts:
    """RolloutStore's load/save on the store: one key per service, written with the fence."""

    def __init__(self, store: Store, election: Election) -> None:
        self.store, self.election = store, election
        self._revs: dict[str, int] = {}

    def load(self) -> dict[str, dict[str, Any]]:
        entries, _ = self.store.list(keys.ROLLOUTS)
        out = {}
        for e in entries:
            self._revs[e.key] = e.revision
            try:
                doc = e.json()
                Rollout.from_dict(doc)  # a record the controller cannot take: refused here
                if doc["service"] != e.key.removeprefix(keys.ROLLOUTS):
                    raise ValueError(f"service {doc['service']!r} under another's key")
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                log.error("%s: not a rollout (%s); left as it is", e.key, str(err)[:200])
                continue
            out[e.key.removeprefix(keys.ROLLOUTS)] = doc
        return out

    def save(self, rollouts: dict[str, dict[str, Any]]) -> None:
        """Raises Fenced/NotLeader once the term is over: nothing of a deposed leader lands."""
        fence = self.election.fence()
        checks, ops = [fence.check()], []
        wanted = {keys.rollout(s): encode(r) for s, r in rollouts.items()}
        for key in set(self._revs) | set(wanted):
            checks.append(Check(key, revision=self._revs.get(key, 0)))
            ops.append(Put(key, wanted[key]) if key in wanted else Delete(key))
        rev = self.store.txn(checks, ops)
        self._revs = dict.fromkeys(wanted, rev)


class StoreSlo:
    """The SLO loops' level, state and history in the store (`slo/<service>`), written with the
    fence (xds_server/slo/loop.py SloMemory): the next leader continues each loop where it was."""

    def __init__(self, store: Store, election: Election) -> None:
        self.store, self.election = store, election
        self._revs: dict[str, int] = {}

    def load(self, service: str) -> dict[str, Any] | None:
        entry = self.store.get(keys.slo(service))
        self._revs[service] = entry.revision if entry else 0
        try:
            return entry.json() if entry else None
        except ValueError:
            log.error("%s: not JSON; the SLO loop starts over", keys.slo(service))
            return None

    def save(self, service: str, doc: dict[str, Any]) -> None:
        """Raises Fenced/NotLeader once the term is over: nothing of a deposed leader lands."""
        key = keys.slo(service)
        checks = [self.election.fence().check(), Check(key, revision=self._revs.get(service, 0))]
        self._revs[service] = self.store.txn(checks, [Put(key, encode(doc))])


def import_rollouts(store: Store, path: str | Path) -> list[str]:
    """Rollouts of a control plane that ran alone (its rollouts.json) into a store that has
    none yet, once, so the first leader continues them; the services imported. Not fenced:
    each key is written only if absent."""
    old = RolloutStore(path).load()  # RolloutStoreError for a file that is not one
    if not old or store.list(keys.ROLLOUTS)[0]:
        return []
    ops = [Put(keys.rollout(s), encode(r)) for s, r in sorted(old.items())]
    try:
        store.txn([Check(op.key, revision=0) for op in ops], ops)
    except Conflict:
        return []  # another replica imported them first
    return sorted(old)


def rollouts_of(store: Store) -> dict[str, dict[str, Any]]:
    """Every rollout as the store holds it (what a follower shows)."""
    entries, _ = store.list(keys.ROLLOUTS)
    return {e.key.removeprefix(keys.ROLLOUTS): json.loads(e.value) for e in entries}


class LeaderWork:
    """Runs `start()` while `election` says this replica leads and `stop(handle)` when it stops
    leading; `state` says which, and why it is paused."""

    def __init__(
        self,
        election: Election,
        start: Callable[[], Any],
        stop: Callable[[Any], None],
    ) -> None:
        self.election, self._start, self._stop_work = election, start, stop
        self.state = "following"
        self._handle: Any = None
        self._want = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-work", daemon=True)
        self._thread.start()

    @property
    def handle(self) -> Any:
        """What start() returned while this replica leads; None otherwise."""
        return self._handle

    def changed(self, leading: bool) -> None:
        """The election's on_change: never blocks it."""
        self._want.set()

    def close(self) -> None:
        self._closing.set()
        self._want.set()
        self._thread.join(timeout=30)
        self._halt("replica stopping")

    def _run(self) -> None:
        while not self._closing.is_set():
            self._want.wait(self.election.ttl / 3)
            self._want.clear()
            if self._closing.is_set():
                return
            leading = self.election.is_leader
            if leading and self._handle is None:
                log.warning("leader: %s leads: rollouts and SLO loops run here", self._me())
                try:
                    self._handle = self._start()
                    self.state = "leading"
                except Exception as e:  # a store error, or a stored rollout it cannot read
                    if not isinstance(e, StoreError):
                        log.exception("leader: could not start the leader's work")
                    log.warning("leader: could not take over: %s; trying again", e)
                    self.state = f"paused: could not start: {e}"
                    self._want.set()
                    self._closing.wait(1.0)
            elif not leading and self._handle is not None:
                error = self.election.status()["error"]
                self._halt("not the leader any more" + (f" ({error})" if error else ""))
            elif not leading and self.state.startswith("paused"):
                e = self.election.status()
                if not e["error"] and e["leader"]:  # the store answers; another replica leads
                    self.state = "following"

    def _halt(self, why: str) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            log.warning("leader: %s: rollouts and SLO loops paused: %s", self._me(), why)
            self._stop_work(handle)
            self.state = f"paused: {why}"

    def _me(self) -> str:
        return self.election.candidate
