"""The caller library (meshlm/client/caller.py) on real processes: runtimes serving the real int4
SmolLM2 over grpcio (one with a stall fault in this process, one `meshlm serve --fault-exit-after`
child process that dies mid-stream), a real control plane and a real caller-side Envoy. Every
broken stream must end as the whole, correct greedy stream: no duplicate, no missing token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from mesh_common.headers import VERSION_HEADER
from mesh_common.ports import free_port
from meshlm.client import Caller, Stall, StreamLost
from meshlm.demo.procs import Proc, wait_until
from model_runtime.serving.client import Client
from model_runtime.serving.faults import Faults
from model_runtime.serving.service import Runtime
from schemas import codec
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.runtime_fixtures import serving_runtime
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

CHAT = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
N = 14  # max_new_tokens: the faults strike after 5
STALL = {"gap": "1s", "consecutive": 3, "hard_limit": "3s", "max_resumes": 2}


@dataclass
class Rig:
    healthy: Runtime
    staller: Runtime
    dier: Proc
    dier_port: int
    caller_port: int
    envoy: EnvoyProcess
    reference: list[int]  # the uninterrupted greedy stream

    def caller(self, service: str, **kw) -> Caller:
        return Caller(f"127.0.0.1:{self.caller_port}", authority=service, **kw)

    def retries(self) -> int:
        stats = json.loads(self.envoy.admin_get("/stats?filter=upstream_rq_retry$&format=json"))
        return sum(s.get("value", 0) for s in stats["stats"])


def _runtime(loaded, replica_id: str, faults: Faults | None = None) -> Runtime:
    return serving_runtime(loaded, faults=faults, replica_id=replica_id)


@pytest.fixture(scope="module")
def rig(smollm_int4, tmp_path_factory) -> Iterator[Rig]:
    healthy = _runtime(smollm_int4, "healthy")
    staller = _runtime(smollm_int4, "staller", Faults(stall_after=5))
    dier_port = free_port()
    logdir = tmp_path_factory.mktemp("dier")
    dier = Proc.meshlm(
        "dier",
        [
            "serve",
            "--port",
            str(dier_port),
            "--metrics-port",
            str(free_port()),
            "--replica-id",
            "dier",
            "--fault-exit-after",
            "5",
        ],
        logdir,
        env={"OMP_NUM_THREADS": "1"},
    ).start()
    cp = None
    try:
        svc = {
            "route": {"weights": {"v1": 100}, "stream_idle_timeout": "30s"},
            "retry_policy": {"retry_on": "unavailable,connect-failure", "num_retries": 1},
            "stall": STALL,
        }

        def service(*targets: str) -> dict:
            return {"versions": {"v1": {"endpoints": list(targets)}}, **svc}

        mesh = parse_mesh(
            {
                "services": {
                    "stall": service(healthy.target, staller.target),
                    "exit": service(healthy.target, f"127.0.0.1:{dier_port}"),
                }
            }
        )
        cp = build_server(mesh, debounce=0.02).start()
        caller_port = free_port()
        boot = ads_bootstrap(
            "caller-1", xds_address=("127.0.0.1", cp.grpc_port), outbound_port=caller_port
        )
        with Client(healthy.target) as c:
            reference = [
                int(t) for ch in c.generate(messages=CHAT, max_new_tokens=N) for t in ch.token_ids
            ]
        assert len(reference) == N
        with EnvoyProcess(boot) as envoy:
            wait_until(lambda: _serving(dier_port), 180, "the dying runtime", dier)
            yield Rig(healthy, staller, dier, dier_port, caller_port, envoy, reference)
    finally:
        dier.stop()
        if cp is not None:
            cp.stop()
        for rt in (healthy, staller):
            rt.shutdown(grace=1)


def _serving(port: int) -> bool:
    with Client(f"127.0.0.1:{port}") as c:
        return bool(c.info(timeout=2))


def _read(stream) -> tuple[list[int], list[int]]:
    ids, indexes = [], []
    for chunk in stream:
        ids.extend(int(t) for t in chunk.token_ids)
        indexes.append(chunk.index)
    return ids, indexes


def _until_resumed(rig: Rig, service: str, failing: str) -> list:
    """Streams through the mesh until one was resumed off `failing` (round robin over two
    hosts: within a few calls). Every stream, resumed or not, must be the reference."""
    resumed = []
    with rig.caller(service) as caller:
        for _ in range(4):
            stream = caller.generate(messages=CHAT, max_new_tokens=N, timeout=60)
            ids, indexes = _read(stream)
            assert ids == rig.reference
            assert indexes == list(range(len(indexes)))  # no chunk twice, none missing
            if stream.resumes:
                resumed.append(stream)
                break
        assert caller.resumes == len(resumed[0].resumes) if resumed else True
    assert resumed, f"no stream reached {failing}"
    event = resumed[0].resumes[0]
    assert (event.replica, event.version, event.delivered) == (failing, "v1", 5)
    assert resumed[0].replicas[-1] == "healthy"
    return resumed


def test_stall_after_5_tokens_resumes_on_the_other_replica(rig: Rig) -> None:
    (stream,) = _until_resumed(rig, "stall", "staller")
    assert stream.resumes[0].reason.startswith(("stalled", "INTERNAL", "UNAVAILABLE", "CANCEL"))


def test_hard_exit_after_5_tokens_resumes_on_the_other_replica(rig: Rig) -> None:
    _until_resumed(rig, "exit", "dier")
    wait_until(lambda: not rig.dier.alive(), 10, "the faulty runtime's exit")
    assert rig.dier.popen.returncode == 70  # os._exit: a crash, not a drain


def test_a_resume_that_lands_on_the_failing_replica_moves_to_another(rig: Rig) -> None:
    """The resume names the replica to avoid; the one that is named refuses with UNAVAILABLE
    before any header and the caller-side Envoy retries on another host (previous_hosts)."""
    before = rig.retries()
    req = codec.GenerateRequest(
        messages=[codec.ChatMessage(**m) for m in CHAT],
        max_new_tokens=N,
        resume_token_ids=rig.reference[:5],
        resume_index=3,
        avoid_replica="staller",
    )
    with Client(f"127.0.0.1:{rig.caller_port}", authority="stall") as c:
        for _ in range(2):  # round robin: one of the two lands on the staller first
            call = c.generate_raw(
                codec.encode_generate_request(req), timeout=60, metadata=[(VERSION_HEADER, "v1")]
            )
            chunks = [codec.decode_token_chunk(b) for b in call]
            assert dict(call.initial_metadata())["x-meshlm-replica"] == "healthy"
            assert [int(t) for ch in chunks for t in ch.token_ids] == rig.reference[5:]
            assert [ch.index for ch in chunks] == list(range(3, 3 + len(chunks)))
    assert rig.retries() > before


def test_a_cancelled_stream_is_not_resumed(rig: Rig) -> None:
    with Caller(rig.staller.target, stall=Stall(gap=0.2, hard_limit=0.5)) as caller:
        stream = caller.generate(messages=CHAT, max_new_tokens=N, timeout=30)
        got = []
        for chunk in stream:
            got.extend(chunk.token_ids)
            if len(got) >= 5:
                break  # now stalled on the runtime: the caller gives up on its own
        time.sleep(0.5 + 0.2 + 0.5)  # past the hard limit: a resume would have started
        stream.close()
        assert (caller.resumes, stream.resumes) == (0, [])


def test_an_expired_stream_is_not_resumed(rig: Rig) -> None:
    with Caller(rig.staller.target, stall=Stall(gap=0.2, hard_limit=5.0)) as caller:
        stream = caller.generate(messages=CHAT, max_new_tokens=N, timeout=2.0)
        with pytest.raises(grpc.RpcError) as e:
            _read(stream)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (caller.resumes, stream.resumes, len(stream.token_ids)) == (0, [], 5)


def test_gives_up_after_max_resumes_with_a_clear_error(rig: Rig) -> None:
    """Straight to the stalling runtime, no mesh: the resume comes back to it, which refuses it
    (it is the replica to avoid); with max_resumes 1 that second failure ends the stream."""
    with Caller(rig.staller.target, stall=Stall(gap=0.2, hard_limit=0.6, max_resumes=1)) as c:
        stream = c.generate(messages=CHAT, max_new_tokens=N, timeout=30)
        with pytest.raises(StreamLost) as e:
            _read(stream)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 1 resumes (max_resumes 1), 5 tokens delivered" in e.value.details()
    assert stream.resumes[0].replica == "staller"
