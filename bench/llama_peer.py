"""llama.cpp as the runtime benchmark's peer, in a child process kept alive across rounds.

The child (`python -m bench.llama_peer GGUF THREADS`) loads the GGUF once with llama-cpp-python
and answers one JSON line per JSON request on its stdin, using the low-level loop only
(`Llama.eval` + argmax of the last logits), never the high-level completion API, so it is timed
exactly like our `generate.greedy`: prefill of given token ids, then decode steps. A child also
keeps a build for another CPU (SIGILL) from killing the benchmark.
"""

from __future__ import annotations

import importlib.util
import json
import select
import signal
import subprocess
import sys
import tempfile
import time


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class PeerError(RuntimeError):
    pass


class LlamaPeer:
    """The parent's side: start the child, ask it for timings, close it."""

    def __init__(self, gguf: str, threads: int, timeout_s: float = 600):
        self.timeout_s = timeout_s
        # A file, not a pipe: an unread pipe could fill and block the child. Closed by close().
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.llama_peer", gguf, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        hello = self._read()
        self.system_info: str = hello["system_info"]
        self.threads: int = hello["threads"]

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to evaluate `prompt` into an empty cache (one llama_decode of n_batch 512)."""
        return self._ask({"cmd": "prefill", "prompt": prompt})["seconds"]

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        """Greedy: prefill `prompt` (not timed), then n - 1 decode steps; the steps' wall time
        and the n greedy token ids."""
        r = self._ask({"cmd": "decode", "prompt": prompt, "n": n})
        return r["seconds"], r["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()

    def _ask(self, req: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # _read reports how the child ended
        return self._read()

    def _read(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            why = f"no answer in {self.timeout_s:.0f} s"
        else:
            rc = self.proc.wait()
            why = f"signal {-rc}" if rc < 0 else f"exit {rc}"
            if rc == -signal.SIGILL:
                why += ", SIGILL: built for instructions this CPU lacks"
        self.stderr.seek(0)
        tail = self.stderr.read()[-400:].decode(errors="replace").strip()
        raise PeerError(f"llama.cpp peer died ({why}){': ' + tail if tail else ''}")


def _serve(gguf: str, threads: int) -> None:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    info = llama_cpp.llama_print_system_info().decode().strip()
    print(json.dumps({"system_info": info, "threads": threads}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()
        if req["cmd"] == "prefill":
            t0 = time.perf_counter()
            llm.eval(req["prompt"])
            argmax()
            print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
            continue
        llm.eval(req["prompt"])
        tokens = [argmax()]
        t0 = time.perf_counter()
        for _ in range(req["n"] - 1):
            llm.eval(tokens[-1:])
            tokens.append(argmax())
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
