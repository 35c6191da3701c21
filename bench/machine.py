"""The machine a benchmark ran on: one line for every section, and the CPU features that decide
which kernels the runtime and its peer can use (issue 13: speed does not carry over between
CPUs with and without avx512_bf16 / AMX)."""

import os
import platform

# The x86 features the int4/bf16 kernels (torch) and the quantized dot products (llama.cpp)
# depend on, as /proc/cpuinfo names them.
KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def describe() -> str:
    cpu = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def cpu_flags() -> dict[str, bool]:
    """Each of KERNEL_FLAGS -> whether this CPU reports it (all False off Linux/x86)."""
    have = set((_cpuinfo_field("flags") or "").split())
    return {f: f in have for f in KERNEL_FLAGS}


def describe_flags() -> str:
    """'avx2 yes, avx512f yes, ..., amx_int8 no' for a benchmark's header."""
    return ", ".join(f"{f} {'yes' if ok else 'no'}" for f, ok in cpu_flags().items())
