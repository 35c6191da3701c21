"""Shared fixtures. Every process a test starts is stopped, on failure too."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from sidecar import envoy_process
from tests.alone_support import RunLock

_RUN_LOCK = pytest.StashKey[RunLock]()


def pytest_configure(config: pytest.Config) -> None:
    # Only an xdist worker (`pytest -n 2`) has workerinput; a plain run has nothing to share.
    if workerinput := getattr(config, "workerinput", None):
        config.stash[_RUN_LOCK] = RunLock(workerinput["testrunuid"])


def pytest_unconfigure(config: pytest.Config) -> None:
    if lock := config.stash.get(_RUN_LOCK, None):
        lock.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Around setup, call and teardown, so module fixtures a test starts or stops count as its
    own: an `alone` test runs while the other worker runs nothing (tests/alone_support.py)."""
    lock = item.config.stash.get(_RUN_LOCK, None)
    if lock is None:
        return (yield)
    with lock.hold(alone=item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture(autouse=True, scope="session")
def _state_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Control planes keep state in $XDG_STATE_HOME/meshlm (meshlm/state_dir.py): the run's own,
    never the user's, for every process a test starts."""
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))


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
