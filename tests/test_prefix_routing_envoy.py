"""`load_balancing: prefix_aware` on a real caller Envoy configured by the in-process control
plane: the class filter (classify.wasm in V8) sets the prompt-prefix key from the Generate body,
the route hashes it with Maglev and bounded load. Three real gRPC upstreams stand for the
replicas; each answers with its name and the request metadata it got, and holds a call marked
`x-hold` until the test lets it go (so a replica can be made busy)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from mesh_common.headers import PREFIX_HEADER
from schemas.codec import ChatMessage, GenerateRequest, encode_generate_request
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import eventually, sidecar
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

GEN = "/meshlm.inference.v1.Inference/Generate"
SESSION = "x-session"
SECRET = "hunter2-the-admin-password"
# Over 1 KiB: the prefix key's window (16 blocks of 64 bytes) holds the system prompt alone.
SYSTEM = "You are the support assistant of shop number {g}. Answer briefly and politely. " * 14


class _Replica(grpc.GenericRpcHandler):
    def __init__(self, name: str) -> None:
        self.name = name
        self.release = threading.Event()
        self.held = 0
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            md = {k: str(v) for k, v in context.invocation_metadata()}
            if "x-hold" in md:
                with self.lock:
                    self.held += 1
                self.release.wait(30)
            return json.dumps({"name": self.name, "md": md}).encode()

        return grpc.unary_unary_rpc_method_handler(answer)


class Replicas:
    def __init__(self, names: list[str]) -> None:
        self.handlers = {n: _Replica(n) for n in names}
        self.servers: dict[str, grpc.Server] = {}
        self.addresses: dict[str, str] = {}
        for n, h in self.handlers.items():
            s = grpc.server(futures.ThreadPoolExecutor(max_workers=24))
            s.add_generic_rpc_handlers((h,))
            self.addresses[n] = f"127.0.0.1:{s.add_insecure_port('127.0.0.1:0')}"
            s.start()
            self.servers[n] = s

    def stop(self) -> None:
        for h in self.handlers.values():
            h.release.set()
        for s in self.servers.values():
            s.stop(0)


def _mesh(addresses: list[str], **service: Any) -> Any:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": addresses}},
                    "route": {"weights": {"v1": 100}},
                    "load_balancing": "prefix_aware",
                    **service,
                }
            }
        }
    )


@dataclass
class Rig:
    cp: XdsServer
    replicas: Replicas
    envoy: EnvoyProcess
    port: int


@contextlib.contextmanager
def _mesh_and_caller(**service: Any) -> Iterator[Rig]:
    reps = Replicas(["r0", "r1", "r2"])
    try:
        cp = build_server(_mesh(list(reps.addresses.values()), **service), debounce=0.02).start()
        try:
            envoy, port = sidecar(cp, "caller")
            with envoy:
                eventually(lambda: _call(port, _prompt(0)), timeout=30, what="the caller routes")
                yield Rig(cp, reps, envoy, port)
        finally:
            cp.stop()
    finally:
        reps.stop()


def _prompt(group: int, tail: str = "") -> bytes:
    msgs = [ChatMessage("system", SYSTEM.format(g=group)), ChatMessage("user", f"Hi. {tail}")]
    return encode_generate_request(GenerateRequest(messages=msgs))


def _call(port: int, body: bytes, md: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    with grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.default_authority", "llm")]
    ) as ch:
        return json.loads(ch.unary_unary(GEN)(body, metadata=md, timeout=10))


def _homes(port: int, groups: range) -> dict[int, str]:
    return {g: _call(port, _prompt(g))["name"] for g in groups}


def test_same_prefix_same_replica_different_prefixes_spread() -> None:
    with _mesh_and_caller() as rig:
        port = rig.port
        homes = _homes(port, range(30))
        # Each prefix keeps its replica whatever the rest of the prompt says.
        for g in range(0, 30, 3):
            for tail in ("one", "two", "a longer question about my order " * 5):
                got = _call(port, _prompt(g, tail))
                assert got["name"] == homes[g], (g, tail)
                assert len(got["md"][PREFIX_HEADER]) == 16
        # 30 prefixes over 3 replicas: every replica holds some (all on two: p < 1e-4).
        assert set(homes.values()) == {"r0", "r1", "r2"}, Counter(homes.values())


def test_a_hot_prefix_spills_past_its_replica_once_it_is_over_the_bounded_load() -> None:
    with _mesh_and_caller(hash_balance_factor=125) as rig:
        port, reps = rig.port, rig.replicas
        home = _call(port, _prompt(7))["name"]
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.default_authority", "llm")])
        try:
            held = [
                ch.unary_unary(GEN).future(_prompt(7, str(i)), metadata=(("x-hold", "1"),))
                for i in range(9)
            ]
            eventually(
                lambda: sum(h.held for h in reps.handlers.values()) == 9,
                timeout=20,
                what="nine calls held",
            )
            load = {n: h.held for n, h in reps.handlers.items()}
            # Envoy passes over a host whose active calls exceed ceil(ceil((active in the
            # cluster + 1) * 125 %) / 3): the key's replica takes at most 5 of the 9 (4 active
            # when the 9th is picked), the rest go to replicas Envoy's probe from the key's
            # entry finds (a seeded random jump: not always the next one, nor all).
            assert 1 <= load[home] <= 5, load
            assert sum(1 for v in load.values() if v) >= 2, load
            for h in reps.handlers.values():
                h.release.set()
            answers = [json.loads(f.result(timeout=30))["name"] for f in held]
            assert Counter(answers) == Counter({n: v for n, v in load.items() if v})
            # Idle again: the prefix is back on its own replica.
            assert _call(port, _prompt(7, "after"))["name"] == home
        finally:
            ch.close()


def test_a_removed_replica_remaps_its_own_keys_only() -> None:
    with _mesh_and_caller() as rig:
        cp, reps, port = rig.cp, rig.replicas, rig.port
        before = _homes(port, range(60))
        gone = "r1"
        left = [a for n, a in reps.addresses.items() if n != gone]
        assert cp.update_mesh(_mesh(left), timeout=20).ok
        eventually(
            lambda: all(_call(port, _prompt(g))["name"] != gone for g in range(60)),
            timeout=20,
            what="no call reaches the removed replica",
        )
        after = _homes(port, range(60))
        moved_own = [g for g in before if before[g] == gone]
        assert moved_own and all(after[g] != gone for g in moved_own)
        kept = [g for g in before if before[g] != gone]
        stayed = sum(after[g] == before[g] for g in kept)
        # Maglev: the survivors keep their keys (a ring hash moved about one in ten of them,
        # as each survivor's share of the ring grows by new points). Maglev promises minimal,
        # not zero, disruption: one of theirs may move.
        assert stayed >= len(kept) - 1, (stayed, len(kept))


def test_a_session_hash_comes_first_and_unkeyed_calls_still_route() -> None:
    with _mesh_and_caller(
        route={"weights": {"v1": 100}, "hash_policy": {"header": SESSION}}
    ) as rig:
        port = rig.port
        # One session, many prefixes: one replica. (Without the session: several.)
        with_session = {_call(port, _prompt(g), ((SESSION, "alice"),))["name"] for g in range(15)}
        assert len(with_session) == 1
        assert len(set(_homes(port, range(15)).values())) >= 2
        # Bodies with no key: garbage, a short prompt, no body at all; all answered.
        for body in (b"\xff" * 40, encode_generate_request(GenerateRequest(prompt="hi")), b""):
            got = _call(port, body)
            assert PREFIX_HEADER not in got["md"] and got["name"].startswith("r")


def test_a_client_sent_key_is_replaced_and_no_prompt_text_leaves() -> None:
    with _mesh_and_caller() as rig:
        port = rig.port
        own = _call(port, _prompt(3))["md"][PREFIX_HEADER]
        spoofed = _call(port, _prompt(3), ((PREFIX_HEADER, "0123456789abcdef"),))
        assert spoofed["md"][PREFIX_HEADER] == own
        unkeyed = _call(port, b"\xff" * 40, ((PREFIX_HEADER, "0123456789abcdef"),))
        assert PREFIX_HEADER not in unkeyed["md"]
        secret = encode_generate_request(
            GenerateRequest(messages=[ChatMessage("system", (SECRET + " ") * 20)])
        )
        got = _call(port, secret)
        assert not any(SECRET in k or SECRET in v for k, v in got["md"].items())
        rig.envoy.admin_post("/logging?level=trace")  # even Envoy's most verbose log
        try:
            _call(port, secret)
        finally:
            rig.envoy.admin_post("/logging?level=info")
        # The caller's access log (stdout, the mesh default) is in this log too.
        assert "hunter2" not in rig.envoy.log_path.read_text(errors="replace")
        assert "hunter2" not in rig.envoy.admin_get("/config_dump")
