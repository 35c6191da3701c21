"""Sealed weights: a weight file encrypted with AES-256-GCM, decrypted only into memory.

Layout: MAGIC (8 bytes) | version u8 | chunk_size u32 | nonce prefix (8 bytes) | chunks.
Each chunk is AES-GCM(key, nonce_prefix || chunk_index u32) over up to chunk_size bytes, with the
header and a last-chunk flag as associated data, so reordering, truncation and any flipped byte
fail authentication. The key comes from the caller, a file or MESHLM_WEIGHT_KEY (hex or base64);
this module never writes it anywhere.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"MESHLMSW"
VERSION = 1
CHUNK = 1 << 24
_HEADER = struct.Struct("<8sBI8s")
_TAG = 16
KEY_ENV = "MESHLM_WEIGHT_KEY"
KEY_FILE_ENV = "MESHLM_WEIGHT_KEY_FILE"


class SealedError(ValueError):
    """A sealed file that cannot be opened: wrong key, tampered, truncated or not sealed."""


def parse_key(text: str | bytes) -> bytes:
    """A 32-byte key from raw bytes, hex (64 chars) or base64 text."""
    if isinstance(text, bytes) and len(text) == 32:
        return text
    s = text.decode() if isinstance(text, bytes) else text
    s = s.strip()
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            key = decode(s)
        except (ValueError, binascii.Error):
            continue
        if len(key) == 32:
            return key
    raise SealedError("weight key must be 32 bytes, given as 64 hex characters or base64")


def key_from_file(path: str | Path) -> bytes:
    return parse_key(Path(path).read_bytes())


def key_from_env() -> bytes:
    if os.environ.get(KEY_ENV):
        return parse_key(os.environ[KEY_ENV])
    if os.environ.get(KEY_FILE_ENV):
        return key_from_file(os.environ[KEY_FILE_ENV])
    raise SealedError(f"sealed weights need a key: set {KEY_ENV} or {KEY_FILE_ENV}")


def new_key() -> bytes:
    return os.urandom(32)


def is_sealed(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _nonce(prefix: bytes, index: int) -> bytes:
    return prefix + struct.pack("<I", index)


def seal(src: str | Path, dst: str | Path, key: bytes, chunk_size: int = CHUNK) -> None:
    """Encrypt the file `src` into `dst` (written to a temporary name, then renamed)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aes = AESGCM(parse_key(key))
    prefix = os.urandom(8)
    header = _HEADER.pack(MAGIC, VERSION, chunk_size, prefix)
    size = Path(src).stat().st_size
    n_chunks = max(1, -(-size // chunk_size))
    tmp = Path(f"{dst}.partial")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        fout.write(header)
        for i in range(n_chunks):
            data = fin.read(chunk_size)
            aad = header + bytes([i == n_chunks - 1])
            fout.write(aes.encrypt(_nonce(prefix, i), data, aad))
    os.replace(tmp, dst)


def unseal_to_memory(path: str | Path, key: bytes) -> bytes:
    """Decrypt and authenticate a sealed file; raises SealedError naming what is wrong."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aes = AESGCM(parse_key(key))
    out = bytearray()
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            raise SealedError(f"{path}: not a sealed weight file (bad magic)")
        _, version, chunk_size, prefix = _HEADER.unpack(header)
        if version != VERSION:
            raise SealedError(f"{path}: sealed format version {version} is not supported")
        i, chunk = 0, f.read(chunk_size + _TAG)
        while True:
            nxt = f.read(chunk_size + _TAG)
            last = not nxt
            try:
                out += aes.decrypt(_nonce(prefix, i), chunk, header + bytes([last]))
            except InvalidTag:
                raise SealedError(
                    f"{path}: authentication failed at chunk {i}: wrong key or tampered file"
                ) from None
            if last:
                return bytes(out)
            i, chunk = i + 1, nxt


@contextlib.contextmanager
def memory_file(data: bytes) -> Iterator[str]:
    """A path to an anonymous in-memory file (memfd) holding `data`; nothing touches disk."""
    fd = os.memfd_create("meshlm-weights", 0)
    try:
        os.write(fd, data) if len(data) < (1 << 30) else _write_all(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
