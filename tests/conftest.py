"""Shared fixtures. Every process a test starts is stopped, on failure too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar import envoy_process


@pytest.fixture(autouse=True, scope="session")
def _no_orphan_envoys() -> Iterator[None]:
    yield
    envoy_process._stop_all()


# The real SmolLM2, loaded once per precision for the whole run. Tests must not modify it.
@pytest.fixture(scope="session")
def smollm_int4():
    from tests.runtime_fixtures import cached_model  # torch only for tests that use the model

    return cached_model("int4")


@pytest.fixture(scope="session")
def smollm_bf16():
    from tests.runtime_fixtures import cached_model

    return cached_model("bf16")
