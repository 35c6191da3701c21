"""Canary rollouts: the controller, its spec and admin API, the gates by source, quality scoring
and the liveness probe."""
