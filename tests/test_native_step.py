"""The int4 decode step as one native call (model_runtime/llm/native_step.py, kernels/step.c), and
its attention alone in a step that runs in torch ops (model_runtime/llm/native_attention.py).

Its attention's softmax is not torch's to the last bit, so these tests compare it with torch's
ops within a tolerance and assert exactly only what holds on every CPU: the K/V it writes to the
first layer (bit-identical matmuls and RoPE), and that a row decodes the same alone, batched or
on any thread count. They run for each build this CPU runs (AVX-512, AVX2: an int4 model loaded
with MESHLM_KERNEL_ISA set), and the AVX2 build gives the AVX-512 one's bits where a CPU runs
both.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch

from model_runtime.engine import generate
from model_runtime.engine.kvcache import layout_decode, layout_prefill
from model_runtime.kernels import isas, qmm
from model_runtime.llm import native_attention, native_step
from model_runtime.loading.loader import load

STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
BS = 16


def _checked(lm):
    why = native_step.why_not(lm.model)
    if why is not None and why.startswith("MESHLM_NATIVE_STEP"):
        pytest.fail(f"unset {why} to run these tests")
    return lm


def _loaded_for(build: str, smollm_int4):
    """The int4 model with its layers on `build` (the shared one where it already is)."""
    if not isas.runs(build):
        pytest.skip(f"this CPU does not run the {build} build")
    if smollm_int4.model.output.isa == build or not qmm.applies():
        return smollm_int4
    return _load(build)


@functools.cache
def _load(build: str):
    with pytest.MonkeyPatch.context() as m:
        m.setenv(isas.ISA_ENV, build)
        lm = load(precision="int4")
    assert lm.model.output.isa == build
    return lm


@pytest.fixture(scope="module", params=isas.BUILDS)
def int4(request, smollm_int4):
    """The int4 model on each build of the native kernels in turn."""
    return _checked(_loaded_for(request.param, smollm_int4))


@pytest.fixture(scope="module")
def int4_default(smollm_int4):
    return _checked(smollm_int4)


@contextlib.contextmanager
def decode_path(model, path):
    """`model.native_step` and `model.native_attention` = path for a while (restored after)."""
    saved = model.native_step, model.native_attention
    model.native_step = model.native_attention = path
    try:
        yield
    finally:
        model.native_step, model.native_attention = saved


def torch_ops(model):
    """The model's own decode path, all in torch ops, for a while."""
    return decode_path(model, None)


def undecided(model):
    """As load() leaves a model: the decode path chosen at its first decode step."""
    return decode_path(model, "auto")


def _prefilled(lm, prompts: list[list[int]], per_seq: int = 16):
    m = lm.model
    kv, seqs = generate.paged_cache(m, len(prompts), per_seq * BS)
    nxt = []
    with torch_ops(m):
        for s, p in zip(seqs, prompts, strict=True):
            logits = m(torch.tensor([p]), kv, layout_prefill(s, 0, len(p), BS))
            s.written = len(p)
            nxt.append(int(logits[0].argmax()))
    return kv, seqs, nxt


def compare_steps(seqs, nxt: list[int], steps: int, step_fn) -> tuple[float, int]:
    """Teacher-forced decode steps, the reference's greedy choices fed back: step_fn(tokens,
    layout) -> (ours, ref) logits of every row. Returns the largest |ours - ref| and how many
    rows and steps chose the same token."""
    agree, worst = 0, 0.0
    for _ in range(steps):
        lay = layout_decode(seqs, BS)
        ours, ref = step_fn(torch.tensor([[t] for t in nxt]), lay)
        worst = max(worst, float((ours - ref).abs().max()))
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        nxt = [int(t) for t in ref.argmax(-1)]
        for s in seqs:
            s.written += 1
    return worst, agree


@torch.inference_mode()
def test_int4_decodes_natively_by_default_and_the_switch_turns_it_off(int4_default, monkeypatch):
    int4 = int4_default
    ids = int4.tokenizer.encode_chat(STORY)
    # a private copy, as load() leaves a model: it decides for itself at its first decode step
    # (the shared model may have decided already, in an earlier test)
    with undecided(int4.model):
        lm = copy.deepcopy(int4)
    assert lm.model.native_step == "auto"
    generate.greedy(lm, [ids], 3)
    why = native_step.why_not(lm.model)
    if why is None:
        assert isinstance(lm.model.native_step, native_step.NativeStep)
        assert "; decode steps in one native call; prefill attention in " in lm.info.compute
    else:  # another CPU: torch's ops, and the reason is given (Info's `compute` says it too)
        assert lm.model.native_step is None
        assert f"; decode steps in torch ops ({why}); prefill attention in " in lm.info.compute
    monkeypatch.setenv("MESHLM_NATIVE_STEP", "0")
    with undecided(int4.model):
        off = copy.deepcopy(int4)
    generate.greedy(off, [ids], 3)
    assert off.model.native_step is None
    assert native_step.why_not(off.model) == "MESHLM_NATIVE_STEP=0"


@torch.inference_mode()
def test_bf16_model_keeps_torchs_ops(smollm_bf16):
    assert native_step.why_not(smollm_bf16.model) is not None
    assert native_step.attach(smollm_bf16.model) is None


def _attached(lm):
    """The model's native step, or None where it does not apply, which is then said."""
    nat = native_step.attach(lm.model)
    if nat is None:
        assert native_step.why_not(lm.model)
    return nat


def _logits(nat, tokens, kv, lay) -> torch.Tensor:
    """A native step's logits, which it says are all finite."""
    logits, finite = nat(tokens, kv, lay)
    assert finite and logits.dtype == torch.float32
    return logits


@torch.inference_mode()
def test_native_step_matches_torchs_ops(int4):
    """Teacher-forced over 24 steps: layer 0's K/V bit-identical, logits within bf16 noise,
    the same greedy choice on nearly every step."""
    m, nat = int4.model, _attached(int4)
    if nat is None:
        return  # torch's ops serve instead, the reason said
    kv, seqs, nxt = _prefilled(int4, [int4.tokenizer.encode_chat(STORY)])
    agree, worst = 0, 0.0
    for _ in range(24):
        lay = layout_decode(seqs, BS)
        tokens = torch.tensor([nxt])
        ours = _logits(nat, tokens, kv, lay)
        slot = int(lay.write_slots[0])
        ours_kv0 = kv.kv[0, slot].clone()
        with torch_ops(m):
            ref = m(tokens, kv, lay)  # rewrites the same slots
        assert torch.equal(ours_kv0, kv.kv[0, slot])
        worst = max(worst, float((ours - ref).abs().max()))
        agree += int(ours.argmax() == ref.argmax())
        nxt = [int(ref.argmax())]
        seqs[0].written += 1
    assert worst < 2.0, worst  # logits span ~40; bf16 steps there are 0.125-0.25
    assert agree >= 22


@torch.inference_mode()
def test_a_row_decodes_the_same_alone_or_batched(int4):
    """Rows never mix: beside a longer prompt and its padding, a row's logits are bit-identical
    to its logits alone (what keeps batching and speculation token-identical)."""
    nat = _attached(int4)
    if nat is None:
        return  # torch's ops serve instead, the reason said
    short = int4.tokenizer.encode_chat(STORY)
    long = int4.tokenizer.encode("The history of the city goes back to the Romans. " * 12)
    kv, seqs, nxt = _prefilled(int4, [short, long])
    lay2 = layout_decode(seqs, BS)
    both = _logits(nat, torch.tensor([[t] for t in nxt]), kv, lay2)
    alone = _logits(nat, torch.tensor([[nxt[0]]]), kv, layout_decode(seqs[:1], BS))
    assert lay2.gather_slots.shape[1] > layout_decode(seqs[:1], BS).gather_slots.shape[1]
    assert torch.equal(both[0], alone[0])
    assert torch.isfinite(both).all()


@torch.inference_mode()
def test_a_nonfinite_logit_is_reported_and_a_bad_token_id_left_to_torch(int4):
    """The step says when a logit is inf or NaN (the guard then redoes the step in torch ops);
    a token id outside the vocabulary is not embedded natively: torch's path raises."""
    m, nat = int4.model, _attached(int4)
    if nat is None:
        return  # torch's ops serve instead, the reason said
    kv, seqs, nxt = _prefilled(int4, [int4.tokenizer.encode_chat(STORY)])
    lay = layout_decode(seqs, BS)
    saved = m.norm[:2].clone()
    m.norm[:2] = torch.tensor([float("inf"), float("-inf")])  # the final norm's gain
    try:
        logits, finite = nat(torch.tensor([nxt]), kv, lay)
    finally:
        m.norm[:2] = saved
    assert not finite and not torch.isfinite(logits).all()
    assert nat(torch.tensor([[m.args.vocab_size]]), kv, lay) is None
    with pytest.raises(IndexError):
        m(torch.tensor([[m.args.vocab_size]]), kv, lay)
    assert _logits(nat, torch.tensor([nxt]), kv, lay).isfinite().all()


@torch.inference_mode()
@pytest.mark.parametrize("rows", [2, 1])
def test_a_step_gives_the_same_bits_on_any_thread_count(int4, rows):
    """Also across step.c's two attention kernels: one row's 3 K/V heads are 3 grouped tasks on
    1 thread (each K/V head's 3 query heads together) and 9 per-head ones on 2 and 3."""
    nat = _attached(int4)
    if nat is None:
        return  # torch's ops serve instead, the reason said
    prompts = [int4.tokenizer.encode_chat(STORY), int4.tokenizer.encode("Once upon a time")]
    kv, seqs, nxt = _prefilled(int4, prompts[:rows])
    lay = layout_decode(seqs, BS)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got.append(_logits(nat, torch.tensor([[t] for t in nxt]), kv, lay))
            got.append(kv.kv[:, lay.write_slots].clone())
    finally:
        torch.set_num_threads(threads)
    for i in range(2, len(got)):
        assert torch.equal(got[i], got[i % 2])


@torch.inference_mode()
def test_the_avx2_step_gives_the_avx512_steps_bits(smollm_int4):
    """One source, two builds: on a CPU that runs both, the same logits and K/V, step by step."""
    if not (isas.runs("avx512") and isas.runs("avx2")):
        pytest.skip("this CPU does not run both builds")
    models = [_loaded_for(b, smollm_int4) for b in ("avx512", "avx2")]
    steps = [native_step.attach(lm.model) for lm in models]
    if None in steps:
        pytest.skip(f"no native step here: {native_step.why_not(models[0].model)}")
    assert [s.isa for s in steps] == ["avx512", "avx2"]
    prompts = [smollm_int4.tokenizer.encode_chat(STORY), smollm_int4.tokenizer.encode("Hi")]
    kv, seqs, nxt = _prefilled(models[0], prompts)
    for _ in range(8):
        lay = layout_decode(seqs, BS)
        tokens = torch.tensor([[t] for t in nxt])
        got = []
        for step in steps:
            got += [_logits(step, tokens, kv, lay), kv.kv[:, lay.write_slots].clone()]
        assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[3])
        nxt = [int(t) for t in got[0].argmax(-1)]
        for s in seqs:
            s.written += 1


@contextlib.contextmanager
def attention_only(model, nat):
    """A decode step in torch ops but for its attention (`nat`), for a while."""
    saved = model.native_step, model.native_attention
    model.native_step, model.native_attention = None, nat
    try:
        yield
    finally:
        model.native_step, model.native_attention = saved


@torch.inference_mode()
@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_native_attention_matches_sdpa_and_keeps_rows_apart(precision, smollm_bf16, smollm_int4):
    """Attention alone native in a torch-ops decode step (a bf16 model's; an int4 model's where
    its step is off), teacher-forced over 16 steps of two rows of different lengths: logits
    within bf16 noise of SDPA's, the same greedy choice on nearly every row and step, and (int4: its
    linears are the native kernels) the short row's logits bit-identical to its logits alone."""
    lm = smollm_bf16 if precision == "bf16" else smollm_int4
    m = lm.model
    nat = native_attention.attach(m)
    if nat is None:  # e.g. a bf16 model computing in fp32 on a CPU without native bf16
        assert native_attention.why_not(m)
        return
    short = lm.tokenizer.encode_chat(STORY)
    long = lm.tokenizer.encode("The history of the city goes back to the Romans. " * 12)
    kv, seqs, nxt = _prefilled(lm, [short, long], per_seq=24)
    answered = []

    def counted(*args):
        y = nat(*args)
        answered.append(y is not None)
        return y

    def step(tokens, lay):
        with attention_only(m, counted):
            ours = m(tokens, kv, lay)
            alone = m(tokens[:1], kv, layout_decode(seqs[:1], BS))
        with torch_ops(m):
            ref = m(tokens, kv, lay)  # rewrites the same slots with the same K/V
        if precision == "int4":  # oneDNN's bf16 matmuls round 1 and 2 rows differently
            assert torch.equal(ours[0], alone[0])
        return ours, ref

    worst, agree = compare_steps(seqs, nxt, 16, step)
    assert answered == [True] * (16 * 2 * m.args.n_layers)  # every layer of both calls
    assert worst < 2.0, worst  # logits span ~40; bf16 steps there are 0.125-0.25
    assert agree >= 26, agree  # of 32 (a broken attention agrees on few; near-ties may flip)


@torch.inference_mode()
@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_a_prompt_prefills_to_the_same_bits_in_any_chunks(precision, smollm_bf16, smollm_int4):
    """Prefill attention native: a prompt's last logits and every K/V it writes are the same bits
    prefilled whole, from a prefix-cache hit (16, 32: the engine's block boundaries), in chunks
    that start anywhere, or on one thread, and within bf16 noise of SDPA's. Under SDPA a row got
    other bits prefilled after a 16-token hit than whole, and a greedy stream took another token
    at a near-tie (the stall demo's resumed stream unlike any uninterrupted one)."""
    lm = smollm_bf16 if precision == "bf16" else smollm_int4
    m = lm.model
    nat = native_attention.attach(m)
    if nat is None:
        assert native_attention.why_not(m)
        return  # torch's SDPA serves, the reason said (Info's `compute` too)
    ids = lm.tokenizer.encode_chat(STORY)
    splits = [[0], [0, 16], [0, 32], [0, 7, 23], [0, 16, len(ids) - 1]]
    kv, seqs = generate.paged_cache(m, len(splits) + 2, len(ids))
    slots = [s.slots_np(0, len(ids), BS) for s in seqs]
    threads = torch.get_num_threads()

    def prefill(i: int, starts: list[int], path) -> torch.Tensor:
        with attention_only(m, path):  # a 1-token chunk, too, in native attention alone
            for start, end in zip(starts, [*starts[1:], len(ids)], strict=True):
                lay = layout_prefill(seqs[i], start, end - start, BS)
                logits = m(torch.tensor([ids[start:end]]), kv, lay)
        return logits

    answered = []

    def counted(*args):
        y = nat(*args)
        answered.append(y is not None)
        return y

    whole = [prefill(i, starts, counted) for i, starts in enumerate(splits)]
    try:
        torch.set_num_threads(1)
        whole.append(prefill(len(splits), [0], counted))
    finally:
        torch.set_num_threads(threads)
    sdpa = prefill(len(splits) + 1, [0], None)
    assert all(answered) and len(answered) == sum(map(len, splits), 1) * m.args.n_layers
    for i in range(1, len(whole)):
        assert torch.equal(whole[i], whole[0]), i
        assert torch.equal(kv.kv[:, slots[i]], kv.kv[:, slots[0]]), i
    assert float((whole[0] - sdpa).abs().max()) < 2.0  # logits span ~40 (see above)
    assert int(whole[0].argmax()) == int(sdpa.argmax())


def test_a_bf16_model_decodes_with_native_attention_by_default(smollm_bf16, monkeypatch):
    ids = smollm_bf16.tokenizer.encode_chat(STORY)
    with undecided(smollm_bf16.model):
        lm = copy.deepcopy(smollm_bf16)
    generate.greedy(lm, [ids], 3)
    why = native_attention.why_not(lm.model)
    assert native_step.why_not(lm.model) is not None  # not an int4 model: no native step
    if why is None:
        assert isinstance(lm.model.native_attention, native_attention.NativeAttention)
        assert lm.info.compute.endswith("; attention in one native call a layer")
    else:  # another CPU: torch's SDPA, and the reason is given (Info's `compute` too)
        assert lm.model.native_attention is None
        assert lm.info.compute.endswith(f"; attention in torch's SDPA ({why})")
    monkeypatch.setenv("MESHLM_NATIVE_STEP", "0")
    with undecided(smollm_bf16.model):
        off = copy.deepcopy(smollm_bf16)
    generate.greedy(off, [ids], 3)
    assert off.model.native_attention is None
    assert native_attention.why_not(off.model) == "MESHLM_NATIVE_STEP=0"
