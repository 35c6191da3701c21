"""The live dashboard on the admin port (issue 16 item 5): `meshlm xds-server` as a process,
a real Envoy caller sidecar, and the page in headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium over the WebDriver protocol). A weight changed through
the admin API shows on the open page within seconds. The test saves a screenshot to the tmp dir,
or to MESHLM_SCREENSHOT (`MESHLM_SCREENSHOT=docs/dashboard.png` made the README's picture)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import Caller, CallLoop, eventually, upstreams

TOKEN = "dashboard-test-token"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with upstreams("v1", "v2", health=True) as ups:
        envoy_admin = free_port()
        doc = {
            "services": {
                "llm": {
                    "versions": {n: {"endpoints": [u.address]} for n, u in ups.items()},
                    "route": {"weights": {"v1": 100}},
                }
            },
            "caller_sidecars": [{"admin_url": f"http://127.0.0.1:{envoy_admin}"}],
        }
        path = tmp_path_factory.mktemp("dashboard") / "mesh.yaml"
        path.write_text(yaml.safe_dump(doc))
        grpc_port, admin_port = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(path),
             "--grpc-port", str(grpc_port), "--admin-port", str(admin_port),
             "--debounce", "20ms"],
            env={**os.environ, "MESHLM_ADMIN_TOKEN": TOKEN},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lines = _read_lines(proc)
        admin = f"http://127.0.0.1:{admin_port}"
        try:
            eventually(lambda: _get(admin + "/healthz"), 30, "xds-server admin up")
            port = free_port()
            b = ads_bootstrap(
                "caller-a",
                xds_address=("127.0.0.1", grpc_port),
                outbound_port=port,
                admin_port=envoy_admin,
            )
            with EnvoyProcess(b) as envoy:
                envoy.wait_ready()
                yield {"admin": admin, "admin_port": admin_port, "port": port, "lines": lines}
        finally:
            proc.terminate()
            proc.wait(timeout=15)
            out = "".join(lines.wait())
            assert proc.returncode == 0 and "Traceback" not in out, out


class _Lines(list):
    """The lines a process writes, read by a thread (so its pipe never fills)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.append(line)

    def wait(self) -> _Lines:
        self._thread.join(timeout=15)
        return self


def _read_lines(proc: subprocess.Popen) -> _Lines:
    return _Lines(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    missing = [p for p in ("chromium", "chromedriver") if shutil.which(p) is None]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found: install Debian's chromium and chromium-driver "
            "(make test-tools, or apt-get install chromium chromium-driver)"
        )
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1100",
                "--disable-dev-shm-usage", "--no-first-run"):  # fmt: skip
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def _post(url: str, doc: dict, replies: list | None = None) -> int:
    req = urllib.request.Request(
        url, json.dumps(doc).encode(), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status
    except urllib.error.HTTPError as e:
        if replies is not None:
            replies.append(e.read())
        return e.code


def _text(driver: webdriver.Chrome, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def _split(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.ID, "split-llm").get_attribute("data-split") or ""


def test_the_page_follows_a_weight_change_live(
    mesh: dict, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    caller = Caller(mesh["port"])
    try:
        assert {caller.who() for _ in range(6)} == {"v1"}
        browser.get(mesh["admin"] + "/dashboard/")
        eventually(lambda: _split(browser) == "v1 100% v2 0%", 15, "the page shows the split")
        eventually(lambda: "caller-a" in browser.find_element(By.ID, "sidecars").text, 5,
                   "the sidecar's row")  # fmt: skip
        # What the gates read: the caller sidecar's calls to each version.
        eventually(lambda: "v1 100% 6" in browser.find_element(By.ID, "services").text, 10,
                   "v1's calls")  # fmt: skip
        assert browser.find_element(By.ID, "conn").text == "live"

        assert _post(mesh["admin"] + "/v1/services/llm/weights", {"v1": 70, "v2": 30}) == 200
        # The page is not reloaded: the event stream brings the change.
        eventually(lambda: _split(browser) == "v1 70% v2 30%", 5, "the page follows the change")
        # until v2 answers one: at 30 %, 10 calls missed it 2.8 % of the time (red once in CI)
        assert any(caller.who() == "v2" for _ in range(60))
        v2_calls = re.compile(r"^v2 30% [1-9]", re.M)  # counted at the caller sidecar
        eventually(lambda: v2_calls.search(browser.find_element(By.ID, "services").text), 10,
                   "v2's calls")  # fmt: skip
    finally:
        caller.close()

    # A rollout: its state and each interval's gate readings appear as they are taken.
    spec = {"stable": "v1", "canary": "v2", "steps": [10, 50, 100], "interval": "1s",
            "gates": {"min_requests": 1}}  # fmt: skip
    with CallLoop(mesh["port"]):
        assert _post(mesh["admin"] + "/rollouts/llm", spec) == 201
        try:
            eventually(lambda: "pass" in _text(browser, "rollout-llm"), 15, "a passed interval")
            assert re.search(r"^(Progressing|Succeeded) v1 → v2", _text(browser, "rollout-llm"))
            # The per-version counts follow the rollout's traffic (read every 2 s).
            v2_many = re.compile(r"^v2 \d+% [1-9]\d+ ", re.M)
            eventually(lambda: v2_many.search(_text(browser, "services")), 10, "v2's calls")
            shot = Path(os.environ.get("MESHLM_SCREENSHOT") or tmp_path / "dashboard.png")
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
        finally:
            # Back to v1 alone (409 once the rollout succeeded: nothing to abort).
            assert _post(mesh["admin"] + "/rollouts/llm/abort", {}) in (200, 409)


def _stream(port: int, host: str) -> tuple[bytes, socket.socket]:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf, s


def test_events_push_a_change_and_refuse_a_foreign_host(mesh: dict) -> None:
    port = mesh["admin_port"]
    head, s = _stream(port, "evil.example:80")  # DNS rebinding: the page's own host name
    s.close()
    assert head.startswith(b"HTTP/1.1 403"), head
    head, s = _stream(port, f"127.0.0.1:{port}")
    try:
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
        buf = head.partition(b"\r\n\r\n")[2]

        def event() -> dict:
            nonlocal buf
            while b"\n\n" not in buf:
                buf += s.recv(65536)
            line, _, buf = buf.partition(b"\n\n")
            return json.loads(line.removeprefix(b"data: "))

        assert set(event()["services"]["llm"]["weights"]) == {"v1", "v2"}
        assert _post(mesh["admin"] + "/v1/services/llm/weights", {"v1": 20, "v2": 80}) == 200
        eventually(lambda: event()["services"]["llm"]["weights"] == {"v1": 20, "v2": 80}, 5,
                   "an event with the new weights")  # fmt: skip
    finally:
        s.close()


def test_the_page_loads_nothing_from_elsewhere(mesh: dict) -> None:
    with urllib.request.urlopen(mesh["admin"] + "/dashboard/", timeout=5) as r:
        assert r.headers["Content-Security-Policy"].startswith("default-src 'self'")
        page = r.read().decode()
    # The first state is inline data (it names the caller sidecar's admin URL): not loaded.
    state = re.compile(r'<script type="application/json" id="first-state">.*?</script>', re.S)
    assert state.search(page), page
    assert "http" not in state.sub("", page)  # no CDN: every script and style comes from here


def test_the_start_line_prints_the_dashboard_url(mesh: dict) -> None:
    url = f"{mesh['admin']}/dashboard/"
    line = eventually(
        lambda: [s for s in mesh["lines"] if s.startswith("xds-server: dashboard")], 10, "its line"
    )
    assert line == [f"xds-server: dashboard at {url}\n"], mesh["lines"]


def _block_events(driver: webdriver.Chrome, block: bool) -> None:
    driver.execute_cdp_cmd("Network.enable", {})
    urls = ["*/dashboard/events"] if block else []
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": urls})


def test_the_first_paint_shows_the_mesh_before_the_live_feed(
    mesh: dict, browser: webdriver.Chrome
) -> None:
    """The page carries the state it was served with: with the event stream blocked (as a
    proxy that buffers it would), the services, split and sidecars still show."""
    _block_events(browser, True)
    try:
        browser.get(mesh["admin"] + "/dashboard/")
        # No waiting: there when the page has loaded (read in one script: the page redraws).
        split, sidecars, conn = browser.execute_script(
            "const text = (id) => document.getElementById(id);"
            "return [text('split-llm').dataset.split, text('sidecars').innerText,"
            " text('conn').innerText]"
        )
        assert re.fullmatch(r"v1 \d+% v2 \d+%", split), split
        assert "caller-a" in sidecars
        assert conn != "live"
    finally:
        _block_events(browser, False)
        browser.get("about:blank")


def _rollout(admin: str) -> dict:
    try:
        with urllib.request.urlopen(admin + "/rollouts/llm", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return {"state": None}  # none yet
        raise


def _no_rollout_running(admin: str) -> None:
    """Abort one in progress (another test's, promoting maybe) and wait for it to end."""
    assert _post(admin + "/rollouts/llm/abort", {}) in (200, 404, 409)
    ended = (None, "Succeeded", "RolledBack", "Failed")
    eventually(lambda: _rollout(admin)["state"] in ended, 30, "no rollout running")


def test_a_rollout_run_with_no_page_open_is_on_the_chart_and_its_steps_count_from_1(
    mesh: dict, browser: webdriver.Chrome
) -> None:
    """The README's path: `meshlm rollout start` in a shell, then the dashboard. The split
    chart holds the steps taken while no page was open, and steps are numbered as the CLI
    numbers them (1 is the first)."""
    browser.get("about:blank")  # no page watches from here on
    admin = mesh["admin"]
    _no_rollout_running(admin)
    assert _post(admin + "/v1/services/llm/weights", {"v1": 100, "v2": 0}) == 200
    spec = {"stable": "v1", "canary": "v2", "steps": [20, 60, 100], "interval": "1s",
            "gates": {"min_requests": 1}}  # fmt: skip
    with CallLoop(mesh["port"]):
        replies: list = []
        assert _post(admin + "/rollouts/llm", spec, replies) == 201, replies
        try:
            eventually(lambda: _rollout(admin)["state"] == "Succeeded", 30, "the rollout")
            time.sleep(0.5)  # the chart runs on past the last step
            # The series holds each step: recorded as the weights were pushed, watched or not.
            with urllib.request.urlopen(admin + "/dashboard/state", timeout=5) as r:
                splits = json.loads(r.read())["services"]["llm"]["splits"]
            assert [w["v2"] for _, w in splits][-3:] == [20, 60, 100], splits
            browser.get(admin + "/dashboard/")
            # Read in one script: the page redraws every second (an element found goes stale).
            weights = browser.execute_script(
                "return document.querySelector('#split-chart-llm path[data-version=v2]')"
                ".dataset.weights"
            ).split()
            assert weights[-3:] == ["20", "60", "100"], weights
            rows = browser.execute_script(
                "return document.getElementById('rollout-llm').innerText"
            ).strip()
            assert re.search(r"^1\s+20%\s+pass", rows, re.M), rows
            assert re.search(r"^2\s+60%\s+pass", rows, re.M), rows  # 100 %: promoted at once
            assert not re.search(r"^0\s", rows, re.M), rows
            assert rows.startswith("Succeeded v1 → v2, canary 100%, step 3/3"), rows
        finally:
            assert _post(admin + "/rollouts/llm/abort", {}) in (200, 409)
            assert _post(admin + "/v1/services/llm/weights", {"v1": 100, "v2": 0}) == 200


def _spki_sha256(pem_file: Path) -> str:
    """What Chromium's --ignore-certificate-errors-spki-list takes: base64 SHA-256 of the
    first certificate's SubjectPublicKeyInfo (the README's openssl pipeline computes it)."""
    cert = x509.load_pem_x509_certificate(pem_file.read_bytes())
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def test_an_https_dashboard_names_its_ca_and_a_browser_given_it_shows_the_mesh(
    tmp_path: Path,
) -> None:
    """A mesh with identity (the README's examples/mesh.yaml): the admin API is HTTPS with the
    mesh CA. The start line names the CA file to trust; curl --cacert with it, and Chromium
    given that CA's key (as the README says), load the page with the mesh in it."""
    grpc_port, admin_port, ca_port, ca_mtls_port = (free_port() for _ in range(4))
    doc = {
        "control_plane": {"grpc_port": grpc_port, "admin_port": admin_port, "ca_port": ca_port,
                          "ca_mtls_port": ca_mtls_port},
        "identity": {"trust_domain": "meshlm.local"},
        "services": {"llm": {"versions": {"v1": {"endpoints": [f"127.0.0.1:{free_port()}"]}},
                             "route": {"weights": {"v1": 100}}}},
    }  # fmt: skip
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(tmp_path / "mesh.yaml")],
        env={**os.environ, "XDG_RUNTIME_DIR": str(run)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = _read_lines(proc)
    try:
        url = f"https://127.0.0.1:{admin_port}/dashboard/"
        ca = run / "meshlm" / f"admin-{admin_port}-ca.pem"
        line = eventually(
            lambda: [s for s in lines if s.startswith("xds-server: dashboard")], 60, "its line"
        )
        assert line == [
            f"xds-server: dashboard at {url} (HTTPS with the mesh CA: trust {ca}, see the README)\n"
        ], lines
        curl = subprocess.run(
            ["curl", "-sS", "--cacert", str(ca), url], capture_output=True, text=True, timeout=30
        )
        assert curl.returncode == 0 and '"llm"' in curl.stdout, curl

        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or ""
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--user-data-dir={tmp_path / 'profile'}",
                    f"--ignore-certificate-errors-spki-list={_spki_sha256(ca)}"):  # fmt: skip
            opts.add_argument(arg)
        driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
        try:
            driver.get(url)
            split = eventually(
                lambda: driver.execute_script(
                    "return document.getElementById('split-llm')?.dataset.split"
                ),
                10,
                "the page over HTTPS",
            )
            assert split == "v1 100%", split
        finally:
            driver.quit()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        out = "".join(lines.wait())
        assert proc.returncode == 0 and "Traceback" not in out, out
