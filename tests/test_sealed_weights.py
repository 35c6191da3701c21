"""Sealed weights: AES-GCM encrypted weight files; wrong keys and tampering are refused."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from model_runtime.engine import generate
from model_runtime.loading import sealed
from model_runtime.loading.gguf_loader import default_gguf_path
from model_runtime.loading.loader import load


@pytest.fixture
def small(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(3000) + b"weights"
    src = tmp_path / "w.bin"
    src.write_bytes(data)
    return src, data


def test_round_trip_in_chunks(small, tmp_path):
    src, data = small
    key = sealed.new_key()
    sealed.seal(src, tmp_path / "w.sealed", key, chunk_size=1024)  # 2 full chunks + 1
    assert sealed.is_sealed(tmp_path / "w.sealed") and not sealed.is_sealed(src)
    assert data not in (tmp_path / "w.sealed").read_bytes()
    assert sealed.unseal_to_memory(tmp_path / "w.sealed", key) == data
    assert not list(tmp_path.glob("*.partial"))


def test_wrong_key_refused(small, tmp_path):
    src, _ = small
    sealed.seal(src, tmp_path / "w.sealed", sealed.new_key())
    with pytest.raises(sealed.SealedError, match="wrong key or tampered"):
        sealed.unseal_to_memory(tmp_path / "w.sealed", sealed.new_key())


@pytest.mark.parametrize("where", ["header", "body", "tag", "truncate", "drop_chunk", "append"])
def test_tampered_file_refused(small, tmp_path, where):
    src, _ = small
    key = sealed.new_key()
    dst = tmp_path / "w.sealed"
    sealed.seal(src, dst, key, chunk_size=1024)
    b = bytearray(dst.read_bytes())
    chunk = 1024 + 16
    if where == "header":
        b[12] ^= 1  # chunk size / nonce prefix are authenticated as associated data
    elif where == "body":
        b[100] ^= 0x80
    elif where == "tag":
        b[-1] ^= 1
    elif where == "truncate":
        del b[-100:]
    elif where == "drop_chunk":  # a whole chunk removed: indices no longer line up
        hdr = sealed._HEADER.size
        del b[hdr + chunk : hdr + 2 * chunk]
    else:
        b += b"\0" * 40
    dst.write_bytes(bytes(b))
    with pytest.raises(sealed.SealedError):
        sealed.unseal_to_memory(dst, key)


def test_keys_from_hex_base64_file_and_env(tmp_path, small):
    key = sealed.new_key()
    assert sealed.parse_key(key.hex()) == key
    assert sealed.parse_key(base64.b64encode(key).decode()) == key
    (tmp_path / "k").write_text(key.hex() + "\n")
    assert sealed.key_from_file(tmp_path / "k") == key
    with pytest.raises(sealed.SealedError, match="32 bytes"):
        sealed.parse_key("abcd")
    with pytest.raises(sealed.SealedError, match="not a sealed weight file"):
        sealed.unseal_to_memory(small[0], key)


def test_not_sealed_error_names_env_when_no_key(tmp_path, small):
    src, _ = small
    sealed.seal(src, tmp_path / "w.sealed", sealed.new_key())
    if not os.environ.get(sealed.KEY_ENV) and not os.environ.get(sealed.KEY_FILE_ENV):
        with pytest.raises(sealed.SealedError, match=sealed.KEY_ENV):
            load(str(tmp_path / "w.sealed"))


def test_sealed_smollm_loads_and_answers(tmp_path):
    key = sealed.new_key()
    dst = tmp_path / "smollm.sealed"
    sealed.seal(default_gguf_path(), dst, key)
    with pytest.raises(sealed.SealedError, match="wrong key"):
        load(str(dst), weight_key=sealed.new_key())
    lm = load(str(dst), precision="int4", weight_key=key)
    assert key.hex() not in repr(lm.info)
    ids = lm.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    )
    out = generate.greedy(lm, [ids], 12)[0]
    assert lm.tokenizer.decode(out) == "The capital of France is Paris."
