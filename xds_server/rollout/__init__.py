"""Canary rollouts: the controller and its admin API, the gates by source (`gates/`), the
verdict of an interval, quality scoring and the liveness probe. A rollout's spec is desired
state, parsed with the mesh file (xds_server/mesh/rollout_spec.py)."""
