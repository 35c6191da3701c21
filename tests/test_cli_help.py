"""The CLI explains itself (issue 17, item 4): every option of every command and subcommand has
help text, `--version` names the installed version, and `meshlm --help` speaks to users."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys

from meshlm.cli import COMMANDS, command_parser


def _undocumented(p: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                missing += _undocumented(sub, f"{path} {name}")
        elif not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
            missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
    return missing


def test_every_option_of_every_command_has_help_text() -> None:
    missing = [m for name in COMMANDS for m in _undocumented(command_parser(name), name)]
    assert missing == []


def _meshlm(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.cli", *argv], capture_output=True, text=True, timeout=60
    )


def test_help_shows_defaults_and_the_version_is_the_installed_one() -> None:
    r = _meshlm("generate", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines at the terminal's width
    assert "most tokens to generate (default: 128)" in text
    assert "(default: None)" not in text  # no default worth printing: none printed
    r = _meshlm("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"meshlm {importlib.metadata.version('meshlm')}"


def test_top_level_help_is_written_for_users() -> None:
    r = _meshlm("--help")
    assert r.returncode == 0, r.stderr
    assert "service mesh" in r.stdout and "meshlm demo" in r.stdout
    assert "imported lazily" not in r.stdout  # the module's docstring is for developers
    for name in COMMANDS:
        assert name in r.stdout


def _texts(p: argparse.ArgumentParser, path: str) -> list[tuple[str, str]]:
    """(where, text) of every group title, description and option help under `p`."""
    out = [(path, p.description or "")]
    out += [(f"{path} [{g.title}]", f"{g.title} {g.description or ''}") for g in p._action_groups]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _texts(sub, f"{path} {name}")
        else:
            out.append((f"{path} {'/'.join(a.option_strings) or a.dest}", a.help or ""))
    return out


def test_help_has_no_issue_numbers_or_unexplained_envoy_terms() -> None:
    # Plain words for a first user: what the option does, not which issue added it, and no
    # Envoy term (SDS, ROOTCA, DELTA_GRPC, overload manager) a user has to look up.
    words = re.compile(r"\bissue \d|\bdefect \d|ROOTCA|DELTA_GRPC|\bby SDS\b|overload manager")
    found = [
        (where, text)
        for name in COMMANDS
        for where, text in _texts(command_parser(name), name)
        if words.search(text)
    ]
    assert found == []
