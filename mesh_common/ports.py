"""Free loopback ports for tests, the demo and benchmarks."""

import random
import socket
import threading
from pathlib import Path

# Ports the OS hands out itself (bind to port 0, a connection's local end) come from
# ip_local_port_range; a listener port is picked below it, where only an explicit bind takes one.
# A port the OS picked was free a moment ago but could become a new connection's local end
# before Envoy bound it: a listener NACKed "cannot bind: Address already in use".
_SPAN = 12000
_given: set[int] = set()
_lock = threading.Lock()
_random = random.Random()


def _below_ephemeral() -> tuple[int, int] | None:
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    lo = max(1024, first - _SPAN)
    return (lo, first) if first - lo >= 1000 else None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon): below the kernel's
    ephemeral range where it has one, never one this process gave out before."""
    span = _below_ephemeral()
    if span is not None:
        with _lock:
            for _ in range(100):
                port = _random.randrange(*span)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
