"""The README's "Run a mesh by hand", walked as a newcomer walks it, each step a real `meshlm`
process: a control plane on (a copy of) examples/mesh.yaml, a v1 runtime with its OpenAI HTTP API
behind its sidecar, a caller sidecar, and the `openai` SDK called as its docs show it, with no
extra header; then a v2 runtime and sidecar, `meshlm rollout start llm`, and calls at the pace a
person sends them by hand (~2.5/s) until the example's rollout has promoted v2. Every process then
gets Ctrl-C (SIGINT to its process group, as a terminal sends it) and must exit 0 without a
traceback.

The copy changes only the ports (free ones, so runs never collide) and where the join tokens go;
the rollout (steps, interval, gates) is the example's own."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from mesh_common.ports import free_port
from meshlm.admin_client import AdminClient
from tests.test_xds_support import eventually

ROOT = Path(__file__).resolve().parent.parent
HI = [{"role": "user", "content": "Hi!"}]
CALL_EVERY = 0.4  # seconds: ~2.5 calls/s, a shell loop's pace
MAX_CALLS = 400  # the rollout needs ~80 at that pace (2 analysed steps of 15 s); room for halts
ROLLOUT_DEADLINE = 180.0  # seconds of calls at most


class Walk:
    """The processes started so far, in order; each in its own process group."""

    def __init__(self, workdir: Path, run_dir: Path) -> None:
        self.workdir = workdir
        self.env = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
        # The run dir (admin token, CA root, sidecars' keys): this walk's own, short enough
        # for the sidecars' SDS unix sockets.
        self.env["XDG_RUNTIME_DIR"] = str(run_dir)
        self.env["OMP_NUM_THREADS"] = "1"  # two runtimes on a small shared machine
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.run_dir = run_dir
        self.ports: dict[str, int] = {}
        self.mesh = workdir / "mesh.yaml"

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        out = open(self.workdir / f"{name}.out", "w")  # noqa: SIM115 (the process keeps it)
        err = open(self.workdir / f"{name}.err", "w")  # noqa: SIM115
        p = subprocess.Popen(
            [sys.executable, "-m", "meshlm.cli", *argv],
            cwd=self.workdir, env=self.env, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
        self.procs.append((name, p))
        return p

    def meshlm(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "meshlm.cli", *argv, "--admin", self.admin_url],
            cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    @property
    def admin_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['admin']}"

    def admin(self) -> AdminClient:
        """The admin API as the CLI finds it: token and CA root in the run dir."""
        run = self.run_dir / "meshlm"
        token = (run / f"admin-{self.ports['admin']}.token").read_text().strip()
        ca = run / f"admin-{self.ports['admin']}-ca.pem"
        return AdminClient(self.admin_url, token=token, cacert=str(ca))

    def err(self, name: str) -> str:
        return (self.workdir / f"{name}.err").read_text(errors="replace")

    def log_tail(self, name: str) -> str:
        texts = [(self.workdir / f"{name}.{s}").read_text(errors="replace") for s in ("out", "err")]
        return f"--- {name} ---\n" + "".join(texts)[-3000:]

    def alive(self) -> None:
        for name, p in self.procs:
            assert p.poll() is None, f"{name} exited {p.returncode}\n{self.log_tail(name)}"

    def ctrl_c_all(self) -> dict[str, int | None]:
        """SIGINT to each process group, callers first and the control plane last."""
        codes: dict[str, int | None] = {}
        for name, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
            try:
                codes[name] = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def kill_all(self) -> None:
        for _, p in self.procs:
            with contextlib.suppress(ProcessLookupError):  # the group is gone: nothing left
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _mesh_copy(ports: dict[str, int]) -> dict:
    """examples/mesh.yaml with free ports; nothing else changed."""
    doc = yaml.safe_load((ROOT / "examples" / "mesh.yaml").read_text())
    doc["control_plane"].update(
        grpc_port=ports["grpc"], admin_port=ports["admin"],
        ca_port=ports["ca"], ca_mtls_port=ports["ca_mtls"],
    )  # fmt: skip
    for v in ("v1", "v2"):
        ver = doc["services"]["llm"]["versions"][v]
        ver["endpoints"] = [f"127.0.0.1:{ports[f'inbound_{v}']}"]
        ver["metrics_urls"] = [f"http://127.0.0.1:{ports[f'metrics_{v}']}/metrics.json"]
    doc["caller_sidecars"] = [{"admin_url": f"http://127.0.0.1:{ports['caller_admin']}"}]
    return doc


@pytest.fixture
def walk(tmp_path: Path) -> Iterator[Walk]:
    run_dir = Path(tempfile.mkdtemp(prefix="mlm-"))  # 0700
    w = Walk(tmp_path, run_dir)
    names = ["grpc", "admin", "ca", "ca_mtls", "caller", "caller_admin"]
    names += [f"{kind}_{v}" for v in ("v1", "v2") for kind in ("inbound", "metrics", "rt", "http")]
    w.ports = {n: free_port() for n in names}
    w.mesh.write_text(yaml.safe_dump(_mesh_copy(w.ports), sort_keys=False))
    try:
        yield w
    finally:
        w.kill_all()  # after ctrl_c_all, only what did not stop
        shutil.rmtree(run_dir, ignore_errors=True)


def _runtime(w: Walk, version: str, precision: str) -> None:
    p = w.ports
    w.start(
        f"runtime-{version}", "serve", "--precision", precision, "--port", str(p[f"rt_{version}"]),
        "--metrics-port", str(p[f"metrics_{version}"]), "--http-port", str(p[f"http_{version}"]),
        "--served-model-name", "llm",
    )  # fmt: skip


def _inbound_sidecar(w: Walk, version: str) -> None:
    token = w.workdir / f"llm-{version}.token"
    r = w.meshlm("identity", "token", "--service-account", "default/llm", "--out", str(token))
    assert r.returncode == 0, r.stderr
    p = w.ports
    w.start(
        f"sidecar-{version}", "sidecar", "--xds", f"127.0.0.1:{p['grpc']}", "--mesh", str(w.mesh),
        "--service", "llm", "--version", version,
        "--local-endpoint", f"127.0.0.1:{p[f'rt_{version}']}",
        "--local-http-endpoint", f"127.0.0.1:{p[f'http_{version}']}",
        "--identity", "--join-token-file", str(token),
    )  # fmt: skip


def _sdk(w: Walk, **headers: str) -> openai.OpenAI:
    """The openai SDK as its docs write it: a base URL and a key (plus `headers`, if any)."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{w.ports['caller']}/v1",
        api_key="demo-acme-key",
        max_retries=0,
        timeout=60,
        default_headers=headers or None,
    )


def _completes(client: openai.OpenAI) -> bool:
    r = client.chat.completions.create(model="llm", messages=HI, max_tokens=4)
    return bool(r.choices and r.choices[0].message.content)


# Bounded by its waits (model loads, the rollout's calls, each Ctrl-C): ~1 minute when it passes.
@pytest.mark.timeout(600)
def test_a_newcomer_runs_the_mesh_by_hand_and_rolls_out_v2(walk: Walk) -> None:
    w = walk
    w.start("xds-server", "xds-server", "--mesh", str(w.mesh))
    token_file = w.run_dir / "meshlm" / f"admin-{w.ports['admin']}.token"
    eventually(lambda: token_file.exists() or w.alive(), 60, "the control plane's admin token")
    _runtime(w, "v1", "bf16")
    _inbound_sidecar(w, "v1")
    caller_token = w.workdir / "caller.token"
    r = w.meshlm("identity", "token", "--service-account", "default/caller", "--out",
                 str(caller_token))  # fmt: skip
    assert r.returncode == 0, r.stderr
    w.start(
        "sidecar-caller", "sidecar", "--xds", f"127.0.0.1:{w.ports['grpc']}",
        "--outbound-port", str(w.ports["caller"]), "--admin-port", str(w.ports["caller_admin"]),
        "--identity", "--join-token-file", str(caller_token),
    )  # fmt: skip

    # The SDK with no Host header: the example mesh's only service takes the call.
    with _sdk(w) as plain:

        def first_call() -> bool:
            w.alive()
            return _completes(plain)

        eventually(first_call, 150, "a completion through the caller sidecar, no extra header")

        _runtime(w, "v2", "int4")
        _inbound_sidecar(w, "v2")
        with _sdk(w, **{"x-canary": "always"}) as pinned:  # the README's tester's pin

            def v2_serves() -> bool:
                w.alive()
                return _completes(pinned)

            eventually(v2_serves, 150, "v2 serving through the mesh")

        r = w.meshlm("rollout", "start", "llm")
        assert r.returncode == 0, r.stdout + r.stderr
        admin = w.admin()
        calls = failures = 0
        state, reply = "", {}
        deadline = time.monotonic() + ROLLOUT_DEADLINE
        while calls < MAX_CALLS and time.monotonic() < deadline:
            began = time.monotonic()
            try:
                _completes(plain)
            except openai.APIError as e:
                failures += 1
                print(f"call {calls} failed: {e}")
            calls += 1
            if calls % 5 == 0:
                _, reply = admin.request("GET", "/rollouts/llm", timeout=10)
                state = reply.get("state", "")
                if state in ("Succeeded", "RolledBack", "Failed"):
                    break
            time.sleep(max(0.0, CALL_EVERY - (time.monotonic() - began)))
        summary = json.dumps(
            {k: reply.get(k) for k in ("state", "message", "analyses", "history")}, indent=1
        )
        assert state == "Succeeded", f"after {calls} calls: {summary}"
        assert reply["weights"] == {"v1": 0, "v2": 100} and reply["stable"] == "v2", summary
        assert failures == 0, f"{failures} of {calls} calls failed"
        assert _completes(plain)  # v2 serves alone now

    codes = w.ctrl_c_all()
    logs = "\n".join(w.log_tail(n) for n, _ in w.procs)
    assert codes == {n: 0 for n, _ in reversed(w.procs)}, f"{codes}\n{logs}"
    tracebacks = [n for n, _ in w.procs if "Traceback" in w.err(n)]
    assert not tracebacks, f"a traceback on Ctrl-C: {tracebacks}\n{logs}"
