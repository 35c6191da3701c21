"""The control plane's state store: `base` has the contract, `etcd` and `file` the two stores,
`url` opens one from its URL. The package re-exports that public face."""

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
from xds_server.store.etcd import EtcdStore
from xds_server.store.file import FileStore
from xds_server.store.url import open_store

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
