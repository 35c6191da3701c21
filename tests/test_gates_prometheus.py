"""Rollout gates read from a real Prometheus (Debian's `prometheus`, from `make test-tools`)
scraping a real mesh: the caller Envoy's `/stats/prometheus` and the real runtimes' `/metrics`
(SmolLM2 int4 over gRPC), issue 16 item 2. The gates are PromQL queries; the controller moves
the weights through the control plane as with the direct sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest

from mesh_common.ports import free_port
from model_runtime.serving.client import Client
from model_runtime.serving.faults import Faults
from model_runtime.serving.telemetry import MetricsServer
from tests.runtime_fixtures import serving_runtime
from tests.test_rollout_envoy import caller_mesh, sources, wait_terminal
from xds_server.mesh.rollout_spec import PrometheusProvider, parse_rollout
from xds_server.rollout.controller import RolloutController, RolloutError
from xds_server.rollout.gates.prometheus import PrometheusSource, evaluate_metrics
from xds_server.rollout.verdict import HALT

# /meshlm.inference.v1.Inference/Generate's grpc_stats, as Envoy's tag extraction names them
SUCCESS = (
    'sum(rate(envoy_cluster_grpc_v1_Inference_Generate_success{envoy_cluster_name="{{ cluster }}"}'
    "[{{ interval }}])) / sum(rate(envoy_cluster_grpc_v1_Inference_Generate_total"
    '{envoy_cluster_name="{{ cluster }}"}[{{ interval }}]))'
)
TTFT_P99 = (
    "histogram_quantile(0.99, sum by (le) (rate(meshlm_time_to_first_token_seconds_bucket"
    '{service="{{ service }}", version="{{ version }}"}[{{ interval }}])))'
)


def spec(prometheus_url: str, **metrics: dict) -> dict:
    return {
        "service": "llm",
        "stable": "v1",
        "canary": "v2",
        "steps": [50],
        "interval": "3s",
        "threshold": 2,
        "gates": {
            "provider": {"prometheus": {"url": prometheus_url}},
            "metrics": metrics
            or {
                "success_rate": {"query": SUCCESS, "min": 0.99},
                "ttft_p99": {"query": TTFT_P99, "max": "60s"},
            },
        },
    }


def _exe(name: str) -> str:
    exe = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail(f"{name} not found: run `make test-tools` (Debian's prometheus package)")
    return exe


def query(url: str, promql: str) -> list:
    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as r:
        return json.load(r)["data"]["result"]


@contextmanager
def prometheus(tmp: Path, jobs: dict[str, tuple[str, list[tuple[str, dict]]]]) -> Iterator[str]:
    """A real Prometheus scraping every second: job -> (metrics path, [(host:port, labels)]).
    Yields its URL once every target has been scraped up; stopped on exit."""
    scrapes = [
        {
            "job_name": job,
            "metrics_path": path,
            "static_configs": [{"targets": [t], "labels": labels} for t, labels in targets],
        }
        for job, (path, targets) in jobs.items()
    ]
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": scrapes}
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(
        [_exe("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        n = sum(len(targets) for _, targets in jobs.values())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            try:
                if len(query(url, "up == 1")) == n:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"targets not up: {(tmp / 'prometheus.log').read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


class Calls:
    """Real Generate calls through the caller Envoy on `threads` threads; codes counted."""

    def __init__(self, target: str, threads: int = 2) -> None:
        self.client = Client(target, authority="llm")
        self.codes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                list(self.client.generate(prompt="Hi", max_new_tokens=2, timeout=30))
                self.codes["OK"] += 1
            except grpc.RpcError as e:
                self.codes[e.code().name] += 1

    def __enter__(self) -> Calls:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(35)
        self.client.close()


@contextmanager
def scraped_mesh(loaded, tmp: Path, canary_faults: Faults) -> Iterator[tuple]:
    """Real runtimes v1 and v2 (v2 with `canary_faults`) behind a caller Envoy fed by the
    control plane, and a Prometheus scraping that Envoy and both runtimes' /metrics."""
    with ExitStack() as stack:
        rts = {}
        for version, faults in (("v1", Faults()), ("v2", canary_faults)):
            rt = serving_runtime(loaded, faults=faults)
            stack.callback(rt.shutdown, 1)
            metrics = stack.enter_context(MetricsServer(rt.telemetry))
            rts[version] = (rt, metrics.port)
        cp, envoy, target = stack.enter_context(caller_mesh(rts["v1"][0], rts["v2"][0]))
        admin = urllib.parse.urlsplit(envoy.admin_url).netloc
        runtimes = [
            (f"127.0.0.1:{port}", {"service": "llm", "version": v}) for v, (_, port) in rts.items()
        ]
        jobs = {
            "envoy": ("/stats/prometheus", [(admin, {"role": "caller"})]),
            "runtime": ("/metrics", runtimes),
        }
        url = stack.enter_context(prometheus(tmp, jobs))
        yield cp, envoy, target, url


def run(cp, envoy, tmp: Path, the_spec: dict) -> dict:
    c = RolloutController(cp, str(tmp / "r.json"), sources(envoy), poll_s=0.05)
    try:
        c.start(the_spec)
        return wait_terminal(c, timeout=90)
    finally:
        c.close()


def test_a_healthy_canary_passes_gates_read_from_prometheus(smollm_int4, tmp_path: Path) -> None:
    with (
        scraped_mesh(smollm_int4, tmp_path, Faults()) as (cp, envoy, target, url),
        Calls(target) as calls,
    ):
        st = run(cp, envoy, tmp_path, spec(url))
    assert st["state"] == "Succeeded", st
    passed = [a for a in st["analyses"] if a["outcome"] == "pass"]
    assert [a["canary_weight"] for a in passed] == [50]
    assert passed[0]["metrics"]["success_rate"] == 1.0
    assert 0 < passed[0]["metrics"]["ttft_p99"] <= 60
    assert passed[0]["provider"] == url
    assert set(calls.codes) == {"OK"}, calls.codes


def test_a_faulty_canary_is_rolled_back_by_gates_read_from_prometheus(
    smollm_int4, tmp_path: Path
) -> None:
    faults = Faults(error_percent=50, seed=7)
    with (
        scraped_mesh(smollm_int4, tmp_path, faults) as (cp, envoy, target, url),
        Calls(target) as calls,
    ):
        st = run(cp, envoy, tmp_path, spec(url))
        assert cp.mesh.services["llm"].route.weights == {"v1": 100, "v2": 0}
    assert st["state"] == "RolledBack", st
    failed = [a for a in st["analyses"] if a["outcome"] == "fail"]
    assert len(failed) == 2 and {a["canary_weight"] for a in failed} == {50}
    assert "success_rate" in st["message"] and "< min 0.99" in st["message"]
    assert all(a["metrics"]["success_rate"] < 0.99 for a in failed)
    assert calls.codes["UNAVAILABLE"] > 0


def test_no_data_errors_and_an_unreachable_prometheus_hold_or_refuse(
    smollm_int4, tmp_path: Path
) -> None:
    with scraped_mesh(smollm_int4, tmp_path, Faults()) as (cp, envoy, _, url):

        def verdict(prometheus_url: str, q: str):
            s = parse_rollout("llm", spec(prometheus_url, gate={"query": q, "min": 0.5}))
            return evaluate_metrics(s, PrometheusSource(s.gates.provider))

        # no calls to the canary yet: the ratio is NaN (0/0), the quantile empty -> hold
        v = verdict(url, SUCCESS)
        assert (v.outcome, v.reason) == (HALT, "halted: gate: no data"), v
        assert verdict(url, "absent(up)").reason == "halted: gate: no data"
        v = verdict(url, "up")  # one series per target: the gate needs one number
        assert v.outcome == HALT and "3 series" in v.reason and "aggregate" in v.reason
        assert verdict(url, "count(up)").outcome == "pass"
        closed = f"http://127.0.0.1:{free_port()}"
        v = verdict(closed, "count(up)")
        assert v.outcome == HALT and v.reason.startswith("halted: Prometheus unavailable")
        assert closed in v.reason

        c = RolloutController(cp, str(tmp_path / "r.json"), sources(envoy), poll_s=0.05)
        try:  # nothing starts on gates that could never be judged; the message says why
            with pytest.raises(RolloutError, match=r"gates\.metrics\.gate: .*bad_data"):
                c.start(spec(url, gate={"query": "sum(rate(up[", "min": 1}))
            with pytest.raises(RolloutError, match=r"Prometheus cannot be read: .*refused"):
                c.start(spec(closed))
            assert cp.mesh.services["llm"].route.weights == {"v1": 100, "v2": 0}
        finally:
            c.close()


def test_the_provider_fetch_follows_no_redirect(tmp_path: Path) -> None:
    """A server that redirects is not followed (the sources' fetch rules)."""
    import http.server

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("location", "http://127.0.0.1:1/api/v1/query")
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        s = parse_rollout("llm", spec(url))
        v = evaluate_metrics(s, PrometheusSource(PrometheusProvider(url)))
        assert v.outcome == HALT and "not followed" in v.reason
    finally:
        srv.shutdown()
        srv.server_close()
