"""Token budgets through the mesh, with the real `openai` SDK and grpcio: client -> caller sidecar
-> inbound sidecar (Wasm authz: verifies the key, sets the tenant's `x-meshlm-token-budget`) -> a
real runtime, which reserves prompt + max_tokens per call and refunds the unused part. Budgets are
per day, so refills during a test are a few tokens at most. A runtime process killed mid-stream
keeps its reservations charged: the last test."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest

from mesh_common.headers import TENANT_HEADER, TOKEN_BUDGET_HEADER
from mesh_common.ports import free_port
from meshlm.commands.status import render_budgets
from meshlm.demo.launcher import _serving
from meshlm.demo.procs import Proc, wait_until
from model_runtime.serving.budgets import Budgets
from model_runtime.serving.client import Client
from model_runtime.serving.openai_http import OpenAIServer
from model_runtime.serving.telemetry import MetricsServer
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.runtime_fixtures import serving_runtime
from tests.test_xds_support import eventually
from wasm_filters.policy import hash_key
from xds_server.admin import budgets as budgets_api
from xds_server.compose import build_server
from xds_server.mesh import MeshError, parse_mesh
from xds_server.server import XdsServer

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
COUNT = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
MAX_TOKENS = 12
LONG = 1000  # a COUNT stream's max_tokens: seconds of decoding, cancelled long before
TENANTS = ("free", "edge", "cancel", "grpc")


@dataclass
class Mesh:
    cp: XdsServer
    outbound_port: int
    model: str
    reservation: int  # prompt + MAX_TOKENS of a QUESTION call
    count_prompt: int  # prompt tokens of a COUNT call
    levels: Callable[[], dict[str, dict[str, float]]]  # the runtime's buckets
    exposition: Callable[[], bytes] = bytes  # the runtime's /metrics

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.outbound_port}/v1",
            api_key=f"{tenant}-key",
            max_retries=0,
            timeout=120,
            default_headers={"Host": "llm"},
        )

    def ask(self, tenant: str, max_tokens: int = MAX_TOKENS) -> int:
        """One chat completion: its prompt + completion tokens."""
        with self.client(tenant) as c:
            r = c.chat.completions.create(
                model=self.model, messages=QUESTION, temperature=0, max_tokens=max_tokens
            )
        return r.usage.total_tokens


def _doc(ports: tuple[int, ...], budgets: dict[str, dict], metrics_url: str = "") -> dict:
    tenants = {}
    for t in TENANTS:
        tenants[t] = {"key_sha256": hash_key(f"{t}-key"), "allow": ["llm/*"]}
        if t in budgets:
            tenants[t]["token_budget"] = budgets[t]
    v1: dict = {"endpoints": [f"127.0.0.1:{p}" for p in ports]}
    if metrics_url:
        v1["metrics_urls"] = [metrics_url]
    llm = {"versions": {"v1": v1}}
    return {"services": {"llm": llm}, "tenants": tenants}


@pytest.fixture(scope="module")
def mesh(smollm_int4) -> Iterator[Mesh]:
    rt = serving_runtime(smollm_int4, max_batch=8, max_queue=32)
    http = OpenAIServer(rt)
    metrics = MetricsServer(rt.telemetry)
    url = f"http://127.0.0.1:{metrics.port}/metrics.json"
    inbound = free_port()
    cp = build_server(parse_mesh(_doc((inbound,), {}, url)), debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    outbound = free_port()
    envoys = []
    try:
        boot = ads_bootstrap(
            "runtime-v1",
            xds_address=xds,
            service="llm",
            version="v1",
            inbound_port=inbound,
            local_endpoint=rt.target,
            local_http_endpoint=f"127.0.0.1:{http.port}",
        )
        envoys.append(EnvoyProcess(boot).start())
        caller = ads_bootstrap("caller", xds_address=xds, outbound_port=outbound)
        envoys.append(EnvoyProcess(caller).start())
        model = rt.service.served_names[0]
        m = Mesh(cp, outbound, model, 0, 0, rt.service.budgets.levels, rt.telemetry.prom.exposition)
        eventually(lambda: m.ask("free"), what="the mesh serves chat completions")
        with m.client("free") as c:
            r = c.chat.completions.create(model=model, messages=COUNT, max_tokens=1)
            m.count_prompt = r.usage.prompt_tokens
            r = c.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
            m.reservation = r.usage.prompt_tokens + MAX_TOKENS
        # The budgets, sized from what a call reserves here; in force once ACKed.
        budgets = {
            "edge": {"tokens_per_day": 5 * m.reservation + m.reservation // 2},
            "cancel": {"tokens_per_day": 2 * (m.count_prompt + LONG) - 1},
            "grpc": {"tokens_per_day": m.reservation},
        }
        assert cp.update_mesh(parse_mesh(_doc((inbound,), budgets, url)), timeout=20).ok
        yield m
    finally:
        for e in envoys:
            e.stop()
        cp.stop()
        metrics.stop()
        http.stop()
        rt.shutdown(grace=0)


def _at_the_edge(mesh: Mesh, tenant: str, n: int) -> tuple[list[int], list]:
    """`n` chat completions at once: (tokens each served call used, the 429s)."""
    used: list[int] = []
    refused: list[openai.RateLimitError] = []
    start = threading.Barrier(n)

    def call() -> None:
        start.wait()
        try:
            used.append(mesh.ask(tenant))
        except openai.RateLimitError as e:
            refused.append(e)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(used) + len(refused) == n
    return used, refused


def test_concurrent_calls_at_the_edge_never_use_more_than_the_budget(mesh: Mesh) -> None:
    budget = 5 * mesh.reservation + mesh.reservation // 2
    used, refused = _at_the_edge(mesh, "edge", 16)
    assert len(used) >= 5 and refused
    # Reserved at admission: what the served calls used never passes the budget (a day's
    # budget refills about one token in the test's time).
    assert sum(used) <= budget + 1, (used, budget)
    e = refused[0]
    assert e.status_code == 429 and e.code == "rate_limit_exceeded"
    assert "token budget exceeded: tenant 'edge'" in e.message
    assert int(e.response.headers["retry-after"]) >= 1


def test_the_runtime_reports_each_tenants_budget_left(mesh: Mesh) -> None:
    """After the edge test above: what is left of the edge tenant's budget, on /metrics."""
    budget = 5 * mesh.reservation + mesh.reservation // 2
    text = mesh.exposition().decode()
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("meshlm_tenant_token_budget_remaining{")
        and 'tenant="edge"' in ln
        and 'budget="tokens_per_day"' in ln
    )
    left = float(line.rsplit(" ", 1)[1])
    assert left == pytest.approx(mesh.levels()["edge"]["tokens_per_day"], abs=1)
    # The control plane reads it from the runtime's /metrics.json for GET /budgets.
    code, doc = budgets_api.handle(mesh.cp)("GET", "/budgets", b"")
    assert code == 200 and doc["mode"] == "local"
    assert doc["runtimes"] == {"llm": {"read": 1, "unreachable": []}}
    assert doc["tenants"]["edge"]["left"]["llm"]["tokens_per_day"] == pytest.approx(left, abs=1)
    assert doc["tenants"]["grpc"]["budget"] == {"tokens_per_day": mesh.reservation}
    assert "free" not in doc["tenants"]
    assert 0 <= left < budget - mesh.reservation  # the edge calls spent at least one


def test_a_cancelled_stream_refunds_what_it_did_not_use(mesh: Mesh) -> None:
    first = mesh.count_prompt + LONG  # what one COUNT call reserves
    with mesh.client("cancel") as c:
        stream = c.chat.completions.create(
            model=mesh.model, messages=COUNT, temperature=0, max_tokens=LONG, stream=True
        )
        got = 0
        for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got >= 3:
                break
        # The stream's reservation leaves one token too few for a second one.
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=mesh.model, messages=COUNT, max_tokens=LONG)
        assert "tenant 'cancel'" in e.value.message
        stream.close()  # the client goes away mid-stream: the runtime sees the cancel

    def refunded() -> bool:
        left = mesh.levels()["cancel"]["tokens_per_day"]
        # The prompt and the tokens streamed until the cancel reached the runtime are
        # charged; the rest of the stream's reservation is back.
        return left >= 2 * first - 1 - (mesh.count_prompt + LONG // 4)

    eventually(refunded, what="the cancelled stream's unused tokens refunded")
    with mesh.client("cancel") as c:
        stream = c.chat.completions.create(
            model=mesh.model, messages=COUNT, max_tokens=LONG, stream=True
        )
        assert next(iter(stream))  # admitted now
        stream.close()


def test_grpc_callers_get_resource_exhausted_naming_the_budget(mesh: Mesh) -> None:
    target = f"127.0.0.1:{mesh.outbound_port}"
    with Client(target, api_key="grpc-key", authority="llm") as c:
        list(c.generate(messages=QUESTION, max_new_tokens=MAX_TOKENS, timeout=60))
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate(messages=QUESTION, max_new_tokens=MAX_TOKENS, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "token budget exceeded: tenant 'grpc'" in e.value.details()
    trailers = dict(e.value.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1


@pytest.fixture(scope="module")
def global_mesh(smollm_int4) -> Iterator[tuple[Mesh, list]]:
    """`rate_limits.mode: global`: two inbound sidecars, each in front of its own runtime, which
    reserves at the control plane through its sidecar's loopback budget listener."""
    inbound = (free_port(), free_port())
    budget_ports = (free_port(), free_port())
    runtimes = [
        serving_runtime(smollm_int4, budgets=Budgets(service=f"127.0.0.1:{p}"))
        for p in budget_ports
    ]
    https = [OpenAIServer(rt) for rt in runtimes]
    doc = {**_doc(inbound, {}), "rate_limits": {"mode": "global"}}
    cp = build_server(parse_mesh(doc), debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    outbound = free_port()
    envoys = []
    try:
        for i, (rt, http) in enumerate(zip(runtimes, https, strict=True)):
            boot = ads_bootstrap(
                f"runtime-{i}",
                xds_address=xds,
                service="llm",
                version="v1",
                inbound_port=inbound[i],
                local_endpoint=rt.target,
                local_http_endpoint=f"127.0.0.1:{http.port}",
                budget_port=budget_ports[i],
            )
            envoys.append(EnvoyProcess(boot).start())
        caller = ads_bootstrap("caller", xds_address=xds, outbound_port=outbound)
        envoys.append(EnvoyProcess(caller).start())
        model = runtimes[0].service.served_names[0]
        m = Mesh(cp, outbound, model, 0, 0, runtimes[0].service.budgets.levels)
        eventually(lambda: m.ask("free"), what="the mesh serves chat completions")
        with m.client("free") as c:
            r = c.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
        m.reservation = r.usage.prompt_tokens + MAX_TOKENS
        budgets = {"edge": {"tokens_per_day": 5 * m.reservation + m.reservation // 2}}
        doc = {**_doc(inbound, budgets), "rate_limits": {"mode": "global"}}
        assert cp.update_mesh(parse_mesh(doc), timeout=20).ok
        yield m, runtimes
    finally:
        for e in envoys:
            e.stop()
        cp.stop()
        for http in https:
            http.stop()
        for rt in runtimes:
            rt.shutdown(grace=0)


def test_global_budgets_hold_across_replicas(global_mesh) -> None:
    """Each runtime's own tier holds the whole budget (the header's), so two replicas that
    fell back to it would admit about twice the budget: what the served calls used stays within
    one budget only because both reserve at the control plane."""
    mesh, runtimes = global_mesh
    budget = 5 * mesh.reservation + mesh.reservation // 2
    used, refused = _at_the_edge(mesh, "edge", 16)
    assert len(used) >= 5 and refused
    assert sum(used) <= budget + 1, (used, budget)
    assert "in the mesh" in refused[0].message
    for rt in runtimes:  # neither reserved from its own buckets (the fallback tier)
        assert rt.service.budgets.levels() == {}

    # What the admin API (GET /budgets) and `meshlm status` show of it.
    def settled() -> dict | None:  # runtimes settle in the background
        code, doc = budgets_api.handle(mesh.cp)("GET", "/budgets", b"")
        assert code == 200 and doc["mode"] == "global"
        left = doc["tenants"]["edge"]["left"]["llm"]["tokens_per_day"]
        return doc if abs(budget - left - sum(used)) <= 2 else None

    doc = eventually(settled, what="every call settled at the control plane")
    left = doc["tenants"]["edge"]["left"]["llm"]["tokens_per_day"]
    assert "free" not in doc["tenants"]  # no budget, not listed
    table = render_budgets(doc)
    assert f"edge  {budget} per_day  llm  {left}" in table


def test_tenants_without_a_budget_are_not_metered(mesh: Mesh) -> None:
    for _ in range(3):
        assert mesh.ask("free") > 0


def test_a_budget_needs_the_wasm_filter_that_hands_it_on() -> None:
    doc = _doc((1,), {"edge": {"tokens_per_day": 10}})
    doc["authz"] = {"mode": "native", "keys_file": "keys.json"}
    with pytest.raises(MeshError, match=r"tenants\.edge\.token_budget: needs authz\.mode wasm"):
        parse_mesh(doc)


def test_a_runtime_killed_mid_stream_keeps_the_reservation_charged(tmp_path) -> None:
    """The runtime process alone: this test sends the two headers the inbound sidecar's filter
    sets (the mesh path is above), kills the runtime with SIGKILL mid-stream, and starts its
    successor on the same state file."""
    state = tmp_path / "budgets.json"
    port = free_port()
    args = ["serve", "--port", str(port), "--token-budget-state", str(state)]
    md = [(TENANT_HEADER, "acme"), (TOKEN_BUDGET_HEADER, "tokens_per_day=2000")]

    def start(name: str) -> Proc:
        proc = Proc.meshlm(name, args, tmp_path, env={"OMP_NUM_THREADS": "1"}).start()
        wait_until(lambda: _serving(port), 180, "runtime SERVING", proc)
        return proc

    proc = start("first")
    try:
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate(messages=COUNT, max_new_tokens=1000, timeout=120, metadata=md)
            assert next(stream).token_ids
            proc.stop(sig=signal.SIGKILL, timeout=10)
    finally:
        proc.stop()
    charged = 2000 - _level(state)
    assert charged >= 1000  # prompt + max_tokens, not the few tokens streamed
    proc = start("successor")
    try:
        with Client(f"127.0.0.1:{port}") as c:
            # What the dead runtime reserved is still gone: only the rest can be reserved.
            left = 2000 - charged
            with pytest.raises(grpc.RpcError) as e:
                list(
                    c.generate(
                        prompt_token_ids=[1] * 8,
                        max_new_tokens=int(left) - 4,
                        timeout=60,
                        metadata=md,
                    )
                )
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert list(c.generate(prompt_token_ids=[1] * 8, max_new_tokens=1, metadata=md))
    finally:
        proc.stop()


def _level(state) -> float:
    import json

    doc = json.loads(state.read_text())
    return doc["acme\ntokens_per_day"][0]
