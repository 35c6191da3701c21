"""Peers' strings in the control plane's log are escaped: a node id or a NACK's error_detail
with a newline printed a forged `xds_server.admin.api ... POST /identity/tokens` line in the text
log. Real `meshlm xds-server` process and ADS streams on loopback; its log read back."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from meshlm import logs
from tests.test_admin_token import Xds, env  # noqa: F401  (the fixture)
from tests.test_xds_support import AdsClient, eventually, sotw

FAKE = (
    "2026-12-05 00:00:00,000 INFO xds_server.admin.api admin POST /identity/tokens by "
    "127.0.0.1:1 (token sha256:0000): 200"
)


def test_node_id_and_nack_detail_with_newlines_stay_one_escaped_line(
    tmp_path: Path,
    env: dict,  # noqa: F811
) -> None:
    xds = Xds(tmp_path, free_port(), free_port(), env=env)
    clients = []
    try:
        xds.wait_up()
        port = int(xds.proc.args[xds.proc.args.index("--grpc-port") + 1])
        evil = AdsClient(port, "evil-1\n" + FAKE)
        clients.append(evil)
        evil.send(sotw(t.CLUSTER))
        eventually(lambda: "evil-1" in xds.output(), what="a line about evil-1")
        nack = AdsClient(port, "nack-1")
        clients.append(nack)
        nack.send(sotw(t.CLUSTER))
        r = nack.recv(30)
        nack.send(sotw(t.CLUSTER, (), "", r.nonce, error="bad\n" + FAKE + "\x1b[2J\r"))
        eventually(lambda: "nack nack-1" in xds.output(), what="the nack line")
    finally:
        for c in clients:
            c.close()
        xds.stop()
    lines = xds.output().splitlines()
    assert not [x for x in lines if x.startswith(FAKE[:23])], "a forged line"
    about_evil = [x for x in lines if "evil-1" in x]
    assert len(about_evil) == 1 and "evil-1\\n2026-12-05 00:00:00,000" in about_evil[0]
    nacks = [x for x in lines if "nack nack-1" in x]
    assert len(nacks) == 1 and "bad\\n2026-12-05" in nacks[0] and "\\x1b[2J\\r" in nacks[0]
    assert "\x1b" not in xds.output() and "\r" not in xds.output()


def test_both_formats_escape_the_message_and_keep_fields_exact() -> None:
    record = logging.LogRecord(
        "xds_server.xds.sync", logging.WARNING, __file__, 1, "nack %s: %s", ("n\u2028", "e\n"), None
    )
    record.node = "n\u2028"
    text = logs.TextFormatter().format(record)
    assert text.endswith("nack n\\u2028: e\\n") and len(text.splitlines()) == 1
    doc = json.loads(logs.JsonFormatter().format(record))
    assert doc["message"] == "nack n\\u2028: e\\n" and doc["node"] == "n\u2028"
    try:
        try:
            raise KeyError("k\n" + FAKE)
        except KeyError as e:
            raise ValueError("x\n" + FAKE) from e
    except ValueError:
        record.exc_info = sys.exc_info()
    with_tb = logs.TextFormatter().format(record).splitlines()
    assert not [x for x in with_tb if x.startswith(FAKE[:23])], with_tb
    assert [x for x in with_tb if x.startswith(("KeyError", "ValueError"))] == [
        f"KeyError: 'k\\n{FAKE}'",
        f"ValueError: x\\n{FAKE}",
    ]
