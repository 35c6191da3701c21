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

import numpy as np


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

    def decode_batch(self, prompt: list[int], n: int, batch: int) -> tuple[float, list[int]]:
        """`batch` sequences of `prompt` decoded together, as our batch-`batch` rows: each
        prefilled on its own (not timed), then n - 1 steps of one llama_decode of `batch`
        tokens (one per sequence) and the argmax of every row; the steps' wall time and the
        first sequence's n token ids."""
        r = self._ask({"cmd": "decode_batch", "prompt": prompt, "n": n, "batch": batch})
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

    llm = llama_cpp.Llama(
        gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    batches: dict[int, _Batched] = {}
    info = llama_cpp.llama_print_system_info().decode().strip()
    print(json.dumps({"system_info": info, "threads": threads}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "decode_batch":
            b = req["batch"]
            if b not in batches:
                batches[b] = _Batched(llm, b, threads)
            seconds, tokens = batches[b].decode(req["prompt"], req["n"])
            print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
            continue
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


class _Batched:
    """A context of its own for `rows` sequences on the Llama's loaded model (llama.cpp's
    parallel decoding with its default context parameters: one KV stream a sequence; a unified
    cache, kv_unified, was no faster here: b8 217-235 vs 244-256 tok/s)."""

    def __init__(self, llm, rows: int, threads: int, n_ctx: int = 1024) -> None:
        import llama_cpp

        self.lc, self.rows, self.n_vocab = llama_cpp, rows, llm.n_vocab()
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = rows * n_ctx, n_ctx, n_ctx
        p.n_seq_max, p.n_threads, p.n_threads_batch = rows, threads, threads
        self.ctx = llama_cpp.llama_init_from_model(llm._model.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp: no context for {rows} sequences")
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def _put(self, tokens: list[int], pos: list[int], seqs: list[int], last_only: bool) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s) in enumerate(zip(tokens, pos, seqs, strict=True)):
            b.token[i], b.pos[i], b.seq_id[i][0], b.n_seq_id[i] = t, p, s, 1
            b.logits[i] = not last_only or i == len(tokens) - 1
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, rows: int) -> list[int]:
        logits = self.lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(logits, shape=(rows, self.n_vocab)).argmax(1).tolist()

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        last = []
        for s in range(self.rows):
            self._put(prompt, list(range(len(prompt))), [s] * len(prompt), True)
            last += self._argmax(1)
        out, seqs = [last[0]], list(range(self.rows))
        t0 = time.perf_counter()
        for i in range(n - 1):
            self._put(last, [len(prompt) + i] * self.rows, seqs, False)
            last = self._argmax(self.rows)
            out.append(last[0])
        return time.perf_counter() - t0, out


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
