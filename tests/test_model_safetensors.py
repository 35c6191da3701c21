"""A tiny random Llama checkpoint in HF layout (safetensors + config + tokenizer.json) loads and
gives the logits of an independent reference forward (half-split RoPE, as HF computes it)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers

from model_runtime.loading.loader import load
from model_runtime.loading.safetensors_loader import read_safetensors

CFG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 40,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[t.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def random_checkpoint(gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, hd = CFG["hidden_size"], CFG["hidden_size"] // CFG["num_attention_heads"]
    kvd, ff, v = CFG["num_key_value_heads"] * hd, CFG["intermediate_size"], CFG["vocab_size"]

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=gen) * scale

    w = {"model.embed_tokens.weight": r(v, d, scale=1.0), "model.norm.weight": 1 + r(d)}
    w["lm_head.weight"] = r(v, d)
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": r(d, d),
            p + "self_attn.k_proj.weight": r(kvd, d),
            p + "self_attn.v_proj.weight": r(kvd, d),
            p + "self_attn.o_proj.weight": r(d, d),
            p + "mlp.gate_proj.weight": r(ff, d),
            p + "mlp.up_proj.weight": r(ff, d),
            p + "mlp.down_proj.weight": r(d, ff),
            p + "input_layernorm.weight": 1 + r(d),
            p + "post_attention_layernorm.weight": 1 + r(d),
        }
    return w


def reference_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """HF Llama in float64: rotate_half RoPE over the two halves of each head."""
    w = {k: t.double() for k, t in w.items()}
    nh, nkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    hd, T = CFG["hidden_size"] // nh, len(ids)
    inv = 1.0 / (CFG["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):  # [H, T, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG["rms_norm_eps"]) * g

    h = w["model.embed_tokens.weight"][ids]
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        h = h + y.transpose(0, 1).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + gate @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    weights = random_checkpoint(torch.Generator().manual_seed(0))
    # two shards, one in bf16, as real checkpoints come
    names = sorted(weights)
    write_safetensors(folder / "model-00001.safetensors", {n: weights[n] for n in names[:10]})
    write_safetensors(
        folder / "model-00002.safetensors", {n: weights[n].bfloat16() for n in names[10:]}
    )
    weights |= {n: weights[n].bfloat16().float() for n in names[10:]}
    (folder / "config.json").write_text(json.dumps(CFG))
    vocab = {"<unk>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, CFG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder, weights


def test_reader_round_trips_dtypes(tmp_path):
    t = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4).bfloat16()}
    write_safetensors(tmp_path / "x.safetensors", t)
    back = read_safetensors(tmp_path / "x.safetensors")
    assert torch.equal(back["a"], t["a"]) and torch.equal(back["b"], t["b"].float())
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="exceeds the file"):
        read_safetensors(tmp_path / "bad.safetensors")


def test_fp32_logits_match_reference(checkpoint):
    folder, weights = checkpoint
    lm = load(str(folder), precision="fp32")
    assert lm.info.context_length == 128 and lm.tokenizer.eos_id == 1
    ids = lm.tokenizer.encode("w5 w7 w9 w11 w2 w3 w30 w31 w8")
    assert len(ids) == 9
    got = lm.model(torch.tensor([ids]), all_logits=True)[0]
    want = reference_logits(weights, ids).float()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(("precision", "tol"), [("bf16", 0.1), ("int4", 0.5)])
def test_16bit_and_int4_stay_close(checkpoint, precision, tol):
    folder, weights = checkpoint
    lm = load(str(folder), precision=precision)
    ids = list(range(2, 14))
    got = lm.model(torch.tensor([ids]), all_logits=True)[0]
    want = reference_logits(weights, ids).float()
    assert (got - want).abs().max() < tol * want.abs().max()
    assert precision in lm.info.version


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load(str(tmp_path))
