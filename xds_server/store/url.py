"""A store URL -> a `Store`: `open_store` (etcd, etcds, file), its usage text and key root."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from xds_server.store.base import Store
from xds_server.store.etcd import DEFAULT_TIMEOUT, EtcdStore
from xds_server.store.etcd_access import parse_access
from xds_server.store.file import FileStore

USAGE = (
    "etcds://HOST:PORT[,HOST:PORT...][/ROOT]?creds=DIR (TLS + etcd auth; or ca=, cert=, key=, "
    "user=, password_file=), etcd://... (plaintext, no auth) or file:PATH"
)
log = logging.getLogger("meshlm.store")
# What a store URL's ROOT may hold: path segments of letters, digits, . _ -
ROOT = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*\Z")


def open_store(url: str, *, timeout: float = DEFAULT_TIMEOUT) -> Store:
    """A store from its URL: `etcds://h1:2379,h2:2379/prod?creds=DIR` (keys under /prod/;
    default /meshlm/; TLS and etcd auth as xds_server/store/etcd_access.py reads them),
    `etcd://...` (plaintext) or `file:PATH` (one control plane). ValueError names what is
    wrong."""
    if url.startswith("file:"):
        path = url.removeprefix("file:").removeprefix("//")
        if not path:
            raise ValueError(f"store {url!r}: no path (expected {USAGE})")
        return FileStore(Path(path))
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise ValueError(f"store {url!r}: unknown kind (expected {USAGE})")
    rest, _, query = rest.partition("?")
    hosts, _, root = rest.partition("/")
    root = root.strip("/")
    if root and not ROOT.match(root):
        raise ValueError(f"store {url!r}: root {root!r}: letters, digits, . _ - and / only")
    try:
        store = EtcdStore(
            [h for h in hosts.split(",") if h],
            root=store_root(root),
            timeout=timeout,
            access=parse_access(query, tls=scheme == "etcds"),
        )
    except ValueError as e:
        raise ValueError(f"store {url!r}: {e} (expected {USAGE})") from None
    if not store.access.secure:
        missing = " and ".join(
            w for w, ok in (("TLS", store.access.tls), ("auth", store.access.user)) if not ok
        )
        log.warning(
            "store %s: without %s: anyone who can reach etcd can read the mesh and rewrite what "
            "every replica serves (`meshlm etcd` sets up TLS and auth: see its --help)",
            store.describe(), missing,
        )  # fmt: skip
    return store


def store_root(root: str = "") -> str:
    """The key prefix of a URL's ROOT: /ROOT/, /meshlm/ when none is given."""
    return f"/{root.strip('/') or 'meshlm'}/"
