"""The README's "Two hosts by hand" blocks, read as a new user reads them: the namespaces get the
addresses the commands use, every meshlm command parses with the real CLI's parser, and the
processes fit `examples/two-hosts.yaml` and each other: the control plane serves on host A's
address, the runtime's sidecar registers host B's address where its listener binds (as
`meshlm sidecar` itself checks before starting), every sidecar has a join token of its own for
the right service account, and the caller calls through its sidecar with a tenant's key. The
commands were run across two real network namespaces when written; this keeps them true."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from meshlm.cli import command_parser
from meshlm.commands.sidecar import _registration_problem
from wasm_filters.policy import hash_key
from xds_server.mesh import load_mesh

ROOT = Path(__file__).resolve().parent.parent


def blocks() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Two hosts by hand", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def commands() -> list[tuple[str, str, argparse.Namespace]]:
    """(host, command name, parsed arguments) of each meshlm line; the host from the comment
    above it (`# A: ...`, `# B: ...`)."""
    out, host = [], None
    for line in blocks()[1].replace("\\\n", " ").splitlines():
        if m := re.match(r"# ([AB]): ", line):
            host = m.group(1)
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "meshlm" and host, line
        out.append((host, words[1], command_parser(words[1]).parse_args(words[2:])))
    return out


def addresses() -> dict[str, str]:
    """Host (A, B) -> the address the namespace block gives it."""
    found = re.findall(r"ip -n mesh-([ab]) addr add ([\d.]+)/24", blocks()[0])
    return {name.upper(): address for name, address in found}


def test_the_two_hosts_blocks_parse_and_fit_the_mesh_and_each_other() -> None:
    at = addresses()
    assert set(at) == {"A", "B"} and at["A"] != at["B"]
    cmds = commands()
    of = lambda name, host=None: [a for h, n, a in cmds if n == name and host in (None, h)]  # noqa: E731
    mesh = load_mesh(str(ROOT / "examples/two-hosts.yaml"))
    registration = mesh.control_plane.registration
    assert registration.multi_host and registration.enabled is not False
    assert mesh.identity is not None  # registration on, believed per service account
    assert all(not v.endpoints for s in mesh.services.values() for v in s.versions.values())

    (xds,) = of("xds-server", "A")
    assert xds.mesh == "examples/two-hosts.yaml" and xds.grpc_host == at["A"]
    grpc_port = xds.grpc_port or mesh.control_plane.grpc_port

    tokens = {a.out: a.service_account for a in of("identity", "A") if a.action == "token"}
    sidecars = of("sidecar")
    assert sorted(s.join_token_file for s in sidecars) == sorted(tokens)  # one each
    assert all(s.identity and s.xds == [(at["A"], grpc_port)] for s in sidecars)

    (runtime,) = of("serve", "B")
    (inbound,) = of("sidecar", "B")
    svc = mesh.services[inbound.service]
    assert inbound.version in svc.versions
    assert runtime.precision == svc.versions[inbound.version].precision
    assert tokens[inbound.join_token_file] == svc.service_account
    assert inbound.local_endpoint == f"{runtime.host}:{runtime.port}" == f"127.0.0.1:{runtime.port}"
    assert inbound.register[0] == inbound.listen_host == at["B"]
    if inbound.inbound_port is None:  # what `meshlm sidecar` derives from --register
        inbound.inbound_port = inbound.register[1]
    assert _registration_problem(inbound) is None
    expected = f"registered {inbound.register[0]}:{inbound.register[1]} for {svc.name}/"
    assert expected in blocks()[1]

    (caller,) = of("sidecar", "A")
    assert caller.service is None and caller.outbound_port
    (gen,) = of("generate", "A")
    assert gen.target == f"127.0.0.1:{caller.outbound_port}" and gen.authority == svc.name
    assert hash_key(gen.api_key) in {k for t in mesh.tenants.tenants for k in t.key_sha256}
    assert of("status", "A")
