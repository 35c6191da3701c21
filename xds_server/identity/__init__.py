"""Workload identity: the mesh CA and the join-token + CSR signing service."""
