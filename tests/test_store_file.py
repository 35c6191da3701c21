"""The embedded file store (issue 15), what etcd does not share: it survives a restart, one
process owns it, a damaged file is refused and left as it is; and the --store URL."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from xds_server.store import Compacted, EtcdStore, FileStore, StoreError, open_store


def test_state_survives_a_restart_but_lease_keys_do_not(tmp_path):
    path = tmp_path / "state.json"
    with FileStore(path) as s:
        rev = s.put("rollouts/llm", b'{"step": 2}', revision=0)
        s.put("isolation/llm/00ff00ff00ff00ff", b"\xff\x00", revision=0)  # not UTF-8
        s.put("leader", b"me", revision=0, lease=s.grant(30))
        last = s.revision()
    doc = json.loads(path.read_text())
    assert doc["keys"]["rollouts/llm"]["value"] == '{"step": 2}'  # readable by an operator
    with FileStore(path) as s:
        assert s.get("rollouts/llm").value == b'{"step": 2}'
        assert s.get("rollouts/llm").revision == rev
        assert s.get("isolation/llm/00ff00ff00ff00ff").value == b"\xff\x00"
        assert s.get("leader") is None  # its holder ended with the process
        assert s.revision() == last  # revisions go on growing: terms never repeat
        assert s.put("leader", b"next", revision=0) > last


def test_a_second_control_plane_on_the_same_file_is_refused(tmp_path):
    path = tmp_path / "state.json"
    with FileStore(path) as s:
        s.put("mesh", b"1", revision=0)
        other = subprocess.run(
            [sys.executable, "-c", "import sys; from xds_server.store import FileStore; "
             "FileStore(sys.argv[1])", str(path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert other.returncode != 0
        assert f"{path}: in use by another control plane" in other.stderr
        assert "--store etcd://" in other.stderr
    with FileStore(path) as s:  # released at close
        assert s.get("mesh").value == b"1"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "Expecting property name"),
        ('{"format": 9, "revision": 1, "keys": {}}', "not a state store of format 1"),
        ('{"format": 1, "revision": -1, "keys": {}}', "revision: expected a revision"),
        (
            '{"format": 1, "revision": 3, "keys": {"a": {"value": "x", "revision": "2",'
            ' "created": 1}}}',
            "keys.a.revision: expected a revision",
        ),
    ],
)
def test_a_damaged_file_is_refused_and_left_as_it_is(tmp_path, text, error):
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StoreError, match=f"^{re.escape(str(path))}: ") as e:
        FileStore(path)
    assert error in str(e.value)
    assert path.read_text() == text
    FileStore(path.with_name("other.json")).close()  # the refused one left no lock behind
    with pytest.raises(StoreError):
        FileStore(path)  # still refused: nothing was overwritten


def test_a_watch_from_before_the_restart_is_compacted(tmp_path):
    with FileStore(tmp_path / "s.json") as s:
        rev = s.put("a", b"1", revision=0)
    with FileStore(tmp_path / "s.json") as s:
        with pytest.raises(Compacted, match=f"watch from revision {rev}: history starts at"):
            s.watch("", rev)
        with s.watch("", rev + 1) as w:
            s.put("a", b"2", revision=rev)
            assert w.get(timeout=5).value == b"2"


def test_a_watch_that_falls_behind_the_history_is_compacted(tmp_path):
    with FileStore(tmp_path / "s.json", history=4) as s:
        w = s.watch("", s.revision() + 1)
        for i in range(6):
            s.put(f"k{i}", b"v", revision=0)
        with pytest.raises(Compacted, match="fell more than 4 events behind"):
            w.get(timeout=1)


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("etcd://", "etcd: no endpoint given"),
        ("etcd://localhost", "etcd endpoint 'localhost': expected HOST:PORT"),
        ("etcd://h:1,h:x", "etcd endpoint 'h:x': expected HOST:PORT"),
        ("etcd://h:1/a b", "root 'a b': letters, digits"),
        ("http://h:2379", "unknown kind (expected etcds://HOST:PORT"),
        ("file:", "no path"),
    ],
)
def test_a_bad_store_url_says_what_is_wrong(url, error):
    with pytest.raises(ValueError, match=f"^{re.escape(f'store {url!r}: ')}") as e:
        open_store(url)
    assert error in str(e.value)


def test_store_urls(tmp_path):
    s = open_store("etcd://10.0.0.1:2379,[::1]:2380/prod/eu")
    assert isinstance(s, EtcdStore)
    assert s.endpoints == [("10.0.0.1", 2379), ("::1", 2380)]
    assert s.root == "/prod/eu/"
    assert open_store("etcd://h:2379").root == "/meshlm/"
    with open_store(f"file:{tmp_path}/x/state.json") as f:
        assert isinstance(f, FileStore) and f.path == tmp_path / "x/state.json"
