"""The live inbound sidecars of each service, as the ADS streams see them.

Their number divides each tenant's mesh-wide rate limit (`rate_limits.mode: local`,
xds_server/resources/ratelimit.py): every change the control plane stages carries the count
(`overlay`), and a sidecar joining or leaving re-stages the live mesh (`push_loop`), so each
sidecar's new share is pushed and ACKed like any other change.

Until the re-division is ACKed, shares follow the old count: a sidecar that joins enforces the
share of the sidecars before it, and one that leaves (or loses its stream to the control plane)
hands its share on only after the push. After a control plane restart the count builds up again
as sidecars reconnect, so the first ones back hold a larger share for that time.

Only verified sidecars count where ADS is mTLS (identity on): a stream is admitted only when its
certificate holds the service account of the service it claims (xds_server/xds/peer.py), so a local
process cannot shrink a tenant's shares with made-up inbound sidecars. Without identity (or with
`identity.mtls: off`) the metadata is taken on trust.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from xds_server import mesh as m
from xds_server.xds.sync import SyncStatus

log = logging.getLogger(__name__)


def inbound_sidecars(sync: SyncStatus) -> Counter[str]:
    """service -> connected sidecars with an inbound listener for it."""
    counts: Counter[str] = Counter()
    with sync.cond:
        for group, ids in sync.connected.items():
            if group.inbound_port is not None and group.service:
                counts[group.service] += len(ids)
    return counts


def overlay(mesh: m.Mesh, counts: Counter[str]) -> m.Mesh:
    """`mesh` with each service's `inbound_sidecars` from `counts` (the same mesh if equal)."""
    for name, svc in mesh.services.items():
        if svc.inbound_sidecars != counts[name]:
            mesh = mesh.with_inbound_sidecars(name, counts[name])
    return mesh


def shares_matter(mesh: m.Mesh) -> bool:
    """Whether the count reaches any sidecar's config: a limit to divide in `local` mode."""
    if mesh.rate_limits.mode != "local" or mesh.authz.mode == "none":
        return False
    tenants = getattr(mesh.tenants, "tenants", ())
    return any(t.rate_limit or t.token_budget for t in tenants) or any(
        s.slo_state.shed_tenants for s in mesh.services.values()
    )


def push_loop(
    changed: threading.Event,
    push: Callable[[], object],
    stop: threading.Event,
    settle: float = 0.05,
) -> None:
    """Until `stop`: after a sidecar joined or left (`changed`) and `settle` seconds more (a
    burst of joins is one push), `push()` re-stages the live mesh."""
    while not stop.is_set():
        if not changed.wait(0.5) or stop.wait(settle):
            continue
        changed.clear()
        try:
            push()
        except Exception:  # a group that cannot take it: retried on the next change
            log.exception("rate-limit shares: push failed")
