"""`meshlm` console script. Each subcommand lives in its own module and is imported lazily,
so `meshlm status` never pays for importing torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`
COMMANDS: dict[str, tuple[str, str]] = {
    "xds-server": ("meshlm.cmd_xds", "run the xDS control plane"),
    "status": ("meshlm.cmd_status", "show sync status of every sidecar and rollout"),
    "apply": ("meshlm.cmd_apply", "push a changed mesh file to a running control plane"),
    "serve": ("meshlm.cmd_serve", "serve a model over gRPC"),
    "generate": ("meshlm.cmd_generate", "stream a generation from a runtime or sidecar"),
    "policy": ("meshlm.cmd_policy", "compile or test the authz policy"),
    "sidecar": ("meshlm.cmd_sidecar", "run one Envoy sidecar"),
    "rollout": ("meshlm.cmd_rollout", "start or steer a canary rollout"),
    "demo": ("meshlm.cmd_demo", "run the local mesh demo"),
    "identity": ("meshlm.cmd_identity", "join tokens and root rotation of the mesh CA"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="meshlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    # Parse only the command name first, then let its module own the rest of the arguments.
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)
        return 2
    module_name, help_text = COMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    # No abbreviations: `--token SECRET` must fail, not be taken for `--token-file`.
    cmd = argparse.ArgumentParser(
        prog=f"meshlm {argv[0]}", description=help_text, allow_abbrev=False
    )
    module.add_arguments(cmd)
    args = cmd.parse_args(argv[1:])
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is caught below, not at exit
        return code
    except BrokenPipeError:  # `meshlm policy compile | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"meshlm {argv[0]}: output closed early (broken pipe)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
