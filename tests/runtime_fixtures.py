"""One SmolLM2 per precision for the whole test run (the `smollm_int4` / `smollm_bf16`
fixtures in conftest.py use it). Tests must not modify these models (load their own instead)."""

from __future__ import annotations

import functools

from model_runtime.loader import LoadedModel, load


@functools.cache
def cached_model(precision: str) -> LoadedModel:
    return load(precision=precision)
