"""The README's "Run a mesh by hand" block, read as a new user reads it: every command parses
with the real CLI's parser (no flag that does not exist), and the processes it starts fit
`examples/mesh.yaml`: each version of the service runs (stable and canary) behind the sidecar
on its `endpoints` port, each runtime serves its metrics where `metrics_urls` says (the
rollout gates read there) and the OpenAI API where its sidecar sends `/v1/`, every sidecar has
a join token of its own, and the caller sidecar's admin is the one `caller_sidecars` names."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

from meshlm.cli import command_parser
from xds_server.mesh import load_mesh

ROOT = Path(__file__).resolve().parent.parent


def by_hand_commands(readme: str) -> list[tuple[str, argparse.Namespace]]:
    """(command name, parsed arguments) of each line of the block; SystemExit on a bad one."""
    section = readme.split("## Run a mesh by hand", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no sh block under 'Run a mesh by hand'"
    out = []
    for line in block.group(1).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "meshlm", line
        name, rest = words[1], words[2:]
        out.append((name, command_parser(name).parse_args(rest)))
    return out


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_the_by_hand_block_parses_and_fits_the_example_mesh() -> None:
    readme = (ROOT / "README.md").read_text()
    cmds = by_hand_commands(readme)
    mesh = load_mesh(str(ROOT / "examples/mesh.yaml"))
    of = lambda name: [a for n, a in cmds if n == name]  # noqa: E731
    (xds,) = of("xds-server")
    assert xds.mesh == "examples/mesh.yaml"
    grpc_port = mesh.control_plane.grpc_port

    tokens = {a.out: a.service_account for a in of("identity") if a.action == "token"}
    sidecars = of("sidecar")
    used = [s.join_token_file for s in sidecars]
    assert sorted(used) == sorted(tokens), (used, tokens)  # one single-use token per sidecar
    assert all(s.identity and s.xds == [("127.0.0.1", grpc_port)] for s in sidecars)

    runtimes = {a.port: a for a in of("serve")}
    svc = mesh.services["llm"]
    served = set()
    for s in (s for s in sidecars if s.service):
        assert s.service == "llm" and s.mesh == "examples/mesh.yaml", s
        assert s.inbound_port is None  # from the mesh file: the version's endpoint port
        version = svc.versions[s.version]
        assert tokens[s.join_token_file] == svc.service_account, s
        rt = runtimes[_port(s.local_endpoint)]
        assert rt.precision == version.precision, (rt, version)
        assert [f"http://127.0.0.1:{rt.metrics_port}/metrics.json"] == list(version.metrics_urls)
        assert s.local_http_endpoint == f"127.0.0.1:{rt.http_port}"  # the OpenAI section's /v1/
        assert "llm" in rt.served_model_name  # the OpenAI section's "model": "llm"
        served.add(s.version)
    assert served == set(svc.versions) == {"v1", "v2"}  # the canary too: `rollout start` needs it

    (caller,) = [s for s in sidecars if not s.service]
    assert [c.admin_url for c in mesh.caller_sidecars] == [f"http://127.0.0.1:{caller.admin_port}"]
    (gen,) = of("generate")
    assert gen.target == f"127.0.0.1:{caller.outbound_port}" and gen.authority == "llm"
    assert f"http://127.0.0.1:{caller.outbound_port}/v1/chat/completions" in readme
    (weights,) = of("weights")
    assert weights.service == "llm"

    ports = [p for rt in runtimes.values() for p in (rt.port, rt.http_port, rt.metrics_port)]
    ports += [e.port for v in svc.versions.values() for e in v.endpoints]
    ports += [caller.outbound_port, caller.admin_port, grpc_port, mesh.control_plane.admin_port]
    assert len(ports) == len(set(ports)), ports
    assert all(urlsplit(u).port in ports for v in svc.versions.values() for u in v.metrics_urls)
