"""mesh_common.ports.free_port: listener ports that no outgoing connection can take first."""

import socket
from pathlib import Path

from mesh_common.ports import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < first for p in ports), (first, sorted(ports))
    for p in ports[:8]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))  # free: nothing of ours holds it
