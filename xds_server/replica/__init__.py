"""Replicas of the control plane on one store: leader election, the leader's work, replication of
desired state."""
