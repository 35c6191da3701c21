"""h2load (Debian's `nghttp2-client`) driving Envoy, for benchmarks that must see Envoy itself.

A Python client tops out near 6,000 requests/s, below one Envoy worker's capacity, so it
cannot see a filter's cost (issue 19). h2load (C, one event loop) keeps one Envoy worker busy
from one core: on two cores h2load runs on the first and the Envoys under test on the second
(`pin`), so the load generator does not take the Envoys' CPU. Two figures per run:

- throughput at saturation (closed loop: `clients` connections x `streams` concurrent streams);
- CPU seconds of each process under test per request (utime + stime from /proc/<pid>/stat over
  the run): robust against other load on the machine, which slows a run but does not add to
  the process's own CPU time.

Latency percentiles come from h2load's per-request log (`--log-file`), measured at a fixed rate
(`--rps` per client) below saturation, where they mean something.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

INSTALL_HINT = (
    "h2load not found: `make bench-tools` installs it (Debian's nghttp2-client, "
    "`apt-get install nghttp2-client`)"
)
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")


class H2loadMissing(RuntimeError):
    pass


def h2load_path() -> str:
    path = shutil.which("h2load")
    if path is None:
        raise H2loadMissing(INSTALL_HINT)
    return path


def grpc_frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message: uncompressed flag, 4-byte big-endian length, bytes."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def generate_request() -> bytes:
    """A small FlatBuffers GenerateRequest (8 new tokens), as a client of the mesh sends it."""
    from schemas import codec

    req = codec.GenerateRequest(
        messages=[codec.ChatMessage(role="user", content="Name a colour.")],
        max_new_tokens=8,
        temperature=0.0,
    )
    return codec.encode_generate_request(req)


def generate_request_body() -> bytes:
    """`generate_request()` gRPC-framed: an h2load request body."""
    return grpc_frame(generate_request())


def cores() -> tuple[int, int] | None:
    """(load generator's core, Envoys' core), or None on a one-core machine (no pinning)."""
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[1]) if len(allowed) >= 2 else None


def pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` onto `cpu` (Envoy starts its workers before it is ready)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), {cpu})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@dataclass
class Run:
    done: int
    succeeded: int
    seconds: float
    cpu_s: dict[int, float]  # pid -> CPU seconds over the run
    latencies_us: list[int] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.succeeded / self.seconds

    def cpu_us_per_request(self, pid: int) -> float:
        return self.cpu_s[pid] / max(1, self.succeeded) * 1e6

    def pct(self, q: float) -> float:
        s = sorted(self.latencies_us)
        return float(s[min(len(s) - 1, int(q * len(s)))]) if s else float("nan")


_DONE = re.compile(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded")
_FINISHED = re.compile(r"finished in ([\d.]+)(m?s)")


def run(
    url: str,
    *,
    seconds: int,
    clients: int = 4,
    streams: int = 8,
    headers: Sequence[str] = (),
    body: bytes | None = None,
    rps_per_client: int | None = None,
    pids: Iterable[int] = (),
    cpu: int | None = None,
) -> Run:
    """One h2load run of `seconds` (HTTP/2 prior knowledge, POST of `body` if given); each pid's
    CPU time is read around it. Raises RuntimeError when a request failed or was not answered
    2xx. A gRPC deny is HTTP 200 too: callers check what answered (Envoy's counters)."""
    pids = list(pids)
    with tempfile.TemporaryDirectory(prefix="meshlm-h2load-") as tmp:
        log = Path(tmp) / "requests.tsv"
        cmd = [h2load_path(), "-c", str(clients), "-m", str(streams), "-D", str(seconds)]
        cmd += ["--log-file", str(log)]
        for h in headers:
            cmd += ["-H", h]
        if body is not None:
            (Path(tmp) / "body").write_bytes(body)
            cmd += ["-d", str(Path(tmp) / "body")]
        if rps_per_client is not None:
            cmd += ["--rps", str(rps_per_client)]
        before = {p: cpu_seconds(p) for p in pids}
        out = _run_pinned([*cmd, url], cpu, timeout=seconds + 60)
        used = {p: cpu_seconds(p) - before[p] for p in pids}
        latencies = [int(line.split("\t")[2]) for line in log.read_text().splitlines() if line]
    text = out.stdout
    m, f = _DONE.search(text), _FINISHED.search(text)
    if out.returncode != 0 or not (m and f):
        raise RuntimeError(f"h2load failed ({out.returncode}): {text[-800:]}{out.stderr[-800:]}")
    _, done, ok = (int(g) for g in m.groups())
    ok_2xx = int(re.search(r"status codes: (\d+) 2xx", text).group(1))  # type: ignore[union-attr]
    took = float(f.group(1)) / (1000 if f.group(2) == "ms" else 1)
    r = Run(done, min(ok, ok_2xx), took, used, latencies)
    if r.succeeded == 0 or r.succeeded < done:
        raise RuntimeError(f"h2load: not every request was answered as expected:\n{text[-800:]}")
    return r


def _run_pinned(argv: list[str], cpu: int | None, timeout: float) -> subprocess.CompletedProcess:
    """`argv` run to its end on `cpu`. Pinned once started, not in a preexec_fn: a fork that
    runs Python in the child calls gRPC's fork handlers, and with gRPC threads in this process
    (control planes, SDS servers) the child aborted in them before exec."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        if cpu is not None:
            os.sched_setaffinity(proc.pid, {cpu})  # h2load's one thread, before it sends
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))
