"""etcd behind TLS and etcd's auth, as `meshlm etcd` starts it by default: the store works
through it as the meshlm user (reads, revision-checked writes, watches, leases), and nothing
else gets in: not plain HTTP, not TLS without a client certificate, not a client certificate
without a login, not the meshlm user outside its key prefix. On real etcd processes."""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography import x509

from tests.etcd_support import EtcdCluster, wait_for
from tests.test_etcd_cli import free_base
from xds_server.store import EtcdStore, Put, encode, open_store
from xds_server.store.etcd import AuthRefused
from xds_server.store.etcd_access import PASSWORD_ENV, EtcdAccess


def _put(url: str, key: str, value: bytes, context: ssl.SSLContext | None = None) -> dict:
    """One PUT through the gateway, as the review's attacker sent it (no login)."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                       "value": base64.b64encode(value).decode()}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v3/kv/put", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5, context=context) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1, secure=True) as cluster:
        yield cluster


def test_the_store_works_through_tls_and_auth(etcd) -> None:
    store = open_store(etcd.store_url())
    watch = store.watch("", store.revision() + 1)
    try:
        rev = store.txn([], [Put("live/llm", encode({"weights": {"v1": 100, "v2": 0}}))])
        assert store.get("live/llm").json() == {"weights": {"v1": 100, "v2": 0}}
        ev = watch.get(10)
        assert ev is not None and ev.key == "live/llm" and ev.revision == rev
        lease = store.grant(5)
        assert store.keepalive(lease) > 0
        store.revoke(lease)
    finally:
        watch.close()
    # A token etcd no longer knows (as after --auth-token-ttl) is taken again.
    store._token = "stale.1"
    assert store.get("live/llm") is not None


def test_nothing_without_the_meshlm_login_writes(etcd) -> None:
    store = open_store(etcd.store_url())
    store.txn([], [Put("live/llm", encode({"weights": {"v1": 100, "v2": 0}}))])
    host = etcd.endpoints[0]
    evil = encode({"weights": {"v1": 0, "v2": 100}})
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _put(f"http://{host}", "/meshlm/live/llm", evil)  # plain HTTP
    no_cert = ssl.create_default_context(cafile=str(etcd.pki.client / "ca.pem"))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _put(f"https://{host}", "/meshlm/live/llm", evil, no_cert)
    with pytest.raises(urllib.error.HTTPError):  # a client certificate, no login
        _put(f"https://{host}", "/meshlm/live/llm", evil, etcd.client_context())
    anonymous = EtcdStore(etcd.endpoints, access=EtcdAccess(etcd.client_context()))
    with pytest.raises(AuthRefused, match=r"permission denied|user name is empty"):
        anonymous.txn([], [Put("live/llm", evil)])
    elsewhere = open_store(etcd.store_url("other"))  # the meshlm user, outside /meshlm/
    with pytest.raises(AuthRefused, match="permission denied"):
        elsewhere.txn([], [Put("live/llm", evil)])
    assert store.get("live/llm").json() == {"weights": {"v1": 100, "v2": 0}}


def test_store_url_credentials_come_from_files_or_the_environment(
    etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = etcd.pki.client
    base = f"etcds://{etcd.endpoints[0]}/meshlm"
    files = f"ca={creds}/ca.pem&cert={creds}/client.pem&key={creds}/client-key.pem&user=meshlm"
    with pytest.raises(ValueError, match=f"no password .*{PASSWORD_ENV}"):
        open_store(f"{base}?{files}")
    monkeypatch.setenv(PASSWORD_ENV, etcd.pki.password())
    assert open_store(f"{base}?{files}").revision() > 0
    with pytest.raises(ValueError, match="unknown parameter 'password'"):
        open_store(f"{base}?{files}&password=x")  # never a secret on a command line
    with pytest.raises(ValueError, match="need TLS"):
        open_store(f"etcd://{etcd.endpoints[0]}/meshlm?{files}")


def test_meshlm_etcd_refuses_the_reviews_unauthenticated_puts(tmp_path: Path) -> None:
    """`meshlm etcd` as the README starts it: two PUTs without credentials change nothing."""
    port = free_base(0, 1)
    log = tmp_path / "etcd.log"
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "etcd", "--port", str(port),
                                 "--data-dir", str(tmp_path / "data")], env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        line = wait_for(lambda: [x for x in log.read_text().splitlines()
                                 if x.startswith("store: ")], 60)  # fmt: skip
        url = line[0].removeprefix("store: ")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _put(f"http://127.0.0.1:{port}", "/meshlm/live/llm", b"{}")
        assert url.startswith(f"etcds://127.0.0.1:{port}/meshlm?creds="), url
        creds = Path(parse_qs(urlsplit(url).query)["creds"][0])
        assert oct(creds.stat().st_mode & 0o777) == "0o700"
        assert oct((creds / "password").stat().st_mode & 0o777) == "0o600"
        store = open_store(url)
        store.txn([], [Put("live/llm", encode({"weights": {"v1": 100, "v2": 0}}))])
        for scheme, ctx in (("http", None), ("https", _ca_only(creds))):
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                _put(f"{scheme}://127.0.0.1:{port}", "/meshlm/live/llm", b'{"v1":0,"v2":100}', ctx)
        assert store.get("live/llm").json() == {"weights": {"v1": 100, "v2": 0}}
        assert "warning" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "etcd: stopped" in log.read_text(), log.read_text()


def _ca_only(creds: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(creds / "ca.pem"))


def test_make_creds_and_enable_auth_set_up_an_etcd_run_elsewhere(tmp_path: Path) -> None:
    """deploy/kubernetes/README.md's steps: `--make-creds` (private files, the members' DNS
    names in their certificate), members started on them, then `--enable-auth` once."""
    made = subprocess.run([sys.executable, "-m", "meshlm.cli", "etcd", "--make-creds",
                           str(tmp_path / "made"), "--san", "etcd-0.etcd"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "made/members/member.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "etcd-0.etcd" in names.get_values_for_type(x509.DNSName)
    for f in ("client/password", "client/client-key.pem", "members/member-key.pem",
              "root-password"):  # fmt: skip
        assert oct((tmp_path / "made" / f).stat().st_mode & 0o777) == "0o600", f
    assert not list((tmp_path / "made").rglob("ca-key*"))  # no one can issue another

    with EtcdCluster(1, secure=True) as etcd:  # its own creds; auth on: turn it off to redo it
        root = EtcdStore(etcd.endpoints, access=EtcdAccess(etcd.client_context(), "root",
                                                           etcd.pki.root_password()))  # fmt: skip
        root.call("/v3/auth/disable", {})
        anonymous = EtcdStore(etcd.endpoints, access=EtcdAccess(etcd.client_context()))
        anonymous.txn([], [Put("x", b"1")])  # auth off: anyone with a certificate writes
        enabled = subprocess.run([sys.executable, "-m", "meshlm.cli", "etcd", "--enable-auth",
                                  etcd.endpoints[0], "--creds", str(etcd.pki.base)],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        assert enabled.returncode == 0 and "auth enabled" in enabled.stdout, enabled
        with pytest.raises(AuthRefused):
            anonymous.txn([], [Put("x", b"2")])
        assert open_store(etcd.store_url()).get("x").value == b"1"
