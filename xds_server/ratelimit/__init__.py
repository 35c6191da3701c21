"""Tenant rate limits: the global rate-limit service and the per-sidecar shares of a mesh-wide
limit."""
