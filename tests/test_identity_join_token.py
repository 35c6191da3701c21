"""The join token file carries the mesh CA's roots (issue 14): `meshlm identity token` writes
them beside their pins, the agent checks each root against its pin and then trusts the CA port
by those roots alone. An altered file, one for another CA and one an older meshlm wrote are
refused with a message naming the field, and none of them uses the token up."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh_common.private_files import write_private
from sidecar.identity import IdentityAgent
from tests.test_identity_support import identity_mesh, join_token_file, short_dir
from xds_server.compose import build_server
from xds_server.identity.ca import MeshCA, pem
from xds_server.server import XdsServer

CALLER = "spiffe://meshlm.local/ns/default/sa/caller"


@pytest.fixture(scope="module")
def cp() -> Iterator[XdsServer]:
    with build_server(identity_mesh("127.0.0.1:1")) as cp:
        yield cp


@pytest.fixture
def where() -> Iterator[Path]:
    d = short_dir()
    yield d
    shutil.rmtree(d)


def _first_event(token_file: Path, where: Path) -> tuple[IdentityAgent, str]:
    """Start an agent on `token_file`; its first event (a certificate or why not)."""
    events: list[str] = []
    got = threading.Event()

    def on_event(msg: str) -> None:
        events.append(msg)
        got.set()

    agent = IdentityAgent(where / "sc", join_token_file=token_file, on_event=on_event).start()
    try:
        assert got.wait(15), "no event from the identity agent"
    finally:
        agent.stop()
    return agent, events[0]


def _rewrite(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc["ca"])
    write_private(path, json.dumps(doc).encode(), "a join token")


def test_the_token_file_carries_the_roots_the_agent_trusts(cp, where) -> None:
    path = join_token_file(cp, "default/caller", where)
    ca = json.loads(path.read_text())["ca"]
    assert ca["roots"] == [pem(c) for c in cp.identity.ca.trust_bundle()]
    assert ca["root_sha256"] == cp.identity.ca.pins()
    agent, event = _first_event(path, where)
    assert agent.spiffe_id == CALLER and "issued" in event


def test_an_altered_foreign_or_old_token_file_is_refused_and_the_token_kept(cp, where) -> None:
    rogue = MeshCA()
    path = join_token_file(cp, "default/caller", where)
    original = path.read_bytes()

    _rewrite(path, lambda ca: ca.update(roots=[pem(rogue.trust_bundle()[0])]))
    agent, event = _first_event(path, where)
    assert agent.current is None
    assert "ca.roots[0] matches no pin of ca.root_sha256 (the file was altered" in event

    _rewrite(path, lambda ca: ca.update(root_sha256=rogue.pins()))  # another CA's, consistent
    agent, event = _first_event(path, where)
    assert agent.current is None
    assert f"CA at {cp.identity.ca_address}: UNAVAILABLE" in event

    _rewrite(path, lambda ca: ca.pop("roots"))
    agent, event = _first_event(path, where)
    assert agent.current is None
    assert "no ca.roots (an older meshlm wrote it): get a new one with `meshlm identity" in event

    write_private(path, original, "a join token")
    agent, event = _first_event(path, where)  # none of the refusals used the token up
    assert agent.spiffe_id == CALLER and "issued" in event
