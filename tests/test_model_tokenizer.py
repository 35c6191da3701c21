"""The tokenizer rebuilt from GGUF metadata: round trips, chat template, streaming deltas."""

from __future__ import annotations

import pytest

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "Numbers 1234567890 and 3.14159",
    "Unicode: café, naïve, Straße, 東京, Ελληνικά, emoji 🦙🔥👍🏽",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def tok(smollm_int4):
    return smollm_int4.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_known_ids(tok):
    assert tok.encode("<|im_start|>user") == [1, 4093]  # special token kept whole
    assert tok.encode("123") == tok.encode("1") + tok.encode("2") + tok.encode("3")  # digit-wise
    assert tok.eos_id == 2 and {0, 2} <= tok.stop_ids


def test_chat_template_chatml_with_default_system(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}], False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n"
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"role": "user", "content": 3}])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(tok, text):
    ids = tok.encode(text)
    d = tok.detokenizer()
    deltas = [d.push([i]) for i in ids]
    for delta in deltas:
        assert "\ufffd" not in delta  # never half a character
    assert "".join(deltas) + d.flush() == text


def test_incremental_detokenizer_holds_split_utf8(tok):
    ids = tok.encode("🦙")
    assert len(ids) > 1  # byte-level tokens, the character spans several
    d = tok.detokenizer()
    assert [d.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🦙"
