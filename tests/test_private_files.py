"""Private files (mesh_common/private_files.py): the mesh CA's root, the join tokens, the admin
token
and a sidecar's credentials are 0600 files in 0700 dirs whatever the umask, never read or
written through a symlink, and a dir others can enter is refused with the fix in the message."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from mesh_common.private_files import PrivateFileError, read_private, write_private
from sidecar.identity import CREDENTIALS_FILE, Credentials, IdentityAgent
from tests.test_identity_support import mode, short_dir
from xds_server.admin import token as admin_token
from xds_server.identity.ca import MeshCA
from xds_server.identity.workload import JoinTokens


@pytest.fixture
def umask_0277() -> Iterator[None]:
    """A umask that takes the owner's write bit and everyone else's bits away."""
    old = os.umask(0o277)
    try:
        yield
    finally:
        os.umask(old)


def test_modes_are_exact_whatever_the_umask(tmp_path, monkeypatch, umask_0277) -> None:
    state = tmp_path / "identity"
    MeshCA(state_dir=state)
    JoinTokens(state / "join_tokens.json").issue("default/caller")
    assert mode(state) == 0o700
    assert mode(state / "ca.json") == mode(state / "join_tokens.json") == 0o600
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    path = admin_token.write_token(18001, "t" * 43)
    assert (mode(path.parent), mode(path)) == (0o700, 0o600)


def test_a_symlinked_state_file_is_refused_and_a_planted_one_replaced(tmp_path) -> None:
    state, elsewhere = tmp_path / "identity", tmp_path / "elsewhere"
    MeshCA(state_dir=elsewhere)  # a CA state file of another control plane
    state.mkdir(mode=0o700)
    (state / "ca.json").symlink_to(elsewhere / "ca.json")
    with pytest.raises(PrivateFileError, match=r"ca\.json is a symlink; refusing to read CA keys"):
        MeshCA(state_dir=state)
    (state / "join_tokens.json").symlink_to(elsewhere / "ca.json")
    with pytest.raises(PrivateFileError, match=r"join_tokens\.json is a symlink"):
        JoinTokens(state / "join_tokens.json")

    (state / "ca.json").unlink()
    (state / "join_tokens.json").unlink()
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    (state / "ca.json").symlink_to(victim)
    write_private(state / "ca.json", b"{}", "CA keys")  # replaces the link, never follows it
    assert victim.read_text() == "victim\n" and not (state / "ca.json").is_symlink()
    assert read_private(state / "ca.json", "CA keys") == b"{}"


def test_a_symlinked_or_open_private_dir_is_refused(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(PrivateFileError, match=r"link is a symlink; refusing to keep CA keys"):
        MeshCA(state_dir=link)
    with pytest.raises(ValueError, match=r"is a symlink; refusing to keep a private key there"):
        IdentityAgent(link)
    real.chmod(0o755)
    with pytest.raises(PrivateFileError, match=r"has mode 0755, not 0700 \(chmod 700 .*real\)"):
        MeshCA(state_dir=real)
    with pytest.raises(ValueError, match=r"has mode 0755, not 0700 \(chmod 700 "):
        IdentityAgent(real)
    assert list(real.iterdir()) == []


def test_a_sidecar_does_not_boot_from_symlinked_credentials(tmp_path) -> None:
    d, events = short_dir(), []
    try:
        # Whoever can plant a link there could as well plant the file: still, never follow it.
        elsewhere = tmp_path / CREDENTIALS_FILE
        now = time.time()
        cred = Credentials("k", ["c"], ["r"], "spiffe://x/ns/a/sa/b", now + 600, now, {})
        elsewhere.write_text(json.dumps(asdict(cred)))
        (d / CREDENTIALS_FILE).symlink_to(elsewhere)
        agent = IdentityAgent(d, on_event=events.append).start()
        agent.stop()
        assert agent.current is None
        assert any(f"{CREDENTIALS_FILE} unreadable (PrivateFileError)" in e for e in events)
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
