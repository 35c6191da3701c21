"""The int4 model's decode step as one native call (kernels/step.c).

A decode forward (every row one new token, over the paged cache) runs in C on torch's OpenMP
team instead of thousands of torch ops: the embedding (from the tied int8 head), all layers, the
final norm and the head, to fp32 logits and whether one is inf or NaN. It applies to models whose
every linear layer uses the native int4 kernels (int4 at group 32 on AVX-512 or AVX2) with
the tied int8 head, all of one build; the step runs that build's library (libstep.so or
libstep_avx2.so: one source, the same bits). Anything else, and prefill (T > 1), stays on torch.
MESHLM_NATIVE_STEP=0 turns it off for models loaded while it is set; `use(model, False)` turns it
off for one model. The loader attaches it (llm/accelerators.py): model.py does not import it. A
model on int8 activations (quant.use_int8_activations) runs q8.c's kernels on its layers' copies
of their weights in that layout.
Attention's softmax is not bit-identical to torch's SDPA (see step.c); the bench compares the
greedy ids of both paths.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from model_runtime.kernels import qmm
from model_runtime.kernels.isas import library_path
from model_runtime.llm.quant import Int4Linear, Int8Linear, TiedInt8Embedding

LIBRARY = library_path("step", "avx512")
_P = ctypes.c_void_p


class _Q4(ctypes.Structure):
    _fields_ = [("codes", _P), ("sz", _P), ("codes8", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("wqkv", _Q4), ("wo", _Q4), ("w13", _Q4), ("w2", _Q4)]
    _fields_ += [("attn_norm", _P), ("ffn_norm", _P)]


class _Model(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int)
        for name in ("n_layers", "dim", "n_heads", "n_kv", "head_dim", "hidden", "vocab", "ctx")
    ]
    _fields_ += [("eps", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)), ("norm", _P)]
    _fields_ += [("head_q", _P), ("head_scales", _P), ("rope", _P), ("q8", ctypes.c_int)]
    _fields_ += [("head8", _P)]


class _Step(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int), ("L", ctypes.c_int), ("tokens", _P), ("pos", _P)]
    _fields_ += [("write_slots", _P), ("gather", _P), ("mask", _P), ("kv", _P)]
    _fields_ += [("n_slots", ctypes.c_int64), ("logits", _P), ("keys0", ctypes.c_int)]


class AttnArgs(ctypes.Structure):  # step.c attn_t (native_attention.py)
    _fields_ = [(name, ctypes.c_int) for name in ("B", "L", "n_heads", "n_kv", "head_dim", "layer")]
    _fields_ += [("qkv", _P), ("gather", _P), ("mask", _P), ("kv", _P)]
    _fields_ += [("n_slots", ctypes.c_int64), ("out", _P), ("keys0", ctypes.c_int)]


@functools.cache
def library(build: str = "avx512") -> ctypes.CDLL:
    """The decode step of `build` ("avx512" | "avx2")."""
    lib = ctypes.CDLL(str(library_path("step", build)))
    lib.native_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), ctypes.c_int]
    lib.native_step.restype = ctypes.c_int
    lib.native_attention.argtypes = [ctypes.POINTER(AttnArgs), ctypes.c_int]
    lib.native_attention.restype = ctypes.c_int
    lib.step_set_gomp.argtypes = [_P, _P, _P, _P]
    qmm.set_dot(lib, build)
    gomp = qmm.gomp()
    if gomp is not None:  # else one thread
        lib.step_set_gomp(
            ctypes.cast(gomp.GOMP_parallel, _P),
            ctypes.cast(gomp.omp_get_thread_num, _P),
            ctypes.cast(gomp.omp_get_num_threads, _P),
            ctypes.cast(gomp.GOMP_barrier, _P),
        )
    return lib


def switched_off(model: torch.nn.Module) -> str | None:
    """Why no native decode code (this step, native_attention.py) runs for `model`: the
    switch, no native build for this CPU, another device; else None."""
    if os.environ.get("MESHLM_NATIVE_STEP", "1") == "0":
        return "MESHLM_NATIVE_STEP=0"
    if qmm.why_not() is not None:
        return qmm.why_not()
    if model.device.type != "cpu":
        return f"the model is on {model.device}"
    return None


def unbuilt(build: str) -> str | None:
    """Why `build`'s step library cannot load, or None."""
    path = library_path("step", build)
    if path.exists():
        return None
    return f"{path.name} is not built (python -m model_runtime.kernels.build)"


def why_not(model: torch.nn.Module) -> str | None:
    """None when the native step applies to `model`, else the reason it does not."""
    off = switched_off(model)
    if off is not None:
        return off
    if not isinstance(model.tok_embeddings, TiedInt8Embedding) or not (
        isinstance(model.output, Int8Linear) and model.output.native
    ):
        return "the head is not the native int8 one"
    for layer in model.layers:
        lins = (layer.attention.wqkv, layer.attention.wo)
        lins += (layer.feed_forward.w13, layer.feed_forward.w2)
        if not all(isinstance(q, Int4Linear) and q.native for q in lins):
            return "not every linear layer is a native int4 one"
        if any(q.isa != model.output.isa for q in lins):
            return "the layers were built for different native kernels"
        if any((q.codes8 is None) != (model.output.head8 is None) for q in lins):
            return "int8 activations on some layers only"
    return unbuilt(model.output.isa)


def build_of(model: torch.nn.Module) -> str | None:
    """The native build the model's step runs ("avx512" | "avx2"), or None."""
    return model.output.isa if why_not(model) is None else None


class NativeStep:
    """The model's weights as step.c reads them: pointers into the model's tensors as they were
    when it was built (it holds them, so a layer swapped later is not freed under it; call
    `use(model, True)` again after swapping layers). A deep copy of the model gets "auto" in its
    place, so the copy builds its own from its own tensors."""

    def __init__(self, model: torch.nn.Module):
        a = model.args
        self.model = model
        self.rope = torch.view_as_real(model.freqs).contiguous()
        # int8 activations (kernels/q8.c): the layers' weights in its layouts
        self.int8_activations = model.output.head8 is not None
        self.held: list[torch.Tensor] = []
        layers = (_Layer * a.n_layers)()
        for i, blk in enumerate(model.layers):
            att, ff = blk.attention, blk.feed_forward
            for name, lin in (("wqkv", att.wqkv), ("wo", att.wo), ("w13", ff.w13), ("w2", ff.w2)):
                ptrs = (lin.packed.data_ptr(), lin.scales_zeros.data_ptr())
                codes8 = 0 if lin.codes8 is None else lin.codes8.data_ptr()
                setattr(layers[i], name, _Q4(*ptrs, codes8))
                self.held += [lin.packed, lin.scales_zeros, lin.codes8]
            layers[i].attn_norm = blk.attention_norm.data_ptr()
            layers[i].ffn_norm = blk.ffn_norm.data_ptr()
            self.held += [blk.attention_norm, blk.ffn_norm]
        self.layers = layers
        head = model.output
        self.isa = head.isa  # the build of every layer (why_not)
        self.lib = library(self.isa)
        self.held += [head.q, head.scales, model.norm]
        head8 = head.head8
        self.held.append(head8)
        self.m = _Model(
            a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim, a.vocab_size,
            self.rope.shape[0], a.norm_eps, layers, model.norm.data_ptr(), head.q.data_ptr(),
            head.scales.data_ptr(), self.rope.data_ptr(), self.q8_mode(),
            0 if head8 is None else head8.data_ptr(),
        )  # fmt: skip

    def q8_mode(self) -> int:
        """step.c's model_t.q8: 0 bf16 activations, 1 int8, 2 int8 with VNNI's instruction."""
        if not self.int8_activations:
            return 0
        return 2 if self.model.output.vnni else 1

    def __deepcopy__(self, memo) -> str:
        return "auto"

    def __call__(self, tokens: torch.Tensor, cache, lay) -> tuple[torch.Tensor, bool] | None:
        """Logits float32 [B, V] of one decode step and whether all are finite, or None where
        step.c does not apply (a token id out of range included: torch's path raises)."""
        B = tokens.shape[0]
        kv = cache.kv
        if kv.dtype != torch.bfloat16 or not kv.is_contiguous():
            return None
        ids = tokens.view(-1).to(torch.int64).contiguous()
        pos = lay.input_pos.view(-1).contiguous()
        writes = lay.write_slots.contiguous()
        attended = attended_slots(lay, B)
        if attended is None:
            return None
        gather, mask = attended
        logits = torch.empty(B, self.m.vocab, dtype=torch.float32)
        s = _Step(
            B, gather.shape[1], ids.data_ptr(), pos.data_ptr(), writes.data_ptr(),
            gather.data_ptr(), 0 if mask is None else mask.data_ptr(), kv.data_ptr(),
            kv.shape[1], logits.data_ptr(),
        )  # fmt: skip
        rc = self.lib.native_step(ctypes.byref(self.m), ctypes.byref(s), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("native decode step: out of memory")
        return None if rc < 0 else (logits, rc == 0)


def attended_slots(lay, B: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The slots each of the B rows attends [B, L] and its mask [B, L] (None: all), contiguous
    as step.c reads them; None where the mask does not cover the slots."""
    gather = lay.gather_slots.contiguous()
    mask = lay.mask
    if mask is not None:
        mask = mask.reshape(B, -1).contiguous()
        if mask.shape[1] != gather.shape[1]:
            return None
    return gather, mask


def attach(model: torch.nn.Module) -> NativeStep | None:
    """The model's native step, or None where it does not apply."""
    return NativeStep(model) if why_not(model) is None else None


def use(model: torch.nn.Module, on: bool) -> None:
    """Turn the native step on (where it applies) or off for `model` (benchmarks compare); off,
    the decode step runs in torch ops only (native attention too is off), on, attention alone
    is native where the step does not apply (native_attention.py)."""
    model.native_step = attach(model) if on else None
    model.native_attention = "auto" if on else None
