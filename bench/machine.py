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
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    if family and model:  # "AMD EPYC" names Zen 4 (family 25) and Zen 5 (26) alike
        cpu += f" (family {family}, model {model})"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def cpu_flags() -> dict[str, bool]:
    """Each of KERNEL_FLAGS -> whether this CPU reports it (all False off Linux/x86)."""
    have = set((_cpuinfo_field("flags") or "").split())
    return {f: f in have for f in KERNEL_FLAGS}


def describe_flags() -> str:
    """'avx2 yes, avx512f yes, ..., amx_int8 no' for a benchmark's header."""
    return ", ".join(f"{f} {'yes' if ok else 'no'}" for f, ok in cpu_flags().items())


def _cpu_name() -> str:
    """'Intel Xeon', 'AMD EPYC': the model name's first two words, without (R)/(TM)."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    for mark in ("(R)", "(r)", "(TM)", "(tm)"):
        name = name.replace(mark, " ")
    return " ".join(name.split()[:2])


def cpu_kind() -> str:
    """This CPU's kind as benchmark sections are keyed: the instruction sets the runtime's and
    llama.cpp's kernels are chosen by, then the CPU's name, an AMD CPU's with its family.
    'AVX-512 + AMX (Intel Xeon)', 'AVX-512 + BF16 (AMD EPYC family 25)'. A section measured on
    one kind never replaces another kind's."""
    have = cpu_flags()
    if have["avx512f"]:
        isa = "AVX-512 + AMX" if have["amx_tile"] else "AVX-512"
        if have["avx512_bf16"] and not have["amx_tile"]:
            isa += " + BF16"
    elif have["avx2"]:
        isa = "AVX2"
    else:
        isa = f"{platform.machine()} without AVX2"
    name = _cpu_name()
    family = _cpuinfo_field("cpu family")
    if name.startswith("AMD") and family:
        # both "AMD EPYC" with AVX-512 and BF16: Zen 4 (family 25) executes a 512-bit
        # instruction in two 256-bit halves, Zen 5 (26) in one; int4 batch-8 decode ran 2.1x as
        # fast on Zen 5, batch 1 1.1x
        name += f" family {family}"
    return f"{isa} ({name})"


def anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation other than '-' and
    '_' dropped, each space a '-' ('AVX-512 + AMX' -> 'avx-512--amx')."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")
