"""Why a listening port cannot be had, in the operating system's words. gRPC only says that a
bind failed (and logs the reason on stderr), so servers ask here first."""

from __future__ import annotations

import socket


def listen_error(host: str, port: int) -> str | None:
    """None when `host:port` can be bound now (port 0 always can), else the reason in lower case,
    e.g. "address already in use". SO_REUSEADDR as gRPC and http.server set it, so a port with
    only TIME_WAIT connections counts as free; SO_REUSEPORT not, so any live listener blocks it."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(1)
    except OSError as e:
        return (e.strerror or str(e)).lower()
    return None
