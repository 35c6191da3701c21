"""meshlm/demo/hosts.py on real network namespaces, veths and a bridge (tests and CI run as
root): hosts reach one another over TCP at their own addresses, a partitioned host is cut off
until healed, and nothing of a network outlives it, however its owner ended."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from mesh_common.process_group import stop_group
from meshlm.demo.hosts import (
    HostNetwork,
    IpCommandError,
    NamespacesUnavailable,
    check_prerequisites,
)

PORT = 9000
# Accepts until stopped; to each connection: the peer address it saw, then N lines echoed.
SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen()
    print("listening", flush=True)
    while True:
        c, peer = s.accept()
        c.settimeout(5)
        with c, c.makefile("rwb") as f:
            f.write(peer[0].encode() + b"\\n")
            f.flush()
            for line in f:
                f.write(line)
                f.flush()
    """
)
# Connects within 2 s, sends argv[3] lines and reads them back; prints the peer address the
# server saw, or the error; exits 0 only when every line came back.
CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
        c.settimeout(5)
        f = c.makefile("rwb")
        seen = f.readline().decode().strip()
        for i in range(int(sys.argv[3])):
            f.write(b"line %d\\n" % i)
            f.flush()
            assert f.readline() == b"line %d\\n" % i
    except (OSError, AssertionError) as e:
        print("failed", repr(e))
        sys.exit(1)
    print("seen", seen)
    """
)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _leftovers(index: int) -> list[str]:
    """Whatever of network `index` is still on the machine: namespaces, links, routes."""
    names = _ip("netns", "list").split()
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link").splitlines()]
    routes = _ip("-4", "-o", "route", "show", "table", "all").splitlines()
    return (
        [n for n in names if n.startswith(f"mlm{index}-")]
        + [n for n in links if n == f"mlm{index}" or n.startswith(f"mlm{index}-")]
        + [r for r in routes if f"10.213.{index}." in r]
    )


def _serve(net: HostNetwork, host: str, address: str | None = None) -> subprocess.Popen:
    proc = net.popen(
        host,
        [sys.executable, "-c", SERVER, address or net[host].address, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
    return proc


def _call(net: HostNetwork, host: str | None, dest: str, lines: int = 1) -> tuple[bool, str]:
    """From `host` (None: the root namespace), `lines` lines to `dest`:PORT and back."""
    argv = [sys.executable, "-c", CLIENT, dest, str(PORT), str(lines)]
    if host is None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    else:
        done = net.run(host, argv, timeout=30)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


@pytest.fixture
def net() -> Iterator[HostNetwork]:
    with HostNetwork(["a", "b", "c"]) as n:
        yield n
    assert _leftovers(n.index) == []


def test_hosts_have_their_own_addresses_and_reach_each_other_over_tcp(net: HostNetwork) -> None:
    addresses = {h.address for h in net.hosts.values()}
    assert len(addresses) == 3 and net.gateway not in addresses
    assert all(a.startswith("10.213.") for a in addresses)
    out = net.run("a", ["ip", "-4", "-o", "addr", "show"]).stdout
    assert f"inet {net['a'].address}/24" in out and "lo" in out and "127.0.0.1" in out
    server = _serve(net, "b")
    try:
        ok, out = _call(net, "a", net["b"].address, lines=20)
        assert ok, out
        assert out == f"seen {net['a'].address}"  # a's own address, not loopback
        ok, out = _call(net, "c", net["b"].address, lines=20)
        assert ok and out == f"seen {net['c'].address}", out
    finally:
        stop_group(server)


def test_driver_and_hosts_reach_each_other_at_the_bridge_address(net: HostNetwork) -> None:
    server = _serve(net, "b")
    try:
        ok, out = _call(net, None, net["b"].address)
        assert ok and out == f"seen {net.gateway}", out
    finally:
        stop_group(server)
    root_server = subprocess.Popen(
        [sys.executable, "-c", SERVER, net.gateway, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert root_server.stdout is not None and root_server.stdout.readline() == "listening\n"
        ok, out = _call(net, "a", net.gateway)
        assert ok and out == f"seen {net['a'].address}", out
    finally:
        stop_group(root_server)


def test_a_host_is_not_reachable_on_another_hosts_loopback(net: HostNetwork) -> None:
    server = _serve(net, "b", address="127.0.0.1")
    try:
        ok, out = _call(net, "a", "127.0.0.1")
        assert not ok, out
    finally:
        stop_group(server)


@pytest.mark.parametrize("mode", ["link", "blackhole"])
def test_a_partitioned_host_is_cut_off_until_healed(net: HostNetwork, mode: str) -> None:
    servers = [_serve(net, "b"), _serve(net, "c")]
    try:
        ok, out = _call(net, "a", net["b"].address)
        assert ok, out
        net.partition("b", mode)  # type: ignore[arg-type]
        for src in ("a", "c", None):
            start = time.monotonic()
            ok, out = _call(net, src, net["b"].address)
            assert not ok, f"{src} reached a partitioned host: {out}"
            assert time.monotonic() - start < 20
        ok, out = _call(net, "a", net["c"].address)  # the others still reach one another
        assert ok, out
        net.heal("b")
        deadline = time.monotonic() + 20
        while not (ok := _call(net, "a", net["b"].address)[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ok
        ok, out = _call(net, "b", net.gateway)
        assert not ok and "refused" in out, out  # healed: reached the driver, no one listens
    finally:
        for server in servers:
            stop_group(server)


def test_close_deletes_everything_even_with_a_partition_and_a_process_still_running() -> None:
    with pytest.raises(RuntimeError, match="boom"), HostNetwork(["a", "b"]) as n:
        _serve(n, "a")
        orphan = subprocess.Popen(n.command("b", ["sleep", "300"]))  # not started by n
        n.partition("a", "blackhole")
        assert _leftovers(n.index)
        raise RuntimeError("boom")
    assert orphan.wait(timeout=10) != 0
    assert _leftovers(n.index) == []
    n.close()  # again: nothing to do


def test_a_network_left_open_is_deleted_at_interpreter_exit() -> None:
    code = "from meshlm.demo.hosts import HostNetwork\nn = HostNetwork(['a'])\nprint(n.index)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _leftovers(int(done.stdout)) == []


def test_a_network_whose_owner_was_killed_is_deleted_by_the_next_one() -> None:
    code = textwrap.dedent(
        """
        import os, signal
        from meshlm.demo.hosts import HostNetwork
        n = HostNetwork(['a', 'b'])
        n.partition('a', 'blackhole')
        print(n.index, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    index = int(done.stdout)
    assert _leftovers(index)
    with HostNetwork(["a"]) as n:
        assert f"mlm{index}-b" not in _ip("netns", "list").split()
        assert f"10.213.{index}." not in _ip("-4", "route", "show", "type", "blackhole")
        if n.index != index:
            assert _leftovers(index) == []


def test_networks_open_at_once_get_their_own_subnets_and_names() -> None:
    with HostNetwork(["a"]) as one, HostNetwork(["a"]) as two:
        assert one.index != two.index
        assert one.subnet != two.subnet and one["a"].netns != two["a"].netns


def test_a_missing_ip_command_is_named() -> None:
    with pytest.raises(NamespacesUnavailable, match=r"`ip` command.*'/nonexistent/ip'"):
        check_prerequisites(ip="/nonexistent/ip")
    with pytest.raises(NamespacesUnavailable, match="/nonexistent/ip"):
        HostNetwork(["a"], ip="/nonexistent/ip")


def test_without_root_the_missing_capabilities_are_named() -> None:
    nobody = pwd.getpwnam("nobody")
    code = textwrap.dedent(
        """
        from meshlm.demo.hosts import HostNetwork, NamespacesUnavailable
        try:
            HostNetwork(['a'])
        except NamespacesUnavailable as e:
            print(e)
        """
    )
    done = subprocess.run(
        [
            *("setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"),
            *(sys.executable, "-c", code),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr
    assert "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in done.stdout, done.stdout
    assert f"uid {nobody.pw_uid}" in done.stdout


@pytest.mark.parametrize(
    ("hosts", "field"),
    [
        ([], "between 1 and 8"),
        ([f"h{i}" for i in range(9)], "between 1 and 8"),
        (["a", "a"], "duplicate"),
        (["A"], "'A'"),
        (["x" * 9], "1-8"),
    ],
)
def test_bad_host_names_are_refused_before_anything_is_created(
    hosts: list[str], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        HostNetwork(hosts)


def test_healing_a_host_that_is_not_partitioned_is_refused(net: HostNetwork) -> None:
    with pytest.raises(ValueError, match="heal: b is not partitioned"):
        net.heal("b")
    net.partition("b")
    with pytest.raises(ValueError, match="partition: b is already partitioned"):
        net.partition("b", "blackhole")


def test_a_partition_that_fails_half_way_is_undone_and_names_the_failing_command(
    net: HostNetwork,
) -> None:
    b = net["b"].address
    _ip("route", "add", "blackhole", f"{b}/32")  # the last route the partition adds
    try:
        with pytest.raises(IpCommandError, match=f"route add blackhole {b}/32` exited"):
            net.partition("b", "blackhole")
        for host in net.hosts.values():
            assert "blackhole" not in _ip("-n", host.netns, "route", "show", "table", "all")
    finally:
        _ip("route", "del", "blackhole", f"{b}/32")
    net.partition("b", "blackhole")
    assert not _call(net, "a", b)[0]
    net.heal("b")
