"""authz.wasm in real Envoy (V8) in front of real gRPC and HTTP upstreams; the native filters too.

Decisions are read by real clients: urllib for plain HTTP, a grpcio channel for gRPC (status
codes as grpc.StatusCode). Upstreams echo what they received, so the headers the filter set or
stripped are visible.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
from google.protobuf import wrappers_pb2

from sidecar.envoy_process import EnvoyError, EnvoyProcess
from tests import testbed
from wasm_filters import xds
from wasm_filters.policy import Policy, hash_key, parse_policy

GEN = "/meshlm.inference.v1.Inference/Generate"
TOK = "/meshlm.inference.v1.Inference/Tokenize"
ONE_HOUR = {"tokens_per_fill": 1, "fill_interval": "1h"}  # no refill during a test
TENANTS = {
    "acme": {"key_sha256": hash_key("k-acme"), "allow": ["llm/*"], "priority": "high"},
    "free": {"key_sha256": hash_key("k-free"), "allow": ["llm/Generate"], "priority": "low"},
    "limh": {
        "key_sha256": hash_key("k-limh"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 2, **ONE_HOUR},
    },
    "limg": {
        "key_sha256": hash_key("k-limg"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 2, **ONE_HOUR},
    },
}
KEYS = {name: [f"k-{name}"] for name in TENANTS}
POLICY = parse_policy(TENANTS)


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[int, int]]:
    with testbed.EchoGrpcUpstream() as g, testbed.EchoHttpUpstream() as h:
        yield g.port, h.port


def start(upstreams: tuple[int, int], filters: list, **kw: object) -> tuple[EnvoyProcess, int]:
    boot = testbed.bootstrap(
        filters,
        grpc_port=upstreams[0],
        http_port=upstreams[1],
        exact_balance=bool(kw.pop("exact_balance", False)),
    )
    envoy = EnvoyProcess(boot, **kw)  # type: ignore[arg-type]
    envoy.start()
    try:
        envoy.wait_ready(timeout=60)
    except BaseException:
        envoy.stop()
        raise
    return envoy, testbed.listener_port(boot)


@pytest.fixture(scope="module")
def wasm_envoy(upstreams: tuple[int, int]) -> Iterator[tuple[EnvoyProcess, int]]:
    envoy, port = start(upstreams, [xds.wasm_http_filter(POLICY, service="llm")])
    try:
        yield envoy, port
    finally:
        envoy.stop()


@pytest.fixture(scope="module")
def native_envoy(upstreams: tuple[int, int]) -> Iterator[tuple[EnvoyProcess, int]]:
    envoy, port = start(upstreams, xds.native_http_filters(POLICY, service="llm", keys=KEYS))
    try:
        yield envoy, port
    finally:
        envoy.stop()


def http_call(port: int, headers: dict[str, str], path: str = GEN) -> tuple[int, dict, dict]:
    """(status, response headers, echoed request headers or {})."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=b"{}",
        headers={"content-type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, {}


def grpc_call(
    port: int, md: list[tuple[str, str]], path: str = GEN
) -> tuple[grpc.StatusCode, dict]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = ch.unary_unary(path)(b"prompt", metadata=md, timeout=10)
            return grpc.StatusCode.OK, json.loads(reply)
        except grpc.RpcError as e:
            return e.code(), {"details": e.details()}


def check_http_decisions(port: int) -> None:
    status, _, echoed = http_call(port, {"x-api-key": "k-acme"})
    assert status == 200 and echoed["x-meshlm-tenant"] == "acme"
    assert "x-api-key" not in echoed
    assert http_call(port, {})[0] == 401
    assert http_call(port, {"x-api-key": "k-wrong"})[0] == 401
    assert http_call(port, {"x-api-key": "k-free"}, TOK)[0] == 403
    assert [http_call(port, {"x-api-key": "k-limh"})[0] for _ in range(2)] == [200, 200]
    status, headers, _ = http_call(port, {"x-api-key": "k-limh"})
    assert status == 429 and int(headers["retry-after"]) >= 1


def check_grpc_decisions(port: int) -> None:
    code, echoed = grpc_call(port, [("x-api-key", "k-free")])
    assert code == grpc.StatusCode.OK and echoed["x-meshlm-tenant"] == "free"
    assert grpc_call(port, [])[0] == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(port, [("x-api-key", "k-wrong")])[0] == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(port, [("x-api-key", "k-free")], TOK)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert grpc_call(port, [("authorization", "Bearer k-limg")])[0] == grpc.StatusCode.OK
    assert grpc_call(port, [("x-api-key", "k-limg")])[0] == grpc.StatusCode.OK
    assert grpc_call(port, [("x-api-key", "k-limg")])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_wasm_http_decisions(wasm_envoy: tuple[EnvoyProcess, int]) -> None:
    check_http_decisions(wasm_envoy[1])


def test_wasm_grpc_decisions(wasm_envoy: tuple[EnvoyProcess, int]) -> None:
    port = wasm_envoy[1]
    check_grpc_decisions(port)
    _, reply = grpc_call(port, [])
    assert reply["details"] == "missing api key"
    _, echoed = grpc_call(port, [("x-api-key", "k-acme")])
    assert echoed["x-meshlm-priority"] == "high" and echoed[":path"] == GEN


def test_wasm_spoofed_identity_headers_are_replaced(wasm_envoy: tuple[EnvoyProcess, int]) -> None:
    port = wasm_envoy[1]
    spoof = {"x-meshlm-tenant": "acme", "x-meshlm-priority": "high"}
    _, _, echoed = http_call(port, {"authorization": "Bearer k-free", **spoof})
    assert (echoed["x-meshlm-tenant"], echoed["x-meshlm-priority"]) == ("free", "low")
    assert "authorization" not in echoed
    code, echoed = grpc_call(port, [("x-api-key", "k-free"), *spoof.items()])
    assert code == grpc.StatusCode.OK and echoed["x-meshlm-tenant"] == "free"
    # A spoofed identity without a key is still just a missing key.
    assert http_call(port, spoof)[0] == 401


def test_wasm_metrics_in_envoy_stats(wasm_envoy: tuple[EnvoyProcess, int]) -> None:
    envoy, port = wasm_envoy
    before = envoy.stats("wasmcustom")
    http_call(port, {"x-api-key": "k-wrong"})
    http_call(port, {"x-api-key": "k-free"}, TOK)
    http_call(port, {"x-api-key": "k-acme"})
    after = envoy.stats("wasmcustom")

    def delta(name: str) -> int:
        key = f"wasmcustom.meshlm_authz.{name}"
        return after[key] - before.get(key, 0)

    assert delta("denied.unknown_key") == 1
    assert delta("denied.forbidden.free") == 1
    assert delta("allowed.acme") == 1


def test_native_filters_give_the_same_decisions(native_envoy: tuple[EnvoyProcess, int]) -> None:
    port = native_envoy[1]
    check_http_decisions(port)
    check_grpc_decisions(port)
    _, _, echoed = http_call(port, {"x-api-key": "k-free", "x-meshlm-tenant": "acme"})
    assert echoed["x-meshlm-tenant"] == "free" and "x-api-key" not in echoed


OUTSIDE_THE_API = ("/grpc.health.v1.Health/Check", "/other.Service/Generate")


def check_service_wildcard_scope(port: int) -> None:
    """`llm/*` allows exactly llm's gRPC API, not its health checks or another gRPC service
    behind the same sidecar (issue 9, defect 12)."""
    for path in OUTSIDE_THE_API:
        code, _ = grpc_call(port, [("x-api-key", "k-acme")], path)
        assert code == grpc.StatusCode.PERMISSION_DENIED, path
        assert http_call(port, {"x-api-key": "k-acme"}, path)[0] == 403, path
    code, echoed = grpc_call(port, [("x-api-key", "k-acme")], GEN)
    assert code == grpc.StatusCode.OK and echoed[":path"] == GEN


def test_wasm_service_wildcard_is_scoped_to_the_inference_api(
    wasm_envoy: tuple[EnvoyProcess, int],
) -> None:
    check_service_wildcard_scope(wasm_envoy[1])


def test_native_service_wildcard_is_scoped_to_the_inference_api(
    native_envoy: tuple[EnvoyProcess, int],
) -> None:
    check_service_wildcard_scope(native_envoy[1])


def test_two_workers_never_exceed_a_tenant_bucket(upstreams: tuple[int, int]) -> None:
    burst = {
        "k": {
            "key_sha256": hash_key("k-burst"),
            "allow": ["llm/*"],
            "rate_limit": {"max_tokens": 20, **ONE_HOUR},
        }
    }
    f = xds.wasm_http_filter(parse_policy(burst), service="llm")
    envoy, port = start(upstreams, [f], concurrency=2, exact_balance=True)
    statuses: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        for _ in range(12):
            conn.request("GET", GEN, headers={"x-api-key": "k-burst"})
            r = conn.getresponse()
            r.read()
            with lock:
                statuses.append(r.status)
            if r.getheader("connection") == "close":
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.close()

    try:
        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        per_worker = envoy.stats(r"listener\.127\.0\.0\.1_\d+\.worker_\d\.downstream_cx_total")
    finally:
        envoy.stop()
    assert len(statuses) == 96 and set(statuses) <= {200, 429}
    # The bucket is shared by both workers' VMs: 20 tokens, no refill within the hour.
    assert 20 <= statuses.count(200) <= 21
    assert len([v for v in per_worker.values() if v > 0]) == 2, per_worker


def bad_config_extension(policy: Policy, raw: str) -> object:
    ext = xds.wasm_extension_config(policy, service="llm", wasm_file=str(xds.WASM_PATH))
    w = wasm_pb2.Wasm()
    ext.typed_config.Unpack(w)
    w.config.configuration.Pack(wrappers_pb2.StringValue(value=raw))
    ext.typed_config.Pack(w)
    return ext


def test_static_bad_config_is_refused_by_envoy(upstreams: tuple[int, int]) -> None:
    ext = bad_config_extension(POLICY, '{"version": 1, "tenants": "all"}')
    f = {"name": "meshlm.authz", "typed_config": testbed.filter_dict(ext)["typed_config"]}
    with pytest.raises(EnvoyError, match=r"Unable to create Wasm HTTP filter|failed to load"):
        start(upstreams, [f])


def test_ecds_policy_update_under_traffic(upstreams: tuple[int, int], tmp_path: Path) -> None:
    """Rotation pushed while traffic flows: no allowed request fails; a bad policy is rejected
    (Envoy keeps the last good one); removing the old key then takes effect."""
    path = str(tmp_path / "authz.json")
    acme = {"allow": ["llm/*"], "priority": "high"}
    v1 = parse_policy({"acme": {"key_sha256": hash_key("k-old"), **acme}})
    both = [hash_key("k-new"), hash_key("k-old")]
    v2 = parse_policy({"acme": {"key_sha256": both, **acme}})
    v4 = parse_policy({"acme": {"key_sha256": hash_key("k-new"), **acme}})

    def push(ext: object, version: str) -> None:
        testbed.write_ecds_file(path, ext, version)

    def ext(p: Policy) -> object:
        return xds.wasm_extension_config(p, service="llm", wasm_file=str(xds.WASM_PATH))

    push(ext(v1), "1")
    envoy, port = start(upstreams, [testbed.file_ecds_http_filter(path)])
    results: list[tuple[float, int]] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            results.append((time.monotonic(), http_call(port, {"x-api-key": "k-old"})[0]))

    def wait_for(key: str, status: int) -> None:
        deadline = time.monotonic() + 30
        while http_call(port, {"x-api-key": key})[0] != status:
            assert time.monotonic() < deadline, f"{key} never got {status}"
            time.sleep(0.05)

    prefix = "extension_config_discovery.http_filter.meshlm.authz."
    t = threading.Thread(target=traffic)
    t.start()
    try:
        assert http_call(port, {"x-api-key": "k-new"})[0] == 401
        push(ext(v2), "2")
        wait_for("k-new", 200)
        push(bad_config_extension(v4, "{not json"), "3")
        deadline = time.monotonic() + 30
        while envoy.stats(prefix + "update_rejected").get(prefix + "update_rejected", 0) < 1:
            assert time.monotonic() < deadline, "bad policy was not rejected"
            time.sleep(0.05)
        assert http_call(port, {"x-api-key": "k-new"})[0] == 200  # last good policy kept
        assert envoy.stats(prefix + "version_text")[prefix + "version_text"] == "2"
        time.sleep(0.3)
        removal = time.monotonic()
        push(ext(v4), "4")
        wait_for("k-old", 401)
    finally:
        stop.set()
        t.join()
        envoy.stop()
    before_removal = [s for ts, s in results if ts < removal]
    assert len(before_removal) >= 5 and set(before_removal) == {200}
    assert {s for _, s in results} <= {200, 401}


def test_a_revoked_key_is_denied_as_soon_as_the_new_policy_serves(
    upstreams: tuple[int, int], tmp_path: Path
) -> None:
    """The filter remembers keys it matched, per policy: a push that revokes a key leaves
    nothing of it behind. Once a request shows the new policy serving (its new key is allowed),
    the revoked key, allowed a moment before, is denied on the very next request."""
    path = str(tmp_path / "authz.json")
    acme = {"allow": ["llm/*"], "priority": "high"}
    old = parse_policy({"acme": {"key_sha256": hash_key("k-old"), **acme}})
    new = parse_policy({"acme": {"key_sha256": hash_key("k-new"), **acme}})

    def push(p: Policy, version: str) -> None:
        ext = xds.wasm_extension_config(p, service="llm", wasm_file=str(xds.WASM_PATH))
        testbed.write_ecds_file(path, ext, version)

    push(old, "1")
    envoy, port = start(upstreams, [testbed.file_ecds_http_filter(path)])  # one worker
    try:
        assert [http_call(port, {"x-api-key": "k-old"})[0] for _ in range(3)] == [200] * 3
        push(new, "2")
        deadline = time.monotonic() + 30
        while http_call(port, {"x-api-key": "k-new"})[0] != 200:
            assert time.monotonic() < deadline, "the new policy never served"
            time.sleep(0.05)
        assert [http_call(port, {"x-api-key": "k-old"})[0] for _ in range(3)] == [401] * 3
    finally:
        envoy.stop()
