"""Where the admin bearer token lives, and how it is written and found.

A control plane that makes its own token writes it to `<run dir>/admin-<admin port>.token`, only
after every port is bound, and removes it when it stops. The run dir is `$XDG_RUNTIME_DIR/meshlm`
when XDG_RUNTIME_DIR is set (an absolute path), else `~/.meshlm/run`; it must be a directory of
this user with mode 0700, not a symlink, or nothing is written or read there. Tokens never go on
a command line (`ps` shows them): clients take `--token-file PATH`, else $MESHLM_ADMIN_TOKEN, else
the run dir's file for the admin port they talk to.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_ENV = "MESHLM_ADMIN_TOKEN"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


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
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(mode=0o700)
    dfd = _open_private_dir(path.parent)
    tmp = f".{path.name}.{secrets.token_hex(6)}"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)
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
    dfd = _open_private_dir(path.parent)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    with os.fdopen(fd) as f:
        return f.read().strip()


def _open_private_dir(path: Path) -> int:
    """An fd of `path` once it is known to be a real directory, ours, mode 0700."""
    if path.is_symlink():
        raise TokenError(f"{path} is a symlink; refusing to keep the admin token there")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    problem = ""
    if st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {st.st_mode & 0o777:04o}, not 0700 (chmod 700 {path})"
    if problem:
        os.close(fd)
        raise TokenError(f"{path} {problem}; refusing to keep the admin token there")
    return fd


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
