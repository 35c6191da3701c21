"""`meshlm xds-server --store URL`: one replica's wiring. The election decides which
replica runs the rollouts and the SLO loop; every replica serves ADS and the admin API.

On a follower, rollout status is read from the store and rollout or SLO commands are refused
with 503, naming the leader's admin URL (the leader's work must not run on two replicas); weights,
endpoints and mesh files are taken by any replica (they are written through the store).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from xds_server.replica.election import Election
from xds_server.replica.leader import (
    FencedChanges,
    LeaderWork,
    StoreRollouts,
    StoreSlo,
    rollouts_of,
)
from xds_server.store.base import Store, StoreError

Handler = Callable[..., tuple[int, Any]]


def default_replica_id(grpc_port: int) -> str:
    """HOST-PORT: unique among replicas on a host, the same across restarts."""
    return f"{socket.gethostname()}-{grpc_port}"


class ReplicaRole:
    """The election and the leader-only work of one replica, and the admin routes they change."""

    def __init__(
        self,
        store: Store,
        replica_id: str,
        cp: Any,
        *,
        ttl: float,
        info: dict[str, Any],
        rollouts: Callable[[Any, Any], Any],  # (control plane, rollout store) -> controller
        slo: Callable[[Any, Any], Any],  # (control plane, SLO memory) -> started SloLoops
    ) -> None:
        self.store, self.id, self.cp = store, replica_id, cp
        self.election = Election(
            store, replica_id, ttl=ttl, info=info, on_change=lambda up: self.work.changed(up)
        )

        def start() -> tuple[Any, Any]:
            changes = FencedChanges(cp, self.election)
            controller = rollouts(changes, StoreRollouts(store, self.election))
            loops = slo(changes, StoreSlo(store, self.election))
            return controller, loops

        def stop(handle: tuple[Any, Any]) -> None:
            controller, loops = handle
            controller.close()
            loops.stop()

        self.work = LeaderWork(self.election, start, stop)

    def start(self) -> ReplicaRole:
        self.election.start()
        return self

    def stop(self) -> None:
        self.work.close()
        self.election.stop(resign=True)  # the next replica takes over at once

    def current(self) -> tuple[Any, Any]:
        """(rollout controller, SLO loops) while this replica leads, else (None, None)."""
        return self.work.handle or (None, None)

    def status(self) -> dict[str, Any]:
        """GET /: this replica, who leads, what the leader's work is doing, the store."""
        e = self.election.status()
        return {
            "replica": self.id,
            "leading": e["leading"],
            "leader": e["leader"],
            "leader_ttl": e["ttl"],
            "leader_work": self.work.state,
            "election_error": e["error"],
            "store": self.cp.replication.status() if self.cp.replication else None,
        }

    def rollouts_handler(self, api: Callable[[Any], Handler]) -> Handler:
        """/rollouts: the leader's controller; on a follower GET from the store, else 503."""

        def handle(method: str, path: str, body: Any = None) -> tuple[int, Any]:
            handle_ = self.work.handle
            if handle_ is not None:
                return api(handle_[0])(method, path, body)
            if method.upper() != "GET":
                return self._not_leader("rollout commands")
            try:
                doc = rollouts_of(self.store)
            except StoreError as e:
                return 503, {"error": f"state store: {e}"}
            parts = [p for p in path.split("?", 1)[0].split("/") if p][1:]
            if not parts:
                return 200, doc
            if len(parts) == 1 and parts[0] in doc:
                return 200, doc[parts[0]]
            return 404, {"error": f"{parts[0]}: no rollout"}

        return handle

    def slo_handler(self) -> Handler:
        def handle(method: str, path: str, body: Any = None) -> tuple[int, Any]:
            handle_ = self.work.handle
            if handle_ is None:
                return self._not_leader("the SLO loop")
            return handle_[1].handle(method, path, body)

        return handle

    def _not_leader(self, what: str) -> tuple[int, Any]:
        leader = self.election.leader()
        where = (
            f"the leader is {leader.id} (admin {leader.info.get('admin', '?')})"
            if leader
            else f"no replica leads now ({self.work.state})"
        )
        return 503, {
            "error": f"replica {self.id} does not lead: {what} run on the leader; {where}",
            "leader": leader.to_json() if leader else None,
        }
