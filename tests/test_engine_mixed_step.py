"""Stall-free batching on the real model: a prompt's chunk rides in the step that decodes every
running stream, sized by the step budget (engine/budget.py), and greedy tokens stay the ones
the old schedule (a whole chunk, then the decode step) gives."""

from __future__ import annotations

import pytest

from model_runtime.engine.budget import MIN_CHUNK, ChunkBudget
from model_runtime.engine.engine import Engine, GenerateParams
from tests.test_engine_scheduler import Stream, chat, wait_for

LONG = "The history of the city goes back to the Romans, who built a bridge here. " * 24


def _streams_with_one_arriving_mid_stream(loaded, **engine_kw) -> tuple[Engine, list[Stream]]:
    """Two streams of different prompt lengths; once both decode, a long prompt arrives."""
    e = Engine(loaded, max_batch=4, **engine_kw)
    e.start()
    early = [
        chat(loaded, "Write a long story about a dragon.", max_new_tokens=48),
        chat(loaded, "Name three colors and say why you like each one.", max_new_tokens=48),
    ]
    streams = [Stream() for _ in range(3)]
    try:
        for i, p in enumerate(early):
            e.submit(f"early{i}", p, streams[i])
        wait_for(lambda: all(len(s.events) >= 3 for s in streams[:2]))
        e.submit("long", chat(loaded, LONG + "Summarize.", max_new_tokens=12), streams[2])
        for s in streams:
            s.wait()
    except BaseException:
        e.shutdown(drain_timeout=1)
        raise
    e.shutdown()
    return e, streams


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_mixed_steps_give_the_greedy_tokens_of_separate_ones(precision, smollm_bf16, smollm_int4):
    loaded = smollm_bf16 if precision == "bf16" else smollm_int4
    mixed, got = _streams_with_one_arriving_mid_stream(loaded, tpot_target_ms=1, mixed_step=True)
    _, want = _streams_with_one_arriving_mid_stream(loaded, mixed_step=False)
    assert [s.ids for s in got] == [s.ids for s in want]
    assert all(len(s.ids) > 0 for s in got)
    rode = [st for st in mixed.steps if st.prefill_rid == "long" and st.decode]
    assert len(rode) >= 2  # the long prompt was prefilled in several chunks beside the streams
    # bf16 decodes in torch ops: one forward; the int4 native step keeps its own call
    assert all(st.fused for st in rode) == (precision == "bf16")


def test_a_long_prompt_mid_stream_keeps_every_running_stream_in_every_step(smollm_bf16):
    e, streams = _streams_with_one_arriving_mid_stream(
        smollm_bf16, tpot_target_ms=1, mixed_step=True
    )
    long_steps = [st for st in e.steps if st.prefill_rid == "long"]
    n_prompt = len(chat(smollm_bf16, LONG + "Summarize.").prompt_ids)
    cached = n_prompt - sum(st.prefill for st in long_steps)  # the shared system prompt's blocks
    assert 0 <= cached < n_prompt // 4 and cached % e.block_size == 0
    # the documented bound: a step beside running streams holds at most the budget's tokens,
    # or the decode rows plus MIN_CHUNK prompt tokens when the rows alone fill the budget
    for st in long_steps:
        if st.decode:
            assert st.prefill <= max(MIN_CHUNK, st.budget - len(st.decode)), st
    # a 1 ms target is below any step here: every chunk beside the streams is the minimum
    beside = [st for st in long_steps if st.decode]
    assert all(st.prefill == MIN_CHUNK for st in beside[:-1])
    # both early streams were decoding when the prompt arrived: each got a row in every step
    # of its prefill until the stream itself ended
    for name, s in zip(("early0", "early1"), streams[:2], strict=True):
        rows = [name in st.decode for st in long_steps]
        assert rows[0], name
        if not all(rows):
            assert not any(rows[rows.index(False) :]) and s.finish in ("stop", "length")


def test_the_budget_admits_larger_chunks_under_a_higher_target_and_a_prompt_always_moves(
    smollm_bf16,
):
    chunks = {}
    for target_ms in (1, 60_000):
        e, streams = _streams_with_one_arriving_mid_stream(
            smollm_bf16, tpot_target_ms=target_ms, mixed_step=True
        )
        beside = [st for st in e.steps if st.prefill_rid == "long" and st.decode]
        assert beside and all(st.prefill >= 1 for st in beside)
        assert streams[2].finish in ("stop", "length") and streams[2].ids
        chunks[target_ms] = max(st.prefill for st in beside)
    assert chunks[1] == MIN_CHUNK
    assert chunks[60_000] >= 4 * MIN_CHUNK


def test_the_budget_scales_toward_the_target_within_bounds():
    b = ChunkBudget(target_s=0.02)
    b.observe(32, 0.04)  # twice the target: halve
    assert b.tokens == 16
    b.observe(16, 0.001)  # far under: at most double a step
    assert b.tokens == 32
    assert b.chunk(decode_rows=8, left=1000) == MIN_CHUNK * 1.5  # 32 - 8 rows = 24
    assert b.chunk(decode_rows=40, left=1000) == MIN_CHUNK  # rows alone fill it: the minimum
    assert b.chunk(decode_rows=40, left=3) == 3
    with pytest.raises(ValueError):
        ChunkBudget(target_s=0)


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_by_default_a_prompt_goes_in_whole_chunks_beside_running_streams(
    precision, smollm_bf16, smollm_int4
):
    loaded = smollm_bf16 if precision == "bf16" else smollm_int4
    e, _ = _streams_with_one_arriving_mid_stream(loaded, tpot_target_ms=1)
    beside = [st for st in e.steps if st.prefill_rid == "long" and st.decode]
    assert beside and not any(st.fused for st in beside)
    assert beside[0].prefill > MIN_CHUNK


def test_no_stream_running_prefills_the_whole_chunk(smollm_bf16):
    e = Engine(smollm_bf16, max_batch=2, tpot_target_ms=1)
    e.start()
    try:
        s = Stream()
        e.submit("alone", GenerateParams(prompt_ids=chat(smollm_bf16, LONG).prompt_ids[:300]), s)
        s.wait()
    finally:
        e.shutdown()
    assert [st.prefill for st in e.steps] == [256, 44]
