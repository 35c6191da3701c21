"""The codec: round trips, the verifier against hand-made bad buffers, value checks by field."""

from __future__ import annotations

import importlib.util
import re
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from schemas import codec as c
from schemas.meshlm import inference_generated as fb
from schemas.verify import Table, verify
from tests.fuzz import codec as fuzz

LIMITS = c.Limits(context_length=2048, vocab_size=49152)


def _req(**kw) -> bytes:
    return c.encode_generate_request(c.GenerateRequest(**kw))


def _field_error(buf: bytes) -> str:
    with pytest.raises(c.WireError) as e:
        c.decode_generate_request(buf, LIMITS)
    return e.value.field


def test_generate_request_round_trip_all_fields() -> None:
    req = c.GenerateRequest(
        request_id="req-1",
        model="smollm2",
        prompt="What is the capital of France? ✓",
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        seed=2**64 - 1,
        stop=["\n", "END"],
        priority=-5,
    )
    got = c.decode_generate_request(c.encode_generate_request(req), LIMITS)
    assert got == req


def test_generate_request_defaults_and_token_ids_are_zero_copy_numpy() -> None:
    buf = _req(prompt_token_ids=[1, 2, 49151])
    got = c.decode_generate_request(buf, LIMITS)
    assert got.prompt_token_ids.dtype == np.int32
    assert got.prompt_token_ids.tolist() == [1, 2, 49151]
    assert not got.prompt_token_ids.flags.owndata  # a view of the received buffer
    assert (got.max_new_tokens, got.temperature, got.top_p, got.top_k) == (128, 0.0, 1.0, 0)
    assert got.seed is None and got.priority is None and got.stop == []


def test_chat_messages_round_trip() -> None:
    msgs = [c.ChatMessage("system", "be brief"), c.ChatMessage("user", "hi")]
    got = c.decode_generate_request(_req(messages=msgs), LIMITS)
    assert got.messages == msgs and got.prompt is None


@pytest.mark.parametrize(
    "args",
    [
        ("r1", 3, [42], " Paris", None, 120, 5000),
        ("", 0, [], "", "stop", 0, None),
        ("réq", 9, [1, 2, 3], "héllo\x00x", "length", 2**63, 0),
        ("r", 1, [7], "x", "cancelled", 1, 2),
    ],
)
def test_token_chunk_fast_layout_reads_like_the_builder_one(args) -> None:
    fast, slow = c.encode_token_chunk(*args), c.encode_token_chunk_builder(*args)
    a, b = c.decode_token_chunk(fast), c.decode_token_chunk(slow)
    assert repr(a) == repr(b)
    assert (a.request_id, a.index, a.token_ids.tolist(), a.text_delta, a.finish_reason) == args[:5]
    # and the flatc-generated reader agrees on the fast layout
    t = fb.TokenChunk.GetRootAs(fast, 0)
    assert t.Index() == args[1] and t.TtftUs() == args[6] and t.Error() is None


def test_token_chunk_with_error_table() -> None:
    err = c.ErrorInfo(13, "engine failed", "prompt")
    got = c.decode_token_chunk(c.encode_token_chunk("r", 5, [], "", "error", 9, None, err))
    assert got.finish_reason == "error" and got.error == err


def test_model_info_and_info_request_round_trip() -> None:
    info = c.ModelInfo("SmolLM2-135M-Instruct", "int4", "q4_1", 8192, 49152)
    assert c.decode_model_info(c.encode_model_info(info)) == info
    assert info.compute_dtype == info.compute == info.kernels == ""  # unknown unless set
    info = c.ModelInfo(*INFO_BASE, compute_dtype="fp32", compute=COMPUTE, kernels="native+torch")
    assert c.decode_model_info(c.encode_model_info(info)) == info
    c.decode_info_request(c.encode_info_request())


# --- ModelInfo across versions: the compute fields (issue 13) appended to the table ----------

INFO_BASE = ("SmolLM2-135M-Instruct", "bf16", "SmolLM2@ab12:bf16", 8192, 49152)
COMPUTE = "bf16 weights computed in fp32 (the CPU has neither avx512_bf16 nor amx_bf16: ✓)"
COMPUTE_FIELDS = ("compute_dtype", "compute", "kernels")


@pytest.fixture(scope="module")
def old_fb(tmp_path_factory):
    """The generated module of inference.fbs as it was before the compute fields, made by the
    pinned flatc the way `python -m schemas.build` makes the committed one."""
    from schemas import build

    text = (Path(c.__file__).parent / "inference.fbs").read_text()
    old = re.sub(rf"\n\s*({'|'.join(COMPUTE_FIELDS)}): string;[^\n]*", "", text)
    assert old.count("\n") == text.count("\n") - len(COMPUTE_FIELDS)
    d = tmp_path_factory.mktemp("old_schema")
    (d / "inference.fbs").write_text(old)
    cmd = [build.flatc(), "--python", "--gen-onefile", "--python-gen-numpy", "-o", str(d)]
    subprocess.run([*cmd, str(d / "inference.fbs")], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("old_inference", d / "inference_generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not hasattr(module, "ModelInfoAddCompute") and hasattr(module, "ModelInfoAddVocabSize")
    return module


def test_an_older_client_reads_a_new_servers_model_info(old_fb) -> None:
    """What the previous decode_model_info did: verify the five fields it knew, read them."""
    info = c.ModelInfo(*INFO_BASE, compute_dtype="fp32", compute=COMPUTE, kernels="torch")
    buf = c.encode_model_info(info)
    verify(buf, Table("ModelInfo", c.MODEL_INFO.fields[:5]), 1 << 16)
    t = old_fb.ModelInfo.GetRootAs(buf, 0)
    got = (t.Name(), t.Precision(), t.Version(), t.ContextLength(), t.VocabSize())
    assert got == (*(s.encode() for s in INFO_BASE[:3]), *INFO_BASE[3:])


def test_a_new_client_reads_an_older_servers_model_info(old_fb) -> None:
    """The previous encode_model_info's buffer (no compute fields): they read as unknown."""
    import flatbuffers

    b = flatbuffers.Builder(0)
    name, precision, version = (b.CreateString(s) for s in INFO_BASE[:3])
    old_fb.ModelInfoStart(b)
    old_fb.ModelInfoAddName(b, name)
    old_fb.ModelInfoAddPrecision(b, precision)
    old_fb.ModelInfoAddVersion(b, version)
    old_fb.ModelInfoAddContextLength(b, INFO_BASE[3])
    old_fb.ModelInfoAddVocabSize(b, INFO_BASE[4])
    b.Finish(old_fb.ModelInfoEnd(b))
    buf = bytes(b.Output())
    assert c.decode_model_info(buf) == c.ModelInfo(*INFO_BASE)
    assert c.encode_model_info(c.ModelInfo(*INFO_BASE)) == buf  # absent fields: the old bytes


@pytest.mark.parametrize("name", COMPUTE_FIELDS)
def test_the_compute_fields_are_verified_as_strings(name) -> None:
    buf = c.encode_model_info(c.ModelInfo(*INFO_BASE, **{name: "abc"}))
    at = buf.index(b"abc\0")
    broken = {
        "not valid UTF-8": buf[:at] + b"a\xffc" + buf[at + 3 :],
        "not zero-terminated": buf[: at + 3] + b"\x01" + buf[at + 4 :],
        "runs past the buffer": buf[: at - 4] + struct.pack("<I", len(buf)) + buf[at:],
    }
    for why, bad in broken.items():
        with pytest.raises(c.WireError, match=why) as e:
            c.decode_model_info(bad)
        assert e.value.field == name


def test_verifier_spec_matches_the_fbs_slot_order() -> None:
    """The verifier's tables list fields in the .fbs order, with matching kinds."""
    text = (Path(c.__file__).parent / "inference.fbs").read_text()
    kinds = {"string": "string", "[int32]": "vector", "[string]": "strings"}
    for spec in (c.GENERATE_REQUEST, c.TOKEN_CHUNK, c.CHAT_MESSAGE, c.ERROR, c.MODEL_INFO):
        body = re.search(rf"table {spec.name} \{{(.*?)\n\}}", text, re.S).group(1)
        decl = re.findall(r"^\s*(\w+): ([\w\[\]]+)", body, re.M)
        assert [name for name, _ in decl] == [f.name for f in spec.fields], spec.name
        for (_, typ), f in zip(decl, spec.fields, strict=True):
            want = kinds.get(typ, "tables" if typ.startswith("[") else None)
            if want is None:
                want = "table" if typ[0].isupper() and typ != "FinishReason" else "scalar"
            assert f.kind == want, (spec.name, f.name, typ)


# --- malformed buffers: the verifier names the place ---------------------------------------


def test_empty_and_tiny_buffers() -> None:
    assert _field_error(b"") == "GenerateRequest"
    assert _field_error(b"\x04\x00\x00\x00") == "GenerateRequest"


def test_root_offset_past_the_end() -> None:
    buf = bytearray(_req(prompt="hello"))
    buf[0:4] = struct.pack("<I", len(buf) + 100)
    assert _field_error(bytes(buf)) == "GenerateRequest"


def test_vtable_offset_outside_buffer() -> None:
    buf = bytearray(_req(prompt="hello"))
    root = struct.unpack_from("<I", buf, 0)[0]
    buf[root : root + 4] = struct.pack("<i", -(2**30))
    assert _field_error(bytes(buf)) == "GenerateRequest"


def test_string_length_past_the_end_names_the_field() -> None:
    buf = bytearray(_req(prompt="hello world"))
    i = bytes(buf).index(b"hello world") - 4
    buf[i : i + 4] = struct.pack("<I", 10_000)
    assert _field_error(bytes(buf)) == "prompt"


def test_invalid_utf8_names_the_field() -> None:
    buf = bytearray(_req(prompt="hello world"))
    i = bytes(buf).index(b"hello")
    buf[i] = 0xFF
    assert _field_error(bytes(buf)) == "prompt"


def test_missing_terminator_names_the_field() -> None:
    buf = bytearray(_req(request_id="abcd", prompt="x"))
    i = bytes(buf).index(b"abcd")
    buf[i + 4] = ord("!")
    assert _field_error(bytes(buf)) == "request_id"


def test_missing_required_chat_role() -> None:
    b = fb.flatbuffers.Builder(64)
    content = b.CreateString("hi")
    fb.ChatMessageStart(b)
    fb.ChatMessageAddContent(b, content)
    m = fb.ChatMessageEnd(b)
    fb.GenerateRequestStartMessagesVector(b, 1)
    b.PrependUOffsetTRelative(m)
    v = b.EndVector()
    fb.GenerateRequestStart(b)
    fb.GenerateRequestAddMessages(b, v)
    b.Finish(fb.GenerateRequestEnd(b))
    assert _field_error(bytes(b.Output())) == "messages[0].role"


def test_token_chunk_unknown_finish_reason() -> None:
    buf = bytearray(c.encode_token_chunk("r", 1, [5], "x", "stop"))
    buf[68] = 99  # finish_reason byte of the fast layout
    with pytest.raises(c.WireError) as e:
        c.decode_token_chunk(bytes(buf))
    assert e.value.field == "finish_reason"


def test_oversized_buffer_is_refused_before_parsing() -> None:
    with pytest.raises(c.WireError, match="exceeds the limit"):
        c.decode_generate_request(b"\0" * (LIMITS.max_buffer_bytes + 1), LIMITS)


# --- value checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [c.ChatMessage("user", "b")]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * (300 << 10)}, "prompt"),
        ({"prompt_token_ids": [1, 49152]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 3000}, "prompt_token_ids"),
        ({"messages": []}, "messages"),
        ({"messages": [c.ChatMessage("root", "x")]}, "messages[0].role"),
        ({"messages": [c.ChatMessage("user", "x")] * 300}, "messages"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 4096}, "max_new_tokens"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "temperature": 1e-30}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_k": 50000}, "top_k"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "x", "stop": ["ok", ""]}, "stop[1]"),
        ({"prompt": "x", "priority": 5000}, "priority"),
        ({"prompt": "x", "request_id": "r" * 300}, "request_id"),
        ({"prompt": "x", "resume_token_ids": [5, 49152]}, "resume_token_ids"),
        ({"prompt": "x", "resume_token_ids": [-2]}, "resume_token_ids"),
        ({"prompt": "x", "max_new_tokens": 2, "resume_token_ids": [5] * 3}, "resume_token_ids"),
        (
            {
                "prompt_token_ids": [1] * 1000,
                "max_new_tokens": 2000,
                "resume_token_ids": [5] * 1048,
            },
            "resume_token_ids",
        ),
        (
            {"prompt": "x", "max_new_tokens": 2000, "resume_token_ids": [5] * 2047},
            "resume_token_ids",
        ),
        ({"prompt": "x", "resume_token_ids": [5] * 3000}, "resume_token_ids"),
        ({"prompt": "x", "avoid_replica": "r" * 300}, "avoid_replica"),
    ],
)
def test_value_checks_name_the_field(kw, field) -> None:
    assert _field_error(_req(**kw)) == field


def test_resume_fields_round_trip_and_stay_absent_by_default() -> None:
    req = c.GenerateRequest(
        prompt_token_ids=[1, 2],
        max_new_tokens=9,
        resume_token_ids=[7, 49151, 0],
        resume_index=3,
        avoid_replica="10.0.0.7:50051",
    )
    got = c.decode_generate_request(c.encode_generate_request(req), LIMITS)
    assert got.resume_token_ids.tolist() == [7, 49151, 0] and got.resume_index == 3
    assert got.avoid_replica == "10.0.0.7:50051"
    # Exactly max_new_tokens already delivered is a stream that only needs its final chunk.
    full = c.GenerateRequest(prompt="x", max_new_tokens=3, resume_token_ids=[1, 2, 3])
    assert c.decode_generate_request(c.encode_generate_request(full), LIMITS).max_new_tokens == 3
    plain = c.decode_generate_request(_req(prompt="x"), LIMITS)
    assert (plain.resume_token_ids, plain.resume_index, plain.avoid_replica) == (None, 0, "")


def test_resume_count_is_refused_before_the_ids_are_read() -> None:
    buf = _req(prompt="x", resume_token_ids=[5] * 3000)
    with pytest.raises(c.WireError, match=r"^resume_token_ids: 3000 elements exceed the limit"):
        c.decode_generate_request(buf, LIMITS)


# --- aliased offsets (issue 9, defect 1): bounded work whatever the buffer references --------

ALIASING = [s for s in fuzz.ALIASED if s != "wide"]


@pytest.mark.parametrize("shape", ALIASING)
def test_aliased_offsets_are_refused_with_memory_bounded_by_the_buffer(shape) -> None:
    buf = fuzz.aliased(shape, 1 << 16)
    tracemalloc.start()
    try:
        with pytest.raises(c.WireError) as e:
            c.decode_generate_request(buf, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.field.split("[")[0] in ("stop", "messages"), e.value
    # Each alias used to be copied again: 4000x the buffer for "stop", 17x for "stop16".
    assert peak < 2 * len(buf), f"{shape}: {peak} bytes allocated for a {len(buf)}-byte buffer"


def test_count_limits_are_checked_before_the_elements() -> None:
    with pytest.raises(c.WireError, match=r"^stop: 5461 elements exceed the limit of 16$"):
        c.decode_generate_request(fuzz.aliased("wide", 1 << 16), LIMITS)
    with pytest.raises(c.WireError, match=r"^messages: 4000 elements exceed the limit of 256$"):
        c.decode_generate_request(fuzz.aliased("table", 1 << 16), LIMITS)


def test_verifier_budget_refuses_aliases_without_count_limits() -> None:
    buf = fuzz.aliased("stop", 1 << 16)  # 8192 offsets to one 32 KiB string
    with pytest.raises(c.WireError, match="alias the same data too often") as e:
        verify(buf, c.GENERATE_REQUEST, len(buf))
    assert re.fullmatch(r"stop\[\d\]", e.value.field)  # after a few aliases, not thousands


def test_shared_strings_and_vtables_of_a_normal_builder_pass_the_budget() -> None:
    # flatbuffers dedups vtables, and CreateSharedString aliases on purpose: 256 messages that
    # share their role and content must still decode.
    b = fb.flatbuffers.Builder(1024)
    msgs = []
    for _ in range(LIMITS.max_messages):
        role, content = b.CreateSharedString("user"), b.CreateSharedString("hi")
        fb.ChatMessageStart(b)
        fb.ChatMessageAddRole(b, role)
        fb.ChatMessageAddContent(b, content)
        msgs.append(fb.ChatMessageEnd(b))
    vec = c._offset_vector(b, msgs)
    stop = c._offset_vector(b, [b.CreateSharedString("\n")] * LIMITS.max_stop)
    fb.GenerateRequestStart(b)
    fb.GenerateRequestAddMessages(b, vec)
    fb.GenerateRequestAddStop(b, stop)
    b.Finish(fb.GenerateRequestEnd(b))
    got = c.decode_generate_request(bytes(b.Output()), LIMITS)
    assert len(got.messages) == 256 and got.stop == ["\n"] * 16


# Decodes under an address-space limit a little above what the process already holds (set after
# the imports): what escapes the decoder is printed as "<type> <field>".
_UNDER_RLIMIT = """
import resource, sys
from schemas import codec as c
from tests.fuzz import codec as fuzz
buf = fuzz.aliased(sys.argv[1]) if sys.argv[1] in fuzz.ALIASED else c.encode_generate_request(
    c.GenerateRequest(prompt="y" * (int(sys.argv[1]) << 20)))
with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * resource.getpagesize()
extra = int(sys.argv[2]) << 20
resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))
try:
    c.decode_generate_request(buf)
    print("accepted")
except Exception as e:
    print(type(e).__name__, getattr(e, "field", ""))
"""


def _decode_under_rlimit(what: str, extra_mib: int) -> str:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _UNDER_RLIMIT, what, str(extra_mib)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_one_mib_aliased_stop_vector_is_a_wire_error_in_256_mib() -> None:
    # It used to ask for 64 GiB and, under this limit, raise MemoryError out of the codec.
    assert _decode_under_rlimit("stop", 256) == "WireError stop"


def test_memory_error_inside_the_decoder_becomes_a_wire_error() -> None:
    # A valid 3 MiB prompt with no memory left to copy it: refused, not crashed.
    assert _decode_under_rlimit("3", 1) == "WireError GenerateRequest"
