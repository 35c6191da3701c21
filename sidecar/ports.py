"""Free loopback ports for tests, the demo and benchmarks."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; the caller binds it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
