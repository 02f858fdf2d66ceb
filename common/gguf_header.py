"""A GGUF file's header, read from its bytes: the key/value fields and the tensor table.

gguf-py's GGUFReader builds a numpy view per field part, per vocabulary entry: slow for a
large vocabulary (docs/benchmark-notes.md). This walks the header once with struct
(GGUF layout: github.com/ggml-org/ggml docs/gguf.md) and decodes only the fields asked for.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import UserError

# GGUF value types -> struct format of one value; 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_LENGTH = struct.Struct("<Q")  # a string's byte count


class _Walk:
    def __init__(self, m: mmap.mmap, path: str):
        self.m, self.path, self.at = m, path, 24

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.m, self.at)
        s = self.m[self.at + 8 : self.at + 8 + n].decode("utf-8", errors="replace")
        self.at += 8 + n
        return s

    def strings(self, count: int, keep: bool | str) -> list[str] | Strings | None:
        """An array of count strings (a vocabulary: 262,144 for Gemma 3) walked in one tight loop (a
        call per entry through value() is slower at that size: docs/benchmark-notes.md); decoded
        when keep, kept as its bytes (Strings) when keep is "bytes", else skipped: None."""
        m, start, at, length = self.m, self.at, self.at, _LENGTH.unpack_from
        for _ in range(count):
            at += 8 + length(m, at)[0]
        if at > len(m):
            raise struct.error("a string runs past the end of the file")
        self.at = at
        if keep == "bytes":
            return Strings(m[start:at], count)
        return decode_strings(m[start:at], count) if keep else None

    def value(self, vtype: int, keep: bool | str) -> Any:
        """The value at the cursor (decoded when keep, a string array as Strings when keep is
        "bytes", else skipped: None); the cursor moves past it."""
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            v = struct.unpack_from(fmt, self.m, self.at)[0] if keep else None
            self.at += struct.calcsize(fmt)
            return v
        if vtype == 8:
            if keep:
                return self.string()
            self.at += 8 + struct.unpack_from("<Q", self.m, self.at)[0]
            return None
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", self.m, self.at)
            self.at += 12
            if etype in _SCALAR and not keep:
                self.at += count * struct.calcsize(_SCALAR[etype])
                return None
            if etype == 8:
                return self.strings(count, keep)
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else None
        raise UserError(f"{self.path}: GGUF value type {vtype} at byte {self.at} is not one GGUF defines")


def decode_strings(data: bytes, count: int) -> list[str]:
    """The count strings of a GGUF string array's bytes (each a u64 length and its UTF-8 bytes)."""
    out, at, length = [], 0, _LENGTH.unpack_from
    for _ in range(count):
        (n,) = length(data, at)
        out.append(data[at + 8 : at + 8 + n].decode("utf-8", errors="replace"))
        at += 8 + n
    return out


class Strings(Sequence):
    """A GGUF string array as its bytes, decoded on first use (a vocabulary's 262,144 entries take
    ~0.1 s to decode): its length, and equality with another file's array written byte for byte
    the same, need no decoding. Equal to the tuple or list of its strings; hashed as that tuple."""

    __slots__ = ("data", "count", "_decoded")

    def __init__(self, data: bytes, count: int):
        self.data, self.count, self._decoded = data, count, None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self.decoded()[i]

    def __iter__(self):
        return iter(self.decoded())

    def decoded(self) -> tuple[str, ...]:
        if self._decoded is None:
            self._decoded = tuple(decode_strings(self.data, self.count))
        return self._decoded

    def __eq__(self, other) -> bool:
        if isinstance(other, Strings):  # the same bytes, or other bytes that decode to the same strings
            return self.count == other.count and (self.data == other.data or self.decoded() == other.decoded())
        if isinstance(other, (tuple, list)):
            return self.decoded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.decoded())

    def __repr__(self) -> str:
        return f"Strings({self.count} strings, {len(self.data)} bytes)"


def _open(path: str | Path):
    f = open(path, "rb")
    try:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file
        f.close()
        raise UserError(f"{path}: not a GGUF file (empty)") from None
    if len(m) < 24 or m[:4] != b"GGUF":
        magic = bytes(m[:4])
        m.close()
        f.close()
        raise UserError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF', and a 24-byte header)")
    version = struct.unpack_from("<I", m, 4)[0]
    if version < 2:
        m.close()
        f.close()
        raise UserError(f"{path}: GGUF version {version} (this reader reads 2 and later)")
    return f, m


def read_header(
    path: str | Path, keep=lambda key: True, tensors: bool = False
) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """({key: value} of the fields keep(key) asks for, [(tensor name, ggml type id)] when tensors,
    else []). A string array keep(key) answers "bytes" for comes as Strings, decoded when read."""
    fields, infos = _read(path, keep, tensors)
    return fields, [(name, ttype) for name, ttype, _ in infos]


def read_tensors(path: str | Path) -> list[tuple[str, int, int]]:
    """[(tensor name, ggml type id, number of elements)] of every tensor, from the header alone."""
    return [(name, ttype, math.prod(shape)) for name, ttype, shape in read_tensor_shapes(path)]


def read_tensor_shapes(path: str | Path) -> list[tuple[str, int, tuple[int, ...]]]:
    """[(tensor name, ggml type id, shape)] of every tensor, from the header alone."""
    return _read(path, lambda key: False, True)[1]


def _read(path: str | Path, keep, tensors: bool) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...]]]]:
    """The fields keep(key) asks for and, when tensors, every tensor's (name, type id, shape)."""
    f, m = _open(path)
    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        w, fields = _Walk(m, str(path)), {}
        for _ in range(n_kv):
            key = w.string()
            (vtype,) = struct.unpack_from("<I", m, w.at)
            w.at += 4
            wanted = keep(key)
            value = w.value(vtype, wanted)
            if wanted:
                fields[key] = value
        return fields, [info[:3] for info in _tensor_infos(w, m, n_tensors if tensors else 0)]
    except struct.error:
        raise UserError(f"{path}: GGUF header is truncated") from None
    finally:
        m.close()
        f.close()


def _tensor_infos(w: _Walk, m, n: int):
    """(name, ggml type id, shape, offset from the data's start) of the next n tensor infos (name,
    dims, shape, type, offset)."""
    for _ in range(n):
        name = w.string()
        (dims,) = struct.unpack_from("<I", m, w.at)
        shape = struct.unpack_from(f"<{dims}Q", m, w.at + 4)
        w.at += 4 + 8 * dims
        ttype, offset = struct.unpack_from("<IQ", m, w.at)
        w.at += 4 + 8  # the type, then the data offset
        yield name, ttype, shape, offset


def nbytes(elements: int, ttype: int) -> int:
    """The data bytes of a tensor of `elements` values of ggml type `ttype`: its blocks' bytes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    return elements // block * size


@dataclass(frozen=True)
class Layout:
    """Where each part of a GGUF file lies, in bytes from its start (GGUF layout:
    github.com/ggml-org/ggml docs/gguf.md): a file can be rewritten from these spans without
    decoding its values or its tensors."""

    version: int
    n_tensors: int
    fields: tuple[tuple[str, int, int], ...]  # (key, start, end) of each key/value pair, in file order
    tensor_infos: tuple[int, int]  # (start, end) of the tensor table
    alignment: int  # general.alignment, or GGUF's default of 32
    data_offset: int  # where the tensor data starts: the tensor table's end, padded to the alignment


def layout(path: str | Path) -> Layout:
    """The byte spans of a GGUF file's header (its values skipped, not decoded)."""
    f, m = _open(path)
    try:
        version = struct.unpack_from("<I", m, 4)[0]
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        w, spans, alignment = _Walk(m, str(path)), [], 32
        for _ in range(n_kv):
            start, key = w.at, w.string()
            (vtype,) = struct.unpack_from("<I", m, w.at)
            w.at += 4
            value = w.value(vtype, key == "general.alignment")
            if key == "general.alignment":
                alignment = int(value)
            spans.append((key, start, w.at))
        infos = w.at
        for _ in range(n_tensors):
            w.string()
            (dims,) = struct.unpack_from("<I", m, w.at)
            w.at += 4 + 8 * dims + 4 + 8  # the dimensions, the type, the data offset
        end = w.at
        if end > len(m):
            raise struct.error("the tensor table runs past the end of the file")
        data = end + (-end) % alignment
        return Layout(version, n_tensors, tuple(spans), (infos, end), alignment, data)
    except struct.error:
        raise UserError(f"{path}: GGUF header is truncated") from None
    finally:
        m.close()
        f.close()


def tensor_table(path: str | Path) -> tuple[Layout, dict[str, tuple[tuple[int, ...], int, int]]]:
    """(the file's layout, {tensor name: (shape, ggml type id, offset from the data's start)}) in file order."""
    lay = layout(path)
    f, m = _open(path)
    try:
        w = _Walk(m, str(path))
        w.at = lay.tensor_infos[0]
        return lay, {name: (shape, ttype, off) for name, ttype, shape, off in _tensor_infos(w, m, lay.n_tensors)}
    except struct.error:
        raise UserError(f"{path}: GGUF header is truncated") from None
    finally:
        m.close()
        f.close()
