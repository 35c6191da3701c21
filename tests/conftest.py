"""Shared fixtures. Every process a test starts is stopped, on failure too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar import envoy_process


@pytest.fixture(autouse=True, scope="session")
def _no_orphan_envoys() -> Iterator[None]:
    yield
    envoy_process._stop_all()
