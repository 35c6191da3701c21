"""The control plane's state store (issue 15): xds_server/store/base.py has the contract."""

from __future__ import annotations

import re
from pathlib import Path

from xds_server.store.base import (
    Check,
    Compacted,
    Conflict,
    Delete,
    Entry,
    Event,
    Fence,
    Fenced,
    LeaseLost,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    Watch,
    encode,
)
from xds_server.store.etcd import DEFAULT_TIMEOUT, EtcdStore
from xds_server.store.file import FileStore

USAGE = "etcd://HOST:PORT[,HOST:PORT...][/ROOT] or file:PATH"
_ROOT = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*\Z")


def open_store(url: str, *, timeout: float = DEFAULT_TIMEOUT) -> Store:
    """A store from its URL: `etcd://h1:2379,h2:2379/prod` (keys under /prod/; default
    /meshlm/) or `file:PATH` (one control plane). ValueError names what is wrong."""
    if url.startswith("file:"):
        path = url.removeprefix("file:").removeprefix("//")
        if not path:
            raise ValueError(f"store {url!r}: no path (expected {USAGE})")
        return FileStore(Path(path))
    if not url.startswith("etcd://"):
        raise ValueError(f"store {url!r}: unknown kind (expected {USAGE})")
    hosts, _, root = url.removeprefix("etcd://").partition("/")
    root = root.strip("/")
    if root and not _ROOT.match(root):
        raise ValueError(f"store {url!r}: root {root!r}: letters, digits, . _ - and / only")
    try:
        return EtcdStore(
            [h for h in hosts.split(",") if h],
            root=f"/{root or 'meshlm'}/",
            timeout=timeout,
        )
    except ValueError as e:
        raise ValueError(f"store {url!r}: {e} (expected {USAGE})") from None


__all__ = [
    "Check",
    "Compacted",
    "Conflict",
    "Delete",
    "Entry",
    "EtcdStore",
    "Event",
    "Fence",
    "Fenced",
    "FileStore",
    "LeaseLost",
    "Put",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "Watch",
    "encode",
    "open_store",
]
