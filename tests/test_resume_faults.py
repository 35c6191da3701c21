"""The faults that rehearse resume (issue 10) on real processes: a replica whose streams stall
after every Nth token (for a while, or until the call ends) without holding up other streams,
and a replica that dies hard once a stream has sent N tokens."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from mesh_common.headers import REPLICA_HEADER
from model_runtime.serving.client import Client
from model_runtime.serving.faults import EXIT_CODE, Faults
from model_runtime.serving.service import Runtime
from schemas import codec
from tests.runtime_fixtures import serving_runtime

STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


def _runtime(loaded, faults: Faults) -> Runtime:
    return serving_runtime(loaded, faults=faults)


def test_stall_after_every_nth_token_for_ms_then_the_stream_goes_on(smollm_int4) -> None:
    rt = _runtime(smollm_int4, Faults(stall_after=3, stall_ms=700))
    try:
        with Client(rt.target) as c:
            arrivals = []
            chunks = []
            for chunk in c.generate(messages=STORY, max_new_tokens=7, timeout=120):
                arrivals.append(time.monotonic())
                chunks.append(chunk)
        assert [len(x.token_ids) for x in chunks] == [1] * 7 and chunks[-1].finish_reason
        # Held after the 3rd and the 6th token (a lower bound with slack for the delivery of
        # the chunk before the stall, which the stall does not include).
        assert arrivals[3] - arrivals[2] >= 0.5 and arrivals[6] - arrivals[5] >= 0.5
    finally:
        rt.shutdown(grace=1)


def test_stall_forever_holds_one_stream_not_the_engine(smollm_int4) -> None:
    rt = _runtime(smollm_int4, Faults(stall_after=3))
    base = rt.engine.stats()["kv_blocks_used"]
    try:
        with Client(rt.target) as c:
            req = codec.GenerateRequest(messages=[codec.ChatMessage(**STORY[0])], max_new_tokens=40)
            stalled = c.generate_raw(codec.encode_generate_request(req), timeout=120)
            got: list[codec.TokenChunk] = []
            third = threading.Event()
            errors: list[grpc.StatusCode] = []

            def read() -> None:
                try:
                    for buf in stalled:
                        got.append(codec.decode_token_chunk(buf))
                        if len(got) == 3:
                            third.set()
                except grpc.RpcError as e:
                    errors.append(e.code())

            reader = threading.Thread(target=read)
            reader.start()
            assert third.wait(120)
            # Another stream decodes to its end meanwhile (2 tokens: below the stall count).
            other = list(c.generate(prompt="Hi", max_new_tokens=2, timeout=120))
            assert other[-1].finish_reason in ("stop", "length")
            assert len(got) == 3 and got[-1].finish_reason is None  # nothing after the 3rd
            stalled.cancel()
            reader.join(30)
            assert errors == [grpc.StatusCode.CANCELLED] and len(got) == 3
        end = time.monotonic() + 20
        while rt.engine.stats()["kv_blocks_used"] != base and time.monotonic() < end:
            time.sleep(0.05)
        assert rt.engine.stats()["kv_blocks_used"] == base  # the cancel reached the engine
    finally:
        rt.shutdown(grace=1)


@pytest.fixture
def exiting_replica() -> Iterator[tuple[subprocess.Popen, str]]:
    cmd = [sys.executable, "-m", "meshlm.cli", "serve", "--port", "0", "--fault-exit-after", "5"]
    proc = subprocess.Popen(
        [*cmd, "--replica-id", "doomed-1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        target = ""
        for line in proc.stdout:  # "meshlm serve: grpc HOST:PORT ..." then "... SERVING ..."
            if line.startswith("meshlm serve: grpc "):
                target = line.split()[3]
            if "SERVING" in line:
                break
        assert target and proc.poll() is None, proc.stderr.read()
        yield proc, target
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


def test_exit_after_n_tokens_kills_the_process_mid_stream(exiting_replica) -> None:
    proc, target = exiting_replica
    got: list[codec.TokenChunk] = []
    with Client(target) as c:
        req = codec.GenerateRequest(messages=[codec.ChatMessage(**STORY[0])], max_new_tokens=12)
        call = c.generate_raw(codec.encode_generate_request(req), timeout=120)
        with pytest.raises(grpc.RpcError) as e:
            for buf in call:
                got.append(codec.decode_token_chunk(buf))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (REPLICA_HEADER, "doomed-1") in call.initial_metadata()
    assert [len(x.token_ids) for x in got] == [1] * 5 and got[-1].finish_reason is None
    assert proc.wait(30) == EXIT_CODE
    assert "--fault-exit-after 5" in proc.stderr.read()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--fault-stall-ms", "100"], "stall-after"),
        (["--fault-stall-after", "-1"], "must be >= 0"),
        (["--replica-id", "a b"], "--replica-id"),
    ],
)
def test_bad_fault_and_replica_flags_are_refused(args, words) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and words in r.stderr, r.stderr
