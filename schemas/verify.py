"""A FlatBuffers verifier for our tables (the Python runtime has none).

It follows the rules of the C++ `flatbuffers::Verifier`: the root offset, every table, vtable,
vector and string offset and length lie inside the buffer, scalars are aligned, vtable sizes are
sane, strings are zero-terminated UTF-8, required fields are present, and depth and table count are
bounded. Only after `verify()` passes may the flatc-generated accessors read the buffer.

Offsets may alias (flatbuffers shares vtables and `CreateSharedString`s), so a small buffer can
reference the same large string thousands of times, and every reader that follows the offsets pays
for each alias. Hence two bounds beyond the C++ verifier's `max_tables` /
`max_depth`: element counts the caller caps (`max_counts`) are checked before a vector's elements
are walked, and the bytes visited over all aliases may not exceed `BUDGET_FACTOR` x the buffer's
length + `BUDGET_SLACK`. A buffer without aliasing visits each byte at most once (shared vtables
and small shared strings fit the slack), and a decoder that reads what was verified does no more
work than the verifier did.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from

MAX_DEPTH = 8
MAX_TABLES = 4096
BUDGET_FACTOR = 2
BUDGET_SLACK = 4096
_MAX_OFFSET = 0x7FFFFFFF  # uoffset_t must fit soffset_t (C++ VerifyOffset)


class WireError(ValueError):
    """A buffer or a value that must not be accepted; `field` names the place at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "scalar", "string", "vector", "strings", "tables", "table"
    size: int = 4  # scalar size, or vector element size
    table: Table | None = None  # for "tables" and "table"
    required: bool = False


@dataclass(frozen=True)
class Table:
    name: str
    fields: tuple[Field, ...]  # in slot order, exactly as declared in the .fbs


def verify(
    buf: bytes | bytearray | memoryview,
    root: Table,
    max_size: int,
    max_counts: Mapping[str, int] | None = None,
) -> None:
    """Raise WireError unless `buf` holds a well-formed `root` table.

    `max_counts` caps the element count of vectors by field path (e.g. {"stop": 16}); a longer
    vector is refused before any of its elements is read.
    """
    n = len(buf)
    if n > max_size:
        raise WireError(root.name, f"buffer of {n} bytes exceeds the limit of {max_size}")
    if n < 8:
        raise WireError(root.name, f"buffer of {n} bytes is too short for a FlatBuffer")
    _Verifier(buf, max_counts or {}).table(_U32(buf, 0)[0], root, root.name, 0)


class _Verifier:
    __slots__ = ("budget", "buf", "max_counts", "n", "tables")

    def __init__(self, buf: bytes | bytearray | memoryview, max_counts: Mapping[str, int]) -> None:
        self.buf = buf
        self.n = len(buf)
        self.tables = 0
        self.max_counts = max_counts
        self.budget = BUDGET_FACTOR * self.n + BUDGET_SLACK

    def _visit(self, size: int, path: str) -> None:
        """Charge `size` bytes to the budget of bytes visited (aliases count every time)."""
        self.budget -= size
        if self.budget < 0:
            raise WireError(
                path,
                f"offsets alias the same data too often: more than {BUDGET_FACTOR} x "
                f"{self.n} + {BUDGET_SLACK} bytes to read",
            )

    def _in(self, pos: int, size: int) -> bool:
        return pos >= 0 and pos + size <= self.n

    def _deref(self, pos: int, path: str) -> int:
        """Follow the uoffset stored at `pos` (already checked to be readable)."""
        off = _U32(self.buf, pos)[0]
        if off == 0 or off > _MAX_OFFSET or not self._in(pos + off, 4):
            raise WireError(path, f"offset {off} at byte {pos} points outside the buffer")
        return pos + off

    def table(self, pos: int, spec: Table, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise WireError(path, "tables nested too deeply")
        self.tables += 1
        if self.tables > MAX_TABLES:
            raise WireError(path, "too many tables")
        if pos % 4 or not self._in(pos, 4):
            raise WireError(path, f"table at byte {pos} is misaligned or outside the buffer")
        vt = pos - _I32(self.buf, pos)[0]
        if vt % 2 or not self._in(vt, 4):
            raise WireError(path, f"vtable at byte {vt} is misaligned or outside the buffer")
        vsize, osize = _U16(self.buf, vt)[0], _U16(self.buf, vt + 2)[0]
        if vsize < 4 or vsize % 2 or not self._in(vt, vsize):
            raise WireError(path, f"vtable size {vsize} is invalid")
        if osize < 4 or not self._in(pos, osize):
            raise WireError(path, f"table size {osize} is invalid")
        self._visit(vsize + osize, path)
        for slot, f in enumerate(spec.fields):
            vo = 4 + 2 * slot
            fo = _U16(self.buf, vt + vo)[0] if vo < vsize else 0
            fpath = f"{path}.{f.name}" if depth else f.name
            if fo == 0:
                if f.required:
                    raise WireError(fpath, "required field is missing")
                continue
            size = f.size if f.kind == "scalar" else 4
            fpos = pos + fo
            if fo < 4 or fo + size > osize or fpos % size:
                raise WireError(fpath, f"field at offset {fo} lies outside its table")
            if f.kind == "scalar":
                continue
            target = self._deref(fpos, fpath)
            if f.kind == "string":
                self.string(target, fpath)
            elif f.kind == "table":
                assert f.table is not None
                self.table(target, f.table, fpath, depth + 1)
            else:
                count = self.vector(target, 4 if f.kind != "vector" else f.size, fpath)
                limit = self.max_counts.get(fpath)
                if limit is not None and count > limit:
                    raise WireError(fpath, f"{count} elements exceed the limit of {limit}")
                for i in range(count if f.kind != "vector" else 0):
                    epos = target + 4 + 4 * i
                    elem = self._deref(epos, f"{fpath}[{i}]")
                    if f.kind == "strings":
                        self.string(elem, f"{fpath}[{i}]")
                    else:
                        assert f.table is not None
                        self.table(elem, f.table, f"{fpath}[{i}]", depth + 1)

    def vector(self, pos: int, elem_size: int, path: str) -> int:
        if pos % 4:
            raise WireError(path, f"vector at byte {pos} is misaligned")
        count = _U32(self.buf, pos)[0]
        if not self._in(pos + 4, count * elem_size):
            raise WireError(path, f"vector of {count} elements runs past the buffer")
        self._visit(4 + count * elem_size, path)
        return count

    def string(self, pos: int, path: str) -> str:
        length = self.vector(pos, 1, path)
        end = pos + 4 + length
        if not self._in(end, 1) or self.buf[end] != 0:
            raise WireError(path, "string is not zero-terminated inside the buffer")
        try:
            return str(memoryview(self.buf)[pos + 4 : end], "utf-8")
        except UnicodeDecodeError as e:
            raise WireError(path, f"string is not valid UTF-8 ({e.reason} at {e.start})") from None
