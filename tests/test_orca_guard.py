"""Who may open ORCA load-report streams, and what they may take: a real mesh (control plane, a
caller Envoy, an inbound Envoy with Wasm authz) in front of a real runtime serving the model.

A client has no business calling OpenRcaService: its caller sidecar refuses it. At the runtime,
report streams run in a pool of their own beside the one that serves calls, bounded in all and
per verified peer, so no number of them takes a worker that Generate needs; the caller's Envoy
still gets its reports (least_loaded keeps working)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from xds.service.orca.v3.orca_pb2 import OrcaLoadReportRequest

from mesh_common.ports import free_port
from model_runtime.serving.client import Client
from model_runtime.serving.orca import MAX_STREAMS, MAX_STREAMS_PER_PEER
from model_runtime.serving.service import Runtime
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.runtime_fixtures import serving_runtime
from tests.test_identity_support import Sidecar, identity_sidecar, join_token_file, short_dir
from tests.test_lb_least_loaded import OrcaReplica
from tests.test_xds_support import eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.resources.clusters import ORCA_MAX_REQUESTS
from xds_server.resources.routes import ORCA_PATH

KEY = "test-acme-key-orca-91c3"
WORKERS = 4  # the runtime's call pool in these tests: a flood larger than it is cheap
OOB = "cluster.outbound|llm|v1.lb_orca_oob."


@dataclass
class Hop:
    runtime: Runtime
    caller: EnvoyProcess
    caller_port: int
    inbound_port: int


@contextlib.contextmanager
def mesh_with_runtime(loaded) -> Iterator[Hop]:
    """client -> caller Envoy (least_loaded) -> inbound Envoy (Wasm authz) -> the runtime."""
    rt = serving_runtime(loaded, max_workers=WORKERS)
    inbound = free_port()
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound}"]}},
                    "load_balancing": "least_loaded",
                    "route": {"weights": {"v1": 100}},
                    # calls' breaker: report streams must not hold its slots
                    "circuit_breakers": {"max_requests": 2 * WORKERS},
                }
            },
            "tenants": {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"]}},
        }
    )
    cp = build_server(mesh, debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    caller_port = free_port()
    try:
        boot = ads_bootstrap(
            "runtime-v1",
            xds_address=xds,
            service="llm",
            version="v1",
            inbound_port=inbound,
            local_endpoint=rt.target,
        )
        with (
            EnvoyProcess(boot),
            EnvoyProcess(
                ads_bootstrap("caller", xds_address=xds, outbound_port=caller_port)
            ) as caller,
        ):
            yield Hop(rt, caller, caller_port, inbound)
    finally:
        cp.stop()
        rt.shutdown(grace=5)


def open_streams(channel: grpc.Channel, n: int, metadata=()) -> tuple[list, list]:
    """`n` report streams on `channel`: (the open ones, each having sent a report; the status
    codes of those refused)."""
    call = channel.unary_stream(
        ORCA_PATH,
        request_serializer=OrcaLoadReportRequest.SerializeToString,
        response_deserializer=OrcaLoadReport.FromString,
    )
    opened, refused = [], []
    for _ in range(n):
        stream = call(OrcaLoadReportRequest(), timeout=120, metadata=metadata)
        try:
            next(stream)
            opened.append(stream)
        except grpc.RpcError as e:
            refused.append(e.code())
    return opened, refused


def generate(hop: Hop) -> list[int]:
    with Client(f"127.0.0.1:{hop.caller_port}", api_key=KEY, authority="llm") as c:
        return [t for ch in c.generate("Hello", max_new_tokens=4, timeout=60) for t in ch.token_ids]


def test_keyless_report_streams_take_no_worker_that_calls_need(smollm_int4) -> None:
    with mesh_with_runtime(smollm_int4) as hop:
        eventually(lambda: generate(hop), 60, "a keyed call through the mesh")
        eventually(lambda: hop.caller.stats()[OOB + "reports_received"] >= 1, 30, "reports")
        streams: list = []
        try:
            # Through the caller sidecar, with no key.
            with grpc.insecure_channel(
                f"127.0.0.1:{hop.caller_port}", options=[("grpc.default_authority", "llm")]
            ) as ch:
                via_caller, refused_by_caller = open_streams(ch, 2 * WORKERS)
                streams += via_caller
            # Straight to the inbound sidecar (a mesh without identity lets anyone reach it).
            ch = grpc.insecure_channel(f"127.0.0.1:{hop.inbound_port}")
            direct, refused_direct = open_streams(ch, MAX_STREAMS + WORKERS)
            streams += direct
            # Calls still find their workers, WORKERS of them at once.
            with Client(f"127.0.0.1:{hop.caller_port}", api_key=KEY, authority="llm") as c:
                calls = [c.generate("Hi", max_new_tokens=8, timeout=60) for _ in range(WORKERS)]
                assert all(len([t for ch in s for t in ch.token_ids]) == 8 for s in calls)
            # The caller sidecar refused every one, before any runtime...
            assert not via_caller
            assert set(refused_by_caller) == {grpc.StatusCode.PERMISSION_DENIED}
            # ...and a bounded number of the others got through (the caller's Envoy holds one
            # report stream too): the inbound sidecar's ORCA breaker (UNAVAILABLE) and the
            # runtime's bound (RESOURCE_EXHAUSTED) refuse the rest.
            assert len(direct) < MAX_STREAMS
            assert set(refused_direct) <= {
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            }
            # The caller's Envoy still gets its reports (least_loaded keeps working).
            seen = hop.caller.stats()[OOB + "reports_received"]
            eventually(
                lambda: hop.caller.stats()[OOB + "reports_received"] > seen + 1, 15, "reports"
            )
            assert hop.caller.stats()[OOB + "active_sessions"] == 1
        finally:
            for s in streams:
                s.cancel()


def test_report_streams_are_bounded_per_verified_peer(smollm_int4) -> None:
    """The runtime counts streams by the caller's SPIFFE ID, which its sidecar sets in
    x-forwarded-client-cert from the mTLS handshake (a client's copy is replaced)."""
    rt = serving_runtime(smollm_int4, max_workers=WORKERS)
    streams: list = []
    try:
        with grpc.insecure_channel(rt.target) as ch:
            one = [
                ("x-forwarded-client-cert", "By=spiffe://t/ns/a/sa/llm;URI=spiffe://t/ns/a/sa/x")
            ]
            opened, refused = open_streams(ch, MAX_STREAMS_PER_PEER + 2, one)
            streams += opened
            assert len(opened) == MAX_STREAMS_PER_PEER
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
            other = [("x-forwarded-client-cert", "URI=spiffe://t/ns/a/sa/y")]
            opened, refused = open_streams(ch, 1, other)
            streams += opened
            assert len(opened) == 1 and not refused
            with Client(rt.target) as c:
                assert c.info().name
    finally:
        for s in streams:
            s.cancel()
        rt.shutdown(grace=5)


def test_the_caller_sidecar_refuses_every_orca_path(smollm_int4) -> None:
    with mesh_with_runtime(smollm_int4) as hop:
        eventually(lambda: generate(hop), 60, "a keyed call through the mesh")
        with grpc.insecure_channel(
            f"127.0.0.1:{hop.caller_port}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            for path in (ORCA_PATH, "/xds.service.orca.v3.OpenRcaService/Other"):
                with pytest.raises(grpc.RpcError) as e:
                    next(ch.unary_stream(path)(b"", timeout=10, metadata=[("x-api-key", KEY)]))
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (path, e.value)


def test_with_callers_only_the_listed_workloads_sidecars_get_load_reports() -> None:
    """mTLS mesh, `callers: [apps/chat]` (Generate only): the chat sidecar's Envoy opens its
    report stream and gets reports; the mail sidecar, a workload of the same mesh that may not
    call the service, is refused on the ORCA route by the callers check."""
    d = short_dir()
    replica = OrcaReplica("llm", 0.5)
    inbound_port = free_port()
    doc = {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound_port}"]}},
                "load_balancing": "least_loaded",
                "callers": [{"service_account": "apps/chat", "methods": ["Generate"]}],
            }
        },
        "tenants": {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"]}},
        "identity": {"trust_domain": "meshlm.local"},
    }
    cp = build_server(parse_mesh(doc), debounce=0.02, identity_dir=str(d / "cp")).start()
    sidecars: list[Sidecar] = []
    try:
        runtime_side = dict(
            service="llm",
            version="v1",
            inbound_port=inbound_port,
            local_endpoint=f"127.0.0.1:{replica.port}",
        )
        token = join_token_file(cp, "default/llm", d)
        sidecars.append(identity_sidecar(cp, d, "llm-1", token, **runtime_side))
        for sa in ("apps/chat", "apps/mail"):
            token = join_token_file(cp, sa, d)
            sidecars.append(
                identity_sidecar(cp, d, sa.replace("/", "-"), token, outbound_port=free_port())
            )
        for s in sidecars:
            s.sv.start()
        for s in sidecars:
            s.sv.wait_ready()
        _, chat, mail = sidecars
        eventually(lambda: chat.stat(OOB + "reports_received") >= 2, 30, "chat's reports")
        eventually(lambda: mail.stat(OOB + "stream_failures") >= 1, 30, "mail's refusal")
        assert mail.stat(OOB + "reports_received") == 0
        assert replica.orca_streams == 1  # chat's alone reached the runtime
    finally:
        for s in sidecars:
            s.sv.stop()
        cp.stop()
        replica.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_the_inbound_orca_breaker_is_the_runtimes_bound() -> None:
    assert ORCA_MAX_REQUESTS == MAX_STREAMS
