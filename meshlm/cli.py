"""`meshlm` console script. Each subcommand lives in its own module and is imported lazily,
so `meshlm status` never pays for importing torch."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

from meshlm import logs

DESCRIPTION = """\
meshlm serves a language model as a service mesh: runtimes serve SmolLM2 over gRPC, each behind
an Envoy sidecar that authorizes API keys, rate-limits tenants and routes between model
versions, all configured by one control plane from one mesh file.

Start with `meshlm demo` (a whole local mesh), then `meshlm generate` to call it and
`meshlm status` to watch it. `meshlm COMMAND --help` describes each command."""

EPILOG = """\
Commands that change a running control plane (apply, weights, rollout, identity) send its admin
token: from --token-file, else $MESHLM_ADMIN_TOKEN, else the local control plane's token file."""

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`
COMMANDS: dict[str, tuple[str, str]] = {
    "xds-server": (
        "meshlm.commands.xds_server",
        "run the control plane that configures every sidecar",
    ),
    "status": ("meshlm.commands.status", "show sync status of every sidecar and rollout"),
    "apply": ("meshlm.commands.apply", "push a changed mesh file to a running control plane"),
    "weights": ("meshlm.commands.weights", "set a service's traffic split between its versions"),
    "serve": ("meshlm.commands.serve", "serve a model over gRPC"),
    "generate": ("meshlm.commands.generate", "stream a generation from a runtime or sidecar"),
    "policy": ("meshlm.commands.policy", "compile or test the authz policy"),
    "sidecar": ("meshlm.commands.sidecar", "run one Envoy sidecar"),
    "rollout": ("meshlm.commands.rollout", "start or steer a canary rollout"),
    "fault": ("meshlm.commands.fault", "inject delays or aborts into a service's calls"),
    "demo": ("meshlm.commands.demo", "run the local mesh demo"),
    "identity": ("meshlm.commands.identity", "join tokens and root rotation of the mesh CA"),
    "etcd": ("meshlm.commands.etcd", "run a local etcd for control-plane replicas (--store)"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where there is none worth printing (None, a flag's
    False, an empty list) or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if d is None or d is False or d == [] or d == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def version() -> str:
    try:
        return importlib.metadata.version("meshlm")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `meshlm NAME` (imports the command's module)."""
    module_name, help_text = COMMANDS[name]
    # No abbreviations: `--token SECRET` must fail, not be taken for `--token-file`.
    cmd = argparse.ArgumentParser(
        prog=f"meshlm {name}",
        description=help_text,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    importlib.import_module(module_name).add_arguments(cmd)
    logs.add_arguments(cmd)  # --log-level, --log-format on every command
    # Subcommands' parsers (policy compile|test...) inherit nothing from their parent.
    for action in cmd._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.formatter_class = HelpFormatter
    return cmd


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="meshlm",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"meshlm {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    # Parse only the command name first, then let its module own the rest of the arguments.
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    args = command_parser(argv[0]).parse_args(argv[1:])
    logs.setup(args.log_level, args.log_format)
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
