"""The native kernels' builds against torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 makes torch
dispatch them on any AVX2 CPU, as it does by itself on one without AVX-512), in a child process
(torch reads the variable once): torch's AVX2 int4pack kernel gives the native kernels' bits (each
output one fp32 FMA chain over k, whatever the vector width); its AVX2 int8pack kernel adds the
products in 8 lanes, not 16, so the native int8 results are within one bf16 rounding of it, not
its bits. Which is what kernels/__init__.py says and why the native kernels do not depend on the
kernels torch dispatches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_runtime import kernels

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys
import torch
from model_runtime import kernels
from model_runtime.quant import Int4Linear, Int8Linear

out = {"capability": torch.backends.cpu.get_cpu_capability()}
gen = torch.Generator().manual_seed(0)
for build in sys.argv[1:]:
    os.environ[kernels.ISA_ENV] = build
    int4 = []
    for n, k in ((960, 576), (576, 1536)):
        w = torch.randn(n, k, generator=gen)
        lin = Int4Linear.from_dense(w)
        os.environ["MESHLM_INT4_KERNEL"] = "torch"
        ref = Int4Linear.from_dense(w)
        del os.environ["MESHLM_INT4_KERNEL"]
        assert lin.isa == build and not ref.native
        for rows in (1, 3, 8, 13):
            x = (torch.randn(rows, k, generator=gen) * 2).to(torch.bfloat16)
            int4.append(torch.equal(lin(x), ref(x)))
    head = Int8Linear.from_dense(torch.randn(4096, 576, generator=gen))
    assert head.isa == build
    int8 = []
    for rows in (1, 3, 8, 9):
        x = (torch.randn(rows, 576, generator=gen) * 2).to(torch.bfloat16)
        ours = head(x).float()
        want = torch.ops.aten._weight_int8pack_mm(x, head.q, head.scales).float()
        tol = want.abs() * 2.0**-7 + 1e-4 * want.abs().max()
        int8.append([int((ours != want).sum()), bool(((ours - want).abs() <= tol).all())])
    out[build] = {"int4_equal": int4, "int8": int8}
print(json.dumps(out))
"""


def test_torchs_avx2_kernels_int4_bits_and_int8_within_bf16_rounding():
    builds = [b for b in kernels.BUILDS if kernels.runs(b)]
    if "avx2" not in builds:
        pytest.skip("not an x86-64 Linux CPU with AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(ROOT)}
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
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["capability"] == "AVX2"
    for build in builds:
        assert all(got[build]["int4_equal"]), (build, got[build])
        assert all(close for _, close in got[build]["int8"]), (build, got[build])
