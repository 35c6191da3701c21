"""The native kernels against torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 makes torch dispatch
them on any AVX2 CPU, as it does by itself on one without AVX-512), in a child process (torch
reads the variable once): each build's int4 and int8 results are within one bf16 rounding of
torch's AVX2 int4pack and int8pack kernels, and the same bits as in a process where torch
dispatches its own choice: the native kernels do not depend on which kernels torch dispatches
(kernels/qmm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_runtime.kernels import isas

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import hashlib, json, os, sys
import torch
from model_runtime.kernels import isas
from model_runtime.llm.quant import Int4Linear, Int8Linear

def close(ours, want):
    tol = want.float().abs() * 2.0**-7 + 1e-4 * want.float().abs().max()
    return bool(((ours.float() - want.float()).abs() <= tol).all())

out = {"capability": torch.backends.cpu.get_cpu_capability()}
for build in sys.argv[1:]:
    gen = torch.Generator().manual_seed(0)
    os.environ[isas.ISA_ENV] = build
    digest, within = hashlib.sha256(), []
    for n, k in ((960, 576), (576, 1536)):
        w = torch.randn(n, k, generator=gen)
        lin = Int4Linear.from_dense(w)
        os.environ["MESHLM_INT4_KERNEL"] = "torch"
        ref = Int4Linear.from_dense(w)
        del os.environ["MESHLM_INT4_KERNEL"]
        assert lin.isa == build and not ref.native
        for rows in (1, 3, 8, 13):
            x = (torch.randn(rows, k, generator=gen) * 2).to(torch.bfloat16)
            y = lin(x)
            digest.update(y.view(torch.int16).numpy().tobytes())
            within.append(close(y, ref(x)))
    head = Int8Linear.from_dense(torch.randn(4096, 576, generator=gen))
    assert head.isa == build
    for rows in (1, 3, 8, 9):
        x = (torch.randn(rows, 576, generator=gen) * 2).to(torch.bfloat16)
        y = head(x)
        digest.update(y.view(torch.int16).numpy().tobytes())
        within.append(close(y, torch.ops.aten._weight_int8pack_mm(x, head.q, head.scales)))
    out[build] = {"sha256": digest.hexdigest(), "within": within}
print(json.dumps(out))
"""


def _child(builds: list[str], **env: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    env.pop("MESHLM_INT4_KERNEL", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *builds],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_native_kernels_give_their_bits_whatever_torch_dispatches():
    builds = [b for b in isas.BUILDS if isas.runs(b)]
    if "avx2" not in builds:
        pytest.skip("not an x86-64 Linux CPU with AVX2")
    avx2 = _child(builds, ATEN_CPU_CAPABILITY="avx2")
    own = _child(builds)
    assert avx2["capability"] == "AVX2"
    for build in builds:
        assert all(avx2[build]["within"]), (build, avx2[build])
        assert avx2[build]["sha256"] == own[build]["sha256"], build
    if len(builds) == 2:  # and each build gives the other's bits
        assert own["avx2"]["sha256"] == own["avx512"]["sha256"]
