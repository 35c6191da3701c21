"""`meshlm serve` warms its engine up before it reports SERVING (issue 13: a cold runtime's first
call paid for lazy initialisation, 0.3-0.8 s of TTFT, and in a rollout that call was the
canary's first-interval p99). The effect on latency is measured by `python -m bench demo`; here,
on the real process, that the warm-up ran at every batch size before SERVING and is not counted
as a caller's call."""

from __future__ import annotations

import json
import urllib.request

from mesh_common.ports import free_port
from meshlm.demo.launcher import _serving
from meshlm.demo.procs import Proc, wait_until
from model_runtime.serving.client import Client

MAX_BATCH = 3


def test_serving_only_after_a_warm_up_at_every_batch_size(tmp_path) -> None:
    port, metrics = free_port(), free_port()
    args = ["serve", "--port", str(port), "--metrics-port", str(metrics),
            "--max-batch", str(MAX_BATCH)]  # fmt: skip
    proc = Proc.meshlm("warm", args, tmp_path, env={"OMP_NUM_THREADS": "1"}).start()
    try:
        wait_until(lambda: _serving(port), 180, "runtime SERVING", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics.json", timeout=5) as r:
            doc = json.loads(r.read())
        engine = doc["engine"]
        # max_batch requests at once, each decoding until the last was admitted.
        assert engine["requests_admitted"] == MAX_BATCH
        assert engine["tokens_generated"] >= MAX_BATCH * MAX_BATCH
        assert engine["running"] == engine["queue_depth"] == 0
        assert doc["totals"] == {} and doc["ttft_ms"]["count"] == 0  # no caller's call
        with Client(f"127.0.0.1:{port}") as c:
            assert list(c.generate(prompt="Hello", max_new_tokens=2, timeout=60))
        assert "warmed up in" in proc.log_path.read_text()
    finally:
        proc.stop()
