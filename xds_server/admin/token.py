"""Where the admin bearer token lives, and how it is written and found.

A control plane that makes its own token writes it to `<run dir>/admin-<admin port>.token`, only
after every port is bound, and removes it when it stops. The run dir is `$XDG_RUNTIME_DIR/meshlm`
when XDG_RUNTIME_DIR is set (an absolute path), else `~/.meshlm/run`; it must be a directory of
this user with mode 0700, not a symlink, or nothing is written or read there. Tokens never go on
a command line (`ps` shows them): clients take `--token-file PATH`, else $MESHLM_ADMIN_TOKEN, else
the run dir's file for the admin port they talk to.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from mesh_common.private_files import PrivateFileError, read_private, write_private

TOKEN_ENV = "MESHLM_ADMIN_TOKEN"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
_KEPT = "the admin token"  # what the run dir holds, for its errors


class TokenError(ValueError):
    """The token cannot be kept or read safely; the message names the path."""


def run_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "meshlm"
    return Path.home() / ".meshlm" / "run"


def token_path(admin_port: int) -> Path:
    return run_dir() / f"admin-{admin_port}.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(admin_port: int, token: str) -> Path:
    """Atomically replace the run dir's token file (a planted file or symlink there is replaced,
    never followed or reused); returns its path."""
    path = token_path(admin_port)
    path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        write_private(path, (token + "\n").encode(), _KEPT)
    except PrivateFileError as e:
        raise TokenError(str(e)) from None
    return path


def remove_token(admin_port: int, token: str) -> None:
    """Remove the token file if it still holds `token` (it is ours, not a later server's)."""
    path = token_path(admin_port)
    try:
        if _read_in_private_dir(path) == token:
            path.unlink()
    except (OSError, TokenError):
        pass


def read_token_file(path: str | Path) -> str:
    """The token in a file given by the operator (first line, stripped)."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"--token-file {path}: cannot read it: {_reason(e)}") from None
    if not token or "\n" in token:
        raise TokenError(f"--token-file {path}: expected one line holding the token")
    return token


def client_token(admin_url: str, token_file: str | None) -> tuple[str | None, str]:
    """(token, where it came from) for a client of the admin API at `admin_url`."""
    if token_file:
        return read_token_file(token_file), str(token_file)
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV], f"${TOKEN_ENV}"
    url = urlsplit(admin_url)
    if url.hostname in LOOPBACK_NAMES and url.port:
        path = token_path(url.port)
        try:
            return _read_in_private_dir(path), str(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise TokenError(f"{path}: cannot read it: {_reason(e)}") from None
    return None, f"no --token-file, no ${TOKEN_ENV}, no token file of a local control plane"


def _read_in_private_dir(path: Path) -> str:
    try:
        return read_private(path, _KEPT).decode().strip()
    except PrivateFileError as e:
        raise TokenError(str(e)) from None


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
