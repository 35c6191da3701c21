"""Private files: 0600 files in 0700 directories of this user, for keys and tokens.

One place for what the mesh CA's state (xds_server/identity/ca.py), the admin token
(xds_server/admin/token.py) and a sidecar's credentials (sidecar/identity.py) need. A private
dir must be a real directory (not a symlink), this user's, and closed to everyone else, or
nothing is written to or read from it. Its files are opened relative to a descriptor of the
checked directory and never through a symlink. A write goes to a fresh temporary file
(O_EXCL, mode set with fchmod so the umask cannot change it), is synced, then renamed over the
target (a planted file or symlink there is replaced, never followed), and the rename is synced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateFileError(ValueError):
    """A dir or file that is not private; the message names the path and how to fix it."""


def private_dir(path: str | Path, what: str) -> Path:
    """`path` as a private dir, made 0700 (with its parents) if missing; else PrivateFileError.
    `what` says what is kept there, for the message ("CA keys")."""
    path = Path(path)
    os.close(_open_private_dir(path, what, make=True))
    return path


def write_private(path: str | Path, data: bytes, what: str, *, any_dir: bool = False) -> None:
    """Atomically replace `path` with a 0600 file holding `data`. Its dir must be a private dir
    (made if missing), unless `any_dir`: a file the operator asked for where they chose (the
    dir is then neither made nor checked; the file is private all the same)."""
    path = Path(path)
    if any_dir:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        dfd = _open_private_dir(path.parent, what, make=True)
    tmp = f".{path.name}.{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)  # the rename itself survives a crash
    finally:
        os.close(dfd)


def read_private(path: str | Path, what: str) -> bytes:
    """The bytes of `path` in a private dir, never read through a symlink (FileNotFoundError
    when the dir or the file is missing: nothing is made)."""
    path = Path(path)
    dfd = _open_private_dir(path.parent, what)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PrivateFileError(
                f"{path} is a symlink; refusing to read {what} from it"
            ) from None
        raise
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _open_private_dir(path: Path, what: str, *, make: bool = False) -> int:
    """A descriptor of `path` once it is known to be a real directory, ours, mode 0700 (with
    `make`, made so if missing: mkdir's mode passes through the umask, so it is set after)."""
    made = False
    if make:
        with contextlib.suppress(FileExistsError):  # exists: checked below, whatever it is
            path.mkdir(mode=0o700, parents=True)
            made = True
    if path.is_symlink():
        raise PrivateFileError(f"{path} is a symlink; refusing to keep {what} there")
    try:
        fd = os.open(path, _OPEN_DIR)
    except NotADirectoryError:
        raise PrivateFileError(
            f"{path} is not a directory; refusing to keep {what} there"
        ) from None
    if made:
        os.fchmod(fd, 0o700)
    st = os.fstat(fd)
    problem = ""
    if st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {st.st_mode & 0o777:04o}, not 0700 (chmod 700 {path})"
    if problem:
        os.close(fd)
        raise PrivateFileError(f"{path} {problem}; refusing to keep {what} there")
    return fd
