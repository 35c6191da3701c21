"""Hosts on one machine: each a Linux network namespace with its own address on a bridge, so
the pieces of a mesh talk over a network and never over loopback.

`HostNetwork(["cp", "rt1", "rt2"])` creates a bridge in the root namespace and, per host, a
namespace whose `eth0` (one end of a veth pair, the other end a bridge port) holds an address
of a private /24 (`10.213.N.0/24`, N the first such subnet that no route or address of the
machine overlaps), with loopback up. The bridge itself holds `.1` of the subnet: the process
that drives the hosts (a test, the demo) reaches every host there and every host reaches it
there, while hosts reach one another by their own addresses. `popen` runs a command inside a
host; `partition` cuts a host off from all others and from the driver; `close` (also at
interpreter exit) stops what ran in the hosts and deletes the namespaces, the veths and the
bridge.

Creating namespaces needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root) and iproute2's `ip`; without
them `check_prerequisites` raises `NamespacesUnavailable` naming what is missing. Each network's
names carry its N, allocated under a lock file, so concurrent runs never collide; a network
whose owner died without closing it is deleted by the next allocation.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mesh_common.process_group import stop_group

MAX_HOSTS = 8
SUBNET_PREFIX = "10.213"
_HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,7}")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_IP_TIMEOUT = 30.0
_LOCK_NAME = "meshlm-netns.lock"
_ALIAS_PREFIX = "meshlm-hosts owner="
_OPEN: list[HostNetwork] = []
_OPEN_LOCK = threading.Lock()


class NamespacesUnavailable(RuntimeError):
    """This process cannot create network namespaces; the message names what is missing."""


class IpCommandError(RuntimeError):
    """An `ip` command failed; the message holds the command and what it printed."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str  # the namespace, for `ip netns exec`
    address: str  # on the namespace's eth0
    port: str  # the root-side end of its veth pair, a port of the bridge


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_prerequisites(ip: str = "ip") -> str:
    """The path of the `ip` command, or `NamespacesUnavailable` naming every missing part."""
    missing = []
    caps = _effective_caps()
    lacking = [
        name
        for name, bit in (("CAP_NET_ADMIN", _CAP_NET_ADMIN), ("CAP_SYS_ADMIN", _CAP_SYS_ADMIN))
        if not caps >> bit & 1
    ]
    if lacking:
        missing.append(
            f"network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); this process "
            f"(uid {os.getuid()}) lacks {' and '.join(lacking)}"
        )
    path = shutil.which(ip)
    if path is None:
        missing.append(f"the `ip` command of iproute2 ({ip!r}) was not found")
    if missing:
        raise NamespacesUnavailable("; ".join(missing))
    assert path is not None
    return path


class HostNetwork:
    """A bridge and one namespace per host name; use as a context manager or call `close`."""

    def __init__(self, hosts: Sequence[str], *, ip: str = "ip") -> None:
        if not 1 <= len(hosts) <= MAX_HOSTS:
            raise ValueError(f"hosts: between 1 and {MAX_HOSTS} names, got {len(hosts)}")
        for name in hosts:
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(f"hosts: {name!r} is not 1-8 of [a-z0-9] starting with a letter")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts: duplicate names in {list(hosts)}")
        self._ip = check_prerequisites(ip)
        self._names = list(hosts)
        self._procs: list[subprocess.Popen[Any]] = []
        self._partitions: dict[str, list[list[str]]] = {}
        self._closed = False
        self.index = 0
        self.hosts: dict[str, Host] = {}
        with _OPEN_LOCK:
            _OPEN.append(self)
        try:
            self.index = _allocate(self._ip)
            self._create()
        except BaseException:
            self.close()
            raise

    @property
    def bridge(self) -> str:
        return f"mlm{self.index}"

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.{self.index}.0/24"

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace, where the driving process is reached."""
        return f"{SUBNET_PREFIX}.{self.index}.1"

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _create(self) -> None:
        ip = self._ip
        for i, name in enumerate(self._names):
            host = Host(
                name=name,
                netns=f"mlm{self.index}-{name}",
                address=f"{SUBNET_PREFIX}.{self.index}.{i + 2}",
                port=f"mlm{self.index}-{name}",
            )
            try:
                _run([ip, "netns", "add", host.netns])
            except IpCommandError as e:
                raise NamespacesUnavailable(f"cannot create a network namespace: {e}") from e
            self.hosts[name] = host
            veth = ["type", "veth", "peer", "name", "eth0", "netns", host.netns]
            _run([ip, "link", "add", host.port, *veth])
            _run([ip, "link", "set", host.port, "master", self.bridge, "up"])
            _run([ip, "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            _run([ip, "-n", host.netns, "link", "set", "eth0", "up"])
            _run([ip, "-n", host.netns, "link", "set", "lo", "up"])

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside `host`, for callers that start processes their own way
        (their children stay in the namespace); `close` kills whatever still runs there."""
        return [self._ip, "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """`argv` inside `host`'s namespace, in a process group of its own: stop it with
        `mesh_common.process_group.stop_group`; `close` stops any still running."""
        if self._closed:
            raise RuntimeError("popen: the host network is closed")
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], *, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """`argv` inside `host`, to completion (killed after `timeout`), its output captured."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            stop_group(proc, timeout=5)
            self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def partition(self, host: str, mode: Literal["link", "blackhole"] = "link") -> None:
        """Cut `host` off from every other host and from the driver until `heal`. "link" takes
        its bridge port down: packets both ways are dropped silently, as when a machine drops
        off the network. "blackhole" adds blackhole routes both ways: sends fail at once."""
        if host in self._partitions:
            raise ValueError(f"partition: {host} is already partitioned")
        if mode not in ("link", "blackhole"):
            raise ValueError(f"partition: mode must be 'link' or 'blackhole', got {mode!r}")
        h = self.hosts[host]
        steps: list[tuple[list[str], list[str]]] = []  # (do, undo)
        if mode == "link":
            link = [self._ip, "link", "set", h.port]
            steps.append(([*link, "down"], [*link, "up"]))
        else:
            peers = [p for p in self.hosts.values() if p.name != host]
            routes = [(h.netns, p.address) for p in peers] + [(h.netns, self.gateway)]
            routes += [(p.netns, h.address) for p in peers] + [(None, h.address)]
            for netns, dest in routes:
                where = ["-n", netns] if netns else []
                route = ["blackhole", f"{dest}/32"]
                steps.append(
                    (
                        [self._ip, *where, "route", "add", *route],
                        [self._ip, *where, "route", "del", *route],
                    )
                )
        undo: list[list[str]] = []
        self._partitions[host] = undo  # close undoes a partial one too
        try:
            for do, then in steps:
                _run(do)
                undo.append(then)
        except BaseException:
            for argv in self._partitions.pop(host):
                _run(argv, check=False)
            raise

    def heal(self, host: str) -> None:
        """Undo `partition(host)`."""
        if host not in self._partitions:
            raise ValueError(f"heal: {host} is not partitioned")
        for argv in self._partitions.pop(host):
            _run(argv)

    def close(self) -> None:
        """Stop what runs in the hosts, delete the namespaces, the veths and the bridge; also
        after a failed start, and more than once."""
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self._procs):
            stop_group(proc, timeout=5)
        for undo in self._partitions.values():
            for argv in undo:
                _run(argv, check=False)  # the root namespace's blackhole routes among them
        if self.index:
            for netns in [h.netns for h in self.hosts.values()]:
                _delete_netns(self._ip, netns)
            for name in self._names:
                _run([self._ip, "link", "del", f"mlm{self.index}-{name}"], check=False)
            _run([self._ip, "link", "del", self.bridge], check=False)
        with _OPEN_LOCK:
            if self in _OPEN:
                _OPEN.remove(self)


@atexit.register
def _close_all() -> None:
    with _OPEN_LOCK:
        nets = list(_OPEN)
    for net in reversed(nets):
        net.close()


def _run(argv: list[str], *, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and done.returncode != 0:
        raise IpCommandError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _delete_netns(ip: str, netns: str) -> None:
    """Kill whatever still runs inside (a namespace lives on while a process holds it), then
    delete it, which deletes its end of the veth pair and so the pair."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        pids = [int(p) for p in _run([ip, "netns", "pids", netns], check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
    _run([ip, "netns", "del", netns], check=False)


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first, start time 20th), or []
    when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    path = Path("/run") / _LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = os.open(Path(tempfile.gettempdir()) / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _owner_tag() -> str:
    return f"{_ALIAS_PREFIX}{os.getpid()}/{_stat(os.getpid())[19]}"


def _owner_alive(alias: str) -> bool:
    pid, _, start = alias.removeprefix(_ALIAS_PREFIX).partition("/")
    fields = _stat(int(pid)) if pid.isdigit() else []
    return len(fields) > 19 and fields[0] != "Z" and fields[19] == start


def _links(ip: str) -> dict[str, str]:
    """Name -> alias ("" when none) of every link of the root namespace."""
    links: dict[str, str] = {}
    name = ""
    for line in _run([ip, "-o", "link", "show"]).splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        m = re.search(r"\salias (.*?)(?:\\|$)", line)
        links[name] = m.group(1).strip() if m else ""
    return links


def _used_networks(ip: str) -> list[ipaddress.IPv4Network]:
    nets = []
    out = _run([ip, "-4", "-o", "route", "show", "table", "all"])
    out += _run([ip, "-4", "-o", "addr", "show"])
    for token in re.findall(r"(?<![\w.])(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", out):
        net = ipaddress.ip_network(token, strict=False)
        if net.prefixlen:  # a default route overlaps everything and takes no address
            nets.append(net)
    return nets


def _allocate(ip: str) -> int:
    """Under the machine-wide lock: delete networks whose owner died, then create the bridge of
    the first free N (its alias names this process) and return N."""
    with _machine_lock():
        links = _links(ip)
        netns_names = _run([ip, "netns", "list"], check=False).split()
        live = {
            int(name[3:])
            for name, alias in links.items()
            if re.fullmatch(r"mlm\d+", name) and _owner_alive(alias)
        }
        for netns in netns_names:
            m = re.fullmatch(r"mlm(\d+)-[a-z0-9]+", netns)
            if m and int(m.group(1)) not in live:
                _delete_netns(ip, netns)
        for name in links:
            m = re.fullmatch(r"mlm(\d+)(-[a-z0-9]+)?", name)
            if m and int(m.group(1)) not in live:
                _run([ip, "link", "del", name], check=False)
        for line in _run([ip, "-4", "-o", "route", "show", "type", "blackhole"]).splitlines():
            dest = line.split()[1]
            m = re.fullmatch(re.escape(SUBNET_PREFIX) + r"\.(\d+)\.\d+", dest)
            if m and int(m.group(1)) not in live:
                _run([ip, "route", "del", "blackhole", f"{dest}/32"], check=False)
        used = _used_networks(ip)
        for index in range(1, 255):
            subnet = ipaddress.ip_network(f"{SUBNET_PREFIX}.{index}.0/24")
            if index in live or any(subnet.overlaps(n) for n in used):
                continue
            bridge = f"mlm{index}"
            _run([ip, "link", "add", bridge, "type", "bridge"])
            try:
                _run([ip, "link", "set", bridge, "alias", _owner_tag()])
                _run([ip, "addr", "add", f"{SUBNET_PREFIX}.{index}.1/24", "dev", bridge])
                _run([ip, "link", "set", bridge, "up"])
            except BaseException:
                _run([ip, "link", "del", bridge], check=False)
                raise
            return index
    raise NamespacesUnavailable(
        f"no free /24 in {SUBNET_PREFIX}.0.0/16: every one overlaps a route or address here"
    )
