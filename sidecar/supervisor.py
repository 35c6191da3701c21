"""Supervise one sidecar Envoy: start, wait ready, restart with backoff on crash, keep the
last-known-good config, drain and stop.

When Envoy has to (re)start while the control plane is unreachable, it boots from the last config
it accepted, made static (`sidecar.lkg`); once the control plane answers again the supervisor
hot-restarts Envoy onto ADS (`--restart-epoch`, same base id): the new Envoy takes the listen
sockets over and the old one drains only after the new one has its config, so no call is lost.
(Envoy cannot move a running process from static listeners to LDS: static ones are immutable.)

Envoy dies with its supervisor (parent-death signal), its admin port is checked to be its own,
and a port another process holds is fatal ("address already in use"), not a crash loop. So is a
control plane that speaks TLS to a sidecar without identity, or plaintext to one with identity
(a mismatch of workload identity): Envoy would only retry in silence.

With identity, Envoy starts once the agent holds a certificate, and reaches the control plane
over mTLS, taking only the control plane's SPIFFE ID in the sidecar's trust domain.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
from collections.abc import Callable
from typing import Any

from sidecar.bootstrap import control_plane_id, with_ads_tls, with_sds
from sidecar.envoy_process import EnvoyError, EnvoyProcess
from sidecar.identity import IdentityAgent
from sidecar.lkg import Keys, LastKnownGood, static_bootstrap

OUTBOUND_LISTENER = "outbound"  # the control plane's name for it (xds_server/resources/names.py)

log = logging.getLogger("meshlm.sidecar")


class PortInUse(EnvoyError):
    """Another process holds a port of this sidecar: restarting cannot fix that."""


class WrongTransport(EnvoyError):
    """The control plane speaks TLS and this sidecar has no identity, or the other way round."""


def _port_in_use(text: str) -> str | None:
    for line in text.splitlines():
        if "address already in use" in line.lower():
            return line.strip()
    return None


def reachable(address: tuple[str, int], timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


# HTTP/2's client connection preface and an empty SETTINGS frame (RFC 9113, 3.4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


# TLS record types a server answers a ClientHello with: handshake (its ServerHello), alert.
_TLS_ANSWERS = (22, 21)


def _client_hello() -> bytes:
    """The bytes of a TLS ClientHello, made by an in-memory handshake that goes no further."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def speaks_tls(address: tuple[str, int], timeout: float = 2.0) -> bool | None:
    """Whether the server at `address` speaks TLS (True) or plaintext HTTP/2 (False); None when
    it cannot tell (down, or it closed the connection). Only the protocol is asked: a TLS
    server answers a ClientHello with a handshake record, and the connection closes there,
    before a server that requires client certificates would log a failed handshake."""
    try:
        conn = socket.create_connection(address, timeout=timeout)
    except OSError:
        return None
    with conn:
        try:
            conn.sendall(_client_hello())
            head = conn.recv(1)
        except OSError:  # a plaintext server may reset a connection that does not speak h2
            head = b""
    if head and head[0] in _TLS_ANSWERS:
        return True
    try:  # not TLS: a plaintext HTTP/2 server answers the preface with its SETTINGS
        with socket.create_connection(address, timeout=timeout) as s:
            s.sendall(_H2_PREFACE)
            head = s.recv(9)
    except OSError:
        return None
    return False if len(head) >= 4 and head[3] == 4 else None


class Supervisor:
    """Keeps one Envoy running for `node_id`. `bootstrap` is the ADS bootstrap (its admin port
    must be fixed so readers of stats keep one address across restarts); `xds_address` is the
    control plane, or the list of its replicas: any one that answers will do."""

    def __init__(
        self,
        node_id: str,
        bootstrap: dict[str, Any],
        xds_address: tuple[str, int] | list[tuple[str, int]],
        *,
        lkg: LastKnownGood | None = None,
        concurrency: int = 1,
        drain_time_s: float = 2.0,
        poll_interval: float = 0.5,
        backoff: tuple[float, float] = (0.2, 15.0),
        on_event: Callable[[str], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        keys: Callable[[], Keys] | None = None,
        identity: IdentityAgent | None = None,
    ) -> None:
        """`keys` reads tenant -> plaintext keys for a native-authz last-known-good boot;
        `on_fatal` is told when the supervisor gives up (a port held by another process);
        `identity`: the agent whose SDS socket Envoy reads certificates from, started
        before Envoy and stopped after it."""
        self.node_id = node_id
        self.bootstrap = bootstrap
        self.xds_addresses = [xds_address] if isinstance(xds_address, tuple) else list(xds_address)
        if not self.xds_addresses:
            raise ValueError("xds_address: at least one control plane HOST:PORT")
        self.lkg = lkg or LastKnownGood()
        self.concurrency = concurrency
        self.drain_time_s = drain_time_s
        self.poll_interval = poll_interval
        self.backoff = backoff
        self.on_event = on_event or (lambda msg: log.info("%s: %s", node_id, msg))
        self.on_fatal = on_fatal or (lambda msg: None)
        self.keys = keys
        self.identity = identity
        if identity:
            with_sds(bootstrap, identity.socket_path)
        self.failed: str | None = None  # why the supervisor gave up
        self._config_seen = False  # the control plane sent listeners to this Envoy
        self.envoy: EnvoyProcess | None = None
        self.mode = "stopped"  # "ads" | "lkg" | "stopped"
        self.restarts = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.saved_at: float | None = None  # when the last-known-good config was last stored

    @property
    def ready(self) -> bool:
        """Envoy is up and LIVE (in ADS or last-known-good mode)."""
        return self._ready.is_set()

    @property
    def configured(self) -> bool:
        """Envoy is up with listeners: from the control plane, or its last-known-good copy."""
        return self.ready and (self.mode == "lkg" or self._config_seen)

    @property
    def admin_port(self) -> int:
        return self.bootstrap["admin"]["address"]["socket_address"]["port_value"]

    def start(self) -> Supervisor:
        if self.identity:
            self.identity.start()
        self._thread = threading.Thread(
            target=self._run, name=f"sidecar-{self.node_id}", daemon=True
        )
        self._thread.start()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self._ready.wait(timeout):
            tail = self.envoy.log_tail() if self.envoy else ""
            raise EnvoyError(f"sidecar {self.node_id} not ready after {timeout}s\n{tail}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            # The thread drains and stops Envoy itself: Envoy dies with the thread that
            # started it (parent-death signal), so it must outlive the drain.
            self._thread.join(timeout=self.drain_time_s + 15)
        self._shutdown_envoy()
        if self.identity:
            self.identity.stop()
        self.mode = "stopped"

    # -- the loop -------------------------------------------------------------------------

    def _new_envoy(self, boot: dict[str, Any]) -> EnvoyProcess:
        return EnvoyProcess(
            boot,
            concurrency=self.concurrency,
            extra_args=self._envoy_args(),
            die_with_parent=True,
            hot_restart=True,
            # One base id per sidecar (its admin port is its own): an Envoy killed with its
            # supervisor leaves 104 bytes of shared memory that the next one reuses.
            base_id=self.admin_port or None,
        )

    def _envoy_args(self) -> tuple[str, ...]:
        drain = int(self.drain_time_s)
        args = ("--drain-time-s", str(drain), "--drain-strategy", "immediate")
        # After a hot restart the old Envoy drains, then exits (the default waits 900 s).
        args += ("--parent-shutdown-time-s", str(drain + 1))
        # Access logs reach the log within a second (Envoy's default buffers them 10 s).
        return (*args, "--file-flush-interval-msec", "1000")

    def _answering(self) -> tuple[str, int] | None:
        """The first control plane replica that accepts a connection, else None (Envoy itself
        fails over between all of them, so any one up means ADS will configure it)."""
        for address in self.xds_addresses:
            if reachable(address):
                return address
        return None

    def _launch(self) -> None:
        res = self.lkg.get(self.node_id)
        cp = self._answering()
        cp_up = cp is not None
        if cp is not None:
            self._check_transport(cp)
        if cp_up or res is None:
            boot, mode = self.bootstrap, "ads"
        else:
            boot, mode = static_bootstrap(self.bootstrap, res, keys=self._keys()), "lkg"
        self.envoy = self._new_envoy(boot).start()
        self._config_seen = False
        waited = mode == "ads" and not cp_up
        if waited:
            where = ", ".join(f"{h}:{p}" for h, p in self.xds_addresses)
            self.on_event(f"waiting for the control plane at {where}: no listeners until "
                          "it answers (and no last-known-good config)")  # fmt: skip
        self._wait_ready(self.envoy)
        self.mode = mode
        configured = mode == "lkg" or self._follow_ads()
        self._ready.set()
        if not configured:
            self.on_event("envoy up (ads), still waiting for the control plane: no listeners yet")
        elif waited:
            self.on_event("config from the control plane arrived: envoy ready (ads)")
        else:
            self.on_event(f"envoy ready ({mode})")
        self.on_event(self._where())

    def _where(self) -> str:
        """What a user looks for once a sidecar is up: its listeners, Envoy's admin
        URL and the log file."""
        try:
            doc = json.loads(self.envoy.admin_get("/listeners?format=json"))
            found = []
            for ls in doc.get("listener_statuses", []):
                sa = ls.get("local_address", {}).get("socket_address", {})
                name = ls.get("name", "")
                found.append(f"{name} {sa.get('address')}:{sa.get('port_value')}{self._for(name)}")
            listeners = ", ".join(found) or "none yet"
        except (OSError, ValueError) as e:
            listeners = f"unknown ({e})"
        return f"listeners: {listeners}; admin {self.envoy.admin_url}; log {self.envoy.log_path}"

    def _for(self, listener: str) -> str:
        """What a listener is for, in a few words."""
        if listener == OUTBOUND_LISTENER:
            return " (local callers: meshlm generate --target HOST:PORT --authority SERVICE)"
        if listener.startswith("inbound|"):
            if self.identity:
                return " (mTLS from mesh workloads only: callers go through their sidecar)"
            return " (callers' sidecars, in front of the local runtime)"
        return ""

    def _keys(self) -> Keys | None:
        return self.keys() if self.keys else None

    def _wait_ready(self, envoy: EnvoyProcess) -> None:
        try:
            envoy.wait_ready(timeout=60)
        except EnvoyError as e:
            held = _port_in_use(str(e))
            if "unable to bind domain socket" in str(e):  # the hot-restart id is the admin port
                held = f"admin port {self.admin_port}: address already in use by another Envoy"
            if held:
                raise PortInUse(held) from None
            raise

    def _check_transport(self, address: tuple[str, int]) -> None:
        """WrongTransport when the control plane at `address` and this sidecar disagree on
        mTLS."""
        tls = speaks_tls(address)
        host, port = address
        if tls and not self.identity:
            raise WrongTransport(
                f"the control plane at {host}:{port} requires mTLS (its mesh has an identity "
                "block): start this sidecar with --identity and a join token (meshlm identity "
                "token)"
            )
        if tls is False and self.identity:
            raise WrongTransport(
                f"the control plane at {host}:{port} serves ADS in plaintext (its mesh has no "
                "identity block, or identity.mtls: off) but this sidecar has --identity"
            )

    def _await_certificate(self) -> bool:
        """Wait until the agent holds a certificate, then point the xds cluster at the control
        plane's SPIFFE ID in its trust domain; False when stopped first."""
        assert self.identity is not None
        if not self.identity.wait_ready(0):
            self.on_event("waiting for a certificate from the mesh CA before starting envoy")
        while not self.identity.wait_ready(0.5):
            if self._stop.is_set():
                return False
        with_ads_tls(self.bootstrap, control_plane_id(self.identity.spiffe_id))
        return True

    def _run(self) -> None:
        try:
            if self.identity and not self._await_certificate():
                return
            self._loop()
        except PortInUse as e:
            self.failed = f"giving up: another process holds a port of this sidecar: {e}"
            self.on_event(self.failed)
            self.on_fatal(self.failed)
        except WrongTransport as e:
            self.failed = f"giving up: {e}"
            self.on_event(self.failed)
            self.on_fatal(self.failed)
        finally:
            self._ready.clear()
            self._shutdown_envoy()

    def _loop(self) -> None:
        delay = self.backoff[0]
        started = time.monotonic()
        while not self._stop.is_set():
            try:
                self._launch()
                started = time.monotonic()
                self._watch()
            except (PortInUse, WrongTransport):
                raise
            except Exception as e:  # whatever broke, the sidecar keeps trying (with backoff)
                self.on_event(f"envoy failed: {(str(e) or repr(e)).splitlines()[0]}")
            if self._stop.is_set():
                return
            self._ready.clear()
            self._shutdown_envoy()
            self.restarts += 1
            # Backoff resets once an Envoy stayed up for a minute (a crash loop is not).
            if time.monotonic() - started > 60:
                delay = self.backoff[0]
            self.on_event(f"restarting envoy in {delay:.1f}s")
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff[1])

    def _watch(self) -> None:
        """Returns when Envoy died or must be replaced."""
        while not self._stop.wait(self.poll_interval):
            assert self.envoy is not None and self.envoy.proc is not None
            if self.envoy.proc.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.envoy.proc.returncode}")
            if self.mode == "lkg":
                if (cp := self._answering()) is not None:
                    self._check_transport(cp)
                    self._switch_to_ads()
                continue
            self._follow_ads()

    def _switch_to_ads(self) -> None:
        """Hot restart from the last-known-good Envoy onto an ADS one (see module doc)."""
        old = self.envoy
        assert old is not None and old.proc is not None
        self.on_event("control plane is back: hot restart from last-known-good onto ADS")
        self.envoy = old.hot_restart_into(self.bootstrap)
        self._config_seen = False
        try:
            self._wait_ready(self.envoy)
        except BaseException:
            old.stop()
            raise
        # Once the new Envoy is initialized the old one drains and exits by itself.
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.proc.wait(timeout=self.drain_time_s + 10)
        old.stop()
        self.mode = "ads"
        self.on_event(f"envoy ready (ads), restart epoch {self.envoy.restart_epoch}")

    def _follow_ads(self) -> bool:
        """Refuse a port held elsewhere, note the control plane's first config, keep the
        last-known-good copy current. True once listeners came from the control plane."""
        assert self.envoy is not None
        try:
            dump = self.envoy.config_dump_eds()
        except (OSError, urllib.error.URLError, ValueError):
            return self._config_seen
        lds = _listeners_dump(dump)
        for d in lds.get("dynamic_listeners", []):
            held = _port_in_use(d.get("error_state", {}).get("details", ""))
            if held:
                raise PortInUse(f"listener {d.get('name')}: {held}")
        if not self._config_seen and lds.get("version_info"):
            self._config_seen = True
            if self.ready:  # else _launch says it is ready
                self.on_event(f"config from the control plane arrived ({lds['version_info']})")
        if self.lkg.put(self.node_id, dump):
            self.saved_at = time.time()
        return self._config_seen

    def _shutdown_envoy(self) -> None:
        if self.envoy is None:
            return
        try:
            if self.envoy.proc is not None and self.envoy.proc.poll() is None:
                self.envoy.admin_post("/drain_listeners?graceful")
                time.sleep(min(self.drain_time_s, 1.0))
        except (OSError, urllib.error.URLError):
            pass
        self.envoy.stop()


def _listeners_dump(dump: dict[str, Any]) -> dict[str, Any]:
    for c in dump.get("configs", []):
        if c.get("@type", "").endswith(".ListenersConfigDump"):
            return c
    return {}
