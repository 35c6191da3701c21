"""The environment a child process gets: this one's, less meshlm's secrets.

A runtime, a sidecar, an Envoy, an etcd member or an operator's scaler command needs none of
them; one that does (a control plane replica: its admin token) gets it passed explicitly in
`extra`, never inherited.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Names whose values grant something: the admin API's bearer token, a caller's API key, the
# state store's password.
SECRETS = frozenset({"MESHLM_ADMIN_TOKEN", "MESHLM_API_KEY", "MESHLM_ETCD_PASSWORD"})


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without SECRETS, then `extra` over it."""
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    env.update(extra or {})
    return env
