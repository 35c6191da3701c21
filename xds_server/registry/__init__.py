"""Workload registration: hosts that register their own endpoints over a stream on the gRPC port,
kept in memory while their stream lives (and a grace period after), laid over the mesh's static
endpoints before each change is staged."""
