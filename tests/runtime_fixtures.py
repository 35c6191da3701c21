"""Session-wide SmolLM2 models for the runtime tests.

Import the fixture into a test module (`from tests.runtime_fixtures import smollm_int4  # noqa:
F401`). pytest makes one fixture per importing module, so the loads are cached here: every module
shares one model per precision. Tests must not modify these models (load their own instead).
"""

from __future__ import annotations

import functools

import pytest

from model_runtime.loader import LoadedModel, load


@functools.cache
def cached_model(precision: str) -> LoadedModel:
    return load(precision=precision)


@pytest.fixture(scope="session")
def smollm_int4() -> LoadedModel:
    return cached_model("int4")


@pytest.fixture(scope="session")
def smollm_bf16() -> LoadedModel:
    return cached_model("bf16")
