"""Speculative decoding by prompt lookup: the drafter, and the engine on the real model (greedy
output unchanged, several tokens per step through stops, length, resume, the prefix cache)."""

from __future__ import annotations

import pytest

from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.engine.speculate import PromptLookup
from tests.test_engine_scheduler import Stream, chat, reference_margins, run, wait_for

PARA = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the great lamp, and watched the ships pass "
    "safely through the dark water below."
)
REPEAT = f"Repeat the following text exactly, word for word:\n\n{PARA}"


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    p = PromptLookup(max_ngram=3, min_ngram=2)
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3]
    assert p.draft(seq, 4) == [7, 8, 2, 3]  # "2 3" last occurred before 7, not before 4
    assert p.draft([*seq, 7], 2) == [8, 2]  # "2 3 7": the longest n-gram decides
    assert p.draft([*seq, 7, 6], 4) == []  # "7 6" never occurred
    assert p.draft([*seq, 7, 6], 0) == []


def test_prompt_lookup_stops_drafting_what_keeps_failing_and_tries_again_later() -> None:
    p = PromptLookup()
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
    assert p.draft(seq, 4) == [8, 9, 10, 11]
    for _ in range(4):
        p.feedback(4, 0)
    assert p.draft(seq, 4, batch=1) == []  # one row costs more than its expected gain
    for _ in range(60):  # steps without drafts
        p.feedback(0, 0)
    assert p.draft(seq, 4, batch=1) != []
    for _ in range(20):
        p.feedback(4, 4)
    assert p.draft(seq, 4, batch=8) == [8, 9, 10, 11]  # drafts that keep hitting pay at batch 8


def _engine(loaded, k: int) -> Engine:
    e = Engine(loaded, max_batch=4, max_queue=8, speculate_lookup=k)
    e.start()
    return e


def _assert_same_greedy(loaded, params: GenerateParams, plain: list[int], spec: list[int]):
    """Token for token, except where the two forwards' bf16 rounding split a near-tie (draft
    rows pad the attention differently, as batching does); every token is still the argmax of
    an uncached forward up to such rounding (wrong K/V would be off by whole logits)."""
    ctx = params.prompt_ids + params.resume_ids
    assert max(reference_margins(loaded, ctx, spec), default=0.0) <= 0.25
    if spec != plain:
        i = next(i for i, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b)
        assert reference_margins(loaded, ctx, plain[: i + 1])[i] <= 0.25, (i, plain, spec)


@pytest.fixture(scope="module")
def plain_and_spec(smollm_int4):
    """A batch mixing greedy and sampled streams, with speculation off and on."""
    params = [
        chat(smollm_int4, REPEAT, max_new_tokens=64),
        chat(smollm_int4, "What is the capital of France? Answer with one word."),
        chat(smollm_int4, "Copy this list exactly: apple, banana, cherry, date, fig, grape."),
        chat(smollm_int4, REPEAT, temperature=0.8, seed=3, max_new_tokens=32),
    ]
    out = {}
    for k in (0, 8):
        e = _engine(smollm_int4, k)
        try:
            out[k] = (run(e, params), e.stats())
        finally:
            e.shutdown()
    return params, out


def test_speculation_keeps_greedy_output_in_a_mixed_batch(smollm_int4, plain_and_spec):
    params, out = plain_and_spec
    (plain, _), (spec, st) = out[0], out[8]
    assert st["draft_accepted"] >= 10, st  # the repeat and copy prompts were drafted for
    assert st["draft_accepted"] <= st["draft_tokens"]
    assert st["kv_blocks_used"] == 0
    for p, a, b in zip(params[:3], plain[:3], spec[:3], strict=True):
        _assert_same_greedy(smollm_int4, p, a.ids, b.ids)
        assert b.finish == a.finish
    assert spec[1].text == "The capital of France is Paris."
    assert spec[0].text.startswith(PARA[:60]), spec[0].text
    # one token per event, as without speculation: a chunk per token on the wire
    assert all(len(e.token_ids) == 1 for s in spec for e in s.events[:-1])
    assert [e.ttft_s is not None for e in spec[0].events[:2]] == [True, False]
    assert spec[3].finish in ("stop", "length") and spec[3].ids


def test_sampled_streams_do_not_speculate(smollm_int4):
    e = _engine(smollm_int4, 8)
    try:
        s = run(e, [chat(smollm_int4, REPEAT, temperature=0.7, seed=1, max_new_tokens=24)])[0]
        assert s.ids and e.stats()["draft_tokens"] == 0
    finally:
        e.shutdown()


def test_length_stop_string_and_resume_end_where_plain_greedy_does(smollm_int4, plain_and_spec):
    params, out = plain_and_spec
    full = out[0][0][0]  # the repeat prompt without speculation
    assert len(full.ids) >= 30
    e = _engine(smollm_int4, 8)
    try:
        base = params[0]
        n = 21
        cut = run(e, [GenerateParams(base.prompt_ids, max_new_tokens=n)])[0]
        assert cut.finish == "length" and cut.ids == full.ids[:n]
        assert full.text.startswith(cut.text)
        stop = "lit the great lamp"
        assert stop in full.text
        s = run(e, [GenerateParams(base.prompt_ids, max_new_tokens=64, stop=[stop])])[0]
        assert s.finish == "stop" and s.text == full.text[: full.text.index(stop)]
        done = full.ids[:9]
        r = run(e, [GenerateParams(base.prompt_ids, max_new_tokens=64, resume_ids=done)])[0]
        assert done + r.ids == full.ids and r.finish == full.finish
        assert full.text.endswith(r.text) and r.text
        st = e.stats()
        assert st["draft_accepted"] > 0 and st["kv_blocks_used"] == 0
    finally:
        e.shutdown()


def test_prefix_blocks_filled_by_speculation_hold_the_accepted_tokens(smollm_int4):
    e = _engine(smollm_int4, 8)
    try:
        p = chat(smollm_int4, REPEAT, max_new_tokens=64)
        first = run(e, [p])[0]
        assert e.stats()["draft_accepted"] > 0
        # a new prompt made of that prompt and most of its output: the blocks the speculative
        # steps filled are reused, and what follows them is still the model's greedy choice
        ids = p.prompt_ids + first.ids[:40]
        hits = e.stats()["prefix_hit_tokens"]
        nxt = run(e, [GenerateParams(ids, max_new_tokens=8)])[0]
        block = e.block_size
        assert e.stats()["prefix_hit_tokens"] - hits == (len(ids) - 1) // block * block
        assert (len(ids) - 1) // block * block > len(p.prompt_ids)  # beyond the prompt's blocks
        plain = first.ids[40:48]
        _assert_same_greedy(smollm_int4, GenerateParams(ids), plain[: len(nxt.ids)], nxt.ids)
    finally:
        e.shutdown()


def test_cancel_during_speculation_frees_blocks(smollm_int4):
    e = _engine(smollm_int4, 8)
    try:
        s = Stream()
        e.submit("long", chat(smollm_int4, REPEAT, max_new_tokens=200), s)
        wait_for(lambda: len(s.events) >= 3)
        e.cancel("long")
        assert s.wait().finish in ("cancelled", "stop")  # it may have ended first
        assert e.stats()["kv_blocks_used"] == 0 and e.stats()["running"] == 0
    finally:
        e.shutdown()


def test_speculate_lookup_below_zero_is_refused(smollm_int4):
    with pytest.raises(ValueError, match="speculate_lookup"):
        Engine(smollm_int4, speculate_lookup=-1)


def test_serve_refuses_speculate_lookup_below_zero_before_loading() -> None:
    from tests.test_cli_errors import assert_clear, meshlm

    r = meshlm("serve", "--port", "0", "--speculate-lookup", "-1")
    assert_clear(r, 2, "--speculate-lookup", "at least 0")
