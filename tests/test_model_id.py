"""The default OpenAI model id (issue 37): a slug of the weight file's or folder's name that a
user can type, never the metadata's spaced name. The served runtime's listing of it:
tests/test_openai_http.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_runtime.loading.loader import model_id


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct.q4_1"),
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf.sealed", "smollm2-135m-instruct.q4_1"),
        ("/m/My Model (v2)!", "my-model-v2"),  # a safetensors folder
        ("/m/--.gguf", "model"),  # nothing left to name it by
    ],
)
def test_the_default_id_is_a_slug_of_the_file_name(path: str, want: str) -> None:
    got = model_id(Path(path))
    assert got == want and " " not in got and got == got.lower()


def test_the_default_model_is_listed_by_its_slug(smollm_int4) -> None:
    assert smollm_int4.info.model_id == "smollm2-135m-instruct.q4_1"
    assert smollm_int4.info.name != smollm_int4.info.model_id  # the metadata's name has spaces
