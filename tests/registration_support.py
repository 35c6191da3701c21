"""Helpers for the workload registration tests: a registration stream driven by hand (raw JSON
messages, as any client could send them) and meshes that take registrations. No tests here."""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

import grpc

from xds_server.mesh import Mesh, parse_mesh
from xds_server.server import XdsServer

# The wire contract (mesh_common/registry_wire.py), spelled out as a client would.
REGISTER = "/meshlm.registry.v1.Registry/Register"
_END = object()


def reg_mesh(
    static: list[str] | None = None,
    identity: bool = False,
    service: dict[str, Any] | None = None,
    **registration: Any,
) -> Mesh:
    """llm/v1 with `static` endpoints (none by default) and no retries, so a call sent to a
    closed host fails visibly; `service`: llm's further fields; `registration`:
    control_plane.registration's fields (plaintext default: enabled)."""
    if not identity:
        registration.setdefault("enabled", True)
    doc: dict[str, Any] = {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": static or []}},
                "route": {"weights": {"v1": 100}},
                **(service or {}),
            }
        },
        "control_plane": {"registration": registration},
    }
    if identity:
        doc["identity"] = {"trust_domain": "meshlm.local"}
    return parse_mesh(doc)


def register_body(address: str, node: str = "n1", **extra: Any) -> dict[str, Any]:
    return {
        "register": {"node_id": node, "address": address, "service": "llm", "version": "v1"} | extra
    }


class RawStream:
    """One registration stream: `send(doc)`, `recv()` the next reply, `status()` how it ended."""

    def __init__(self, cp: XdsServer | None = None, channel: grpc.Channel | None = None) -> None:
        self.channel = channel or grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}")
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._done = threading.Event()
        self.call = self.channel.stream_stream(REGISTER)(self._messages())
        threading.Thread(target=self._read, daemon=True).start()

    def _messages(self):
        while (item := self._requests.get()) is not _END:
            yield item

    def _read(self) -> None:
        try:
            for raw in self.call:
                self._replies.put(json.loads(raw))
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details() or ""
        finally:
            self._done.set()

    def send(self, doc: Any) -> RawStream:
        self._requests.put(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        return self

    def recv(self, timeout: float = 20.0) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no reply in {timeout}s (stream: {self.code}, {self.details})"
            ) from None

    def status(self, timeout: float = 20.0) -> tuple[grpc.StatusCode | None, str]:
        assert self._done.wait(timeout), "the stream did not end"
        return self.code, self.details

    def end(self) -> None:
        """Half-close: the client is done sending (no deregistration)."""
        self._requests.put(_END)

    def drop(self) -> None:
        """The client vanishes: the stream is cancelled."""
        self.call.cancel()
        self.channel.close()


def registered(cp: XdsServer) -> dict[str, dict[str, Any]]:
    """address -> its row in /debug/syncz's registrations."""
    return {r["address"]: r for r in cp.syncz().get("registrations", [])}
