"""Reaching a host's loopback from the driving process: a worker thread that entered the host's
network namespace (setns(2) moves only the calling thread), so the sockets of what it runs are
opened there. For plain blocking clients (urllib, http.client) that open their socket in the
calling thread; gRPC opens its sockets on threads of its own and must run inside the host
instead (`HostNetwork.popen`)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _enter(netns: str) -> None:
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class NamespaceThread:
    """One thread inside the network namespace `netns` (`ip netns` name); `call(fn, ...)` runs
    `fn` there and returns its result. `close` ends the thread."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{netns}")
        self._pool.submit(_enter, netns).result()  # fails here, not at the first call

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
