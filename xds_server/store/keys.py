"""Where the control plane's state lives in a store, relative to the store's root
(etcd: /meshlm/ unless the --store URL names another). Values are JSON (base.encode), read back
within bounds (base.decode) and checked before use (documents.py, isolation, leader): anyone
who can write the store can write any of these keys, so `meshlm etcd` gives only the meshlm
user (TLS client certificate + password) access to the prefix.

Desired state, written by whichever replica took the admin call (revision-checked):
  mesh                       the mesh as last applied: {"source": YAML text, ...}
  live/<service>             edits over it: weights, x-canary pins, endpoints the SLO loop
                             added, the SLO actions in force (what ControlPlane._change makes)
  faults                     the faults in force, the mesh file's and those set at run time
                             (`meshlm fault`): {"faults": [fault_doc, ...]}; absent: the file's
Leader-only (fenced) state:
  rollouts/<service>         one rollout (xds_server/rollout/controller.py Rollout.to_dict())
  slo/<service>              one SLO loop: level, state, replicas it started, history
Decided by any replica from its sidecars' access logs, each key revision-checked:
  isolation/<service>/<key>  one quarantined request class (xds_server/slo/quarantine.py Tripped)
Shared by every replica:
  identity/ca                the mesh CA's state (roots and their keys: etcd needs TLS + auth)
  identity/join-tokens       join token hashes and what each may enroll
Bound to a lease of the replica that holds the host's registration stream (registry/store.py):
  registrations/<host:port>  one registered host (registry/record.py): kept alive while its
                             stream lives, left to expire a grace period after it is lost
Bound to a replica's lease (gone when it dies):
  leader                     the elected replica (xds_server/replica/election.py)
  replicas/<id>              each replica's addresses: {"grpc", "admin", "since"}
  acks/<id>/<node>           what each of its sidecars ACKed, so a change made through one
                             replica returns when the sidecars of all have it
"""

from __future__ import annotations

LEADER = "leader"
MESH = "mesh"
FAULTS = "faults"
LIVE = "live/"
ROLLOUTS = "rollouts/"
QUARANTINE = "isolation/"
SLO = "slo/"
CA = "identity/ca"
JOIN_TOKENS = "identity/join-tokens"
REPLICAS = "replicas/"
ACKS = "acks/"
REGISTRATIONS = "registrations/"


def live(service: str) -> str:
    return LIVE + _part(service, "service")


def rollout(service: str) -> str:
    return ROLLOUTS + _part(service, "service")


def quarantine(service: str, key: str) -> str:
    return f"{QUARANTINE}{_part(service, 'service')}/{_part(key, 'class key')}"


def slo(service: str) -> str:
    return SLO + _part(service, "service")


def replica(replica_id: str) -> str:
    return REPLICAS + _part(replica_id, "replica id")


def ack(replica_id: str, node: str) -> str:
    return f"{ACKS}{_part(replica_id, 'replica id')}/{_part(node, 'node id')}"


def registration(address: str) -> str:
    return REGISTRATIONS + _part(address, "address")


def _part(name: str, what: str) -> str:
    """One path segment: a name with a '/' would reach into another key's space."""
    if not name or "/" in name:
        raise ValueError(f"{what} {name!r}: must be non-empty, without '/'")
    return name
