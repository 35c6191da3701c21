"""Workload registration: hosts that register their own endpoints over a stream on the gRPC port,
kept while their stream lives (and a grace period after), laid over the mesh's static endpoints
before each change is staged. A control plane alone saves them to its state dir (journal.py) so
a restart keeps them; replicas on a store share them through it (store.py)."""
