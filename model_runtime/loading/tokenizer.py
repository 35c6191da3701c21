"""Byte-level BPE tokenizer rebuilt from GGUF metadata (or loaded from tokenizer.json), ChatML
chat template, and an incremental detokenizer that never splits a UTF-8 character."""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_DEFAULT_SYSTEM = re.compile(r"'<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        bos_id: int | None,
        eos_id: int,
        stop_ids: set[int],
        default_system: str | None = None,
    ):
        self._tok = tok
        self.bos_id, self.eos_id = bos_id, eos_id
        self.stop_ids = set(stop_ids) | {eos_id}
        self.default_system = default_system
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (only gpt2 BPE)")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        # SmolLM ("smollm" pre-tokenizer): digits split one by one, then GPT-2 byte-level regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]  # control, user-def
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        stop = {eos} | ({vocab["<|endoftext|>"]} if "<|endoftext|>" in vocab else set())
        m = _DEFAULT_SYSTEM.search(str(meta.get("tokenizer.chat_template", "")))
        return cls(tok, None if bos is None else int(bos), eos, stop, m.group(1) if m else None)

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str | None = None) -> Tokenizer:
        tok = HFTokenizer.from_file(str(path))
        vocab = tok.get_vocab()
        names = [eos_token] if eos_token else []
        names += ["<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>"]
        found = [vocab[n] for n in names if n and n in vocab]
        if not found:
            raise ValueError(f"{path}: no end-of-sequence token found")
        bos = next((vocab[n] for n in ("<s>", "<|begin_of_text|>") if n in vocab), None)
        return cls(tok, bos, found[0], set(found))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """ChatML, as SmolLM2's template: a default system turn when the first is not one."""
        out = []
        if self.default_system and (not messages or messages[0].get("role") != "system"):
            out.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role or not isinstance(content, str):
                raise ValueError(f"messages[{i}]: role and content must be strings")
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Text deltas for a token stream; holds back bytes until they form whole characters."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # decode window start (keeps byte-level merges across tokens right)
        self._read = 0  # tokens already turned into emitted text

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
