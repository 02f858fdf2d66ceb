"""The Thrift compact protocol, decoded and encoded whole, for the Parquet footers
store/parquet_splice.py takes apart and puts back together.

Every value keeps its wire type, and a struct its fields in their wire order, so a footer written by
a standard Thrift writer (Apache Thrift's C++, which Parquet's C++ writer uses) decodes and encodes
back to the same bytes (tests/test_parallel_store.py). The encoding: Apache Thrift's
doc/specs/thrift-compact-protocol.md (field headers as a delta of the field id and a type nibble,
zigzag varint integers, lists and sets with a size-and-type byte, maps with a varint size and a
key-and-value type byte).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

TRUE, FALSE, I8, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)


class ThriftError(ValueError):
    """Bytes that are not a Thrift compact struct this codec reads."""


@dataclass
class TList:
    """A list (or set, etype SET's callers keep apart by their field type) of one element type."""

    etype: int
    items: list


@dataclass
class TMap:
    ktype: int
    vtype: int
    items: list  # [(key, value)]


@dataclass(frozen=True)
class Encoded:
    """A struct already encoded (an element of a list of structs, written as it is)."""

    data: bytes


@dataclass
class Struct:
    """A struct's fields, {field id: (wire type, value)}, in their wire order. A bool field's
    wire type is TRUE or FALSE, its value the bool."""

    fields: dict[int, tuple[int, object]] = field(default_factory=dict)

    def __contains__(self, fid: int) -> bool:
        return fid in self.fields

    def get(self, fid: int, default=None):
        return self.fields[fid][1] if fid in self.fields else default

    def set(self, fid: int, ttype: int, value) -> None:
        """Sets a field; one not there yet goes in field-id order."""
        new = fid not in self.fields
        self.fields[fid] = (ttype, value)
        if new:
            self.fields = dict(sorted(self.fields.items()))

    def copy(self) -> "Struct":
        """A copy of this struct's own fields (nested values are shared)."""
        return Struct(dict(self.fields))


# -- decoding -----------------------------------------------------------------------------------------
class _Reader:
    """Reads from bytes; reading past their end raises IndexError (decode says ThriftError)."""

    def __init__(self, buf: bytes | memoryview):
        self.buf, self.pos = bytes(buf), 0

    def byte(self) -> int:
        self.pos += 1
        return self.buf[self.pos - 1]

    def varint(self) -> int:
        buf, pos = self.buf, self.pos
        out = shift = 0
        while True:
            b = buf[pos]
            pos += 1
            out |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                return out
            shift += 7
            if shift > 70:
                raise ThriftError("a varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise IndexError
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def value(self, ttype: int):
        if ttype in (I16, I32, I64):
            return self.zigzag()
        if ttype == STRUCT:
            return self.struct()
        if ttype == BINARY:
            return self.take(self.varint())
        if ttype in (LIST, SET):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            return TList(head & 0x0F, [self.value(head & 0x0F) for _ in range(size)])
        if ttype in (TRUE, FALSE):  # an element of a list: one byte, 1 for true
            return self.byte() == TRUE
        if ttype == I8:
            return int.from_bytes(self.take(1), "little", signed=True)
        if ttype == DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if ttype == MAP:
            size = self.varint()
            kinds = self.byte() if size else 0
            k, v = kinds >> 4, kinds & 0x0F
            return TMap(k, v, [(self.value(k), self.value(v)) for _ in range(size)])
        raise ThriftError(f"unknown Thrift compact type {ttype}")

    def struct(self) -> Struct:
        fields, fid, buf = {}, 0, self.buf
        while True:
            head = buf[self.pos]
            self.pos += 1
            if head == 0:
                return Struct(fields)
            ttype = head & 0x0F
            fid = fid + (head >> 4) if head >> 4 else self.zigzag()
            if ttype == TRUE or ttype == FALSE:  # a bool field's value is its type
                fields[fid] = (ttype, ttype == TRUE)
            else:
                fields[fid] = (ttype, self.value(ttype))


def decode(buf: bytes | memoryview) -> Struct:
    """A whole buffer holding one struct (a Parquet footer's FileMetaData)."""
    r = _Reader(buf)
    try:
        out = r.struct()
    except IndexError:
        raise ThriftError("a Thrift struct runs past its bytes") from None
    if r.pos != len(r.buf):
        raise ThriftError(f"{len(r.buf) - r.pos} bytes after the struct")
    return out


def decode_prefix(buf: bytes | memoryview) -> tuple[Struct, int]:
    """The struct at the start of buf (a Parquet page header before its page), and its length."""
    r = _Reader(buf)
    try:
        return r.struct(), r.pos
    except IndexError:
        raise ThriftError("a Thrift struct runs past its bytes") from None


# -- encoding -----------------------------------------------------------------------------------------
def _varint(n: int, out: bytearray) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int, out: bytearray) -> None:
    _varint((n << 1) ^ (n >> 63), out)


def _value(ttype: int, v, out: bytearray) -> None:
    if ttype in (TRUE, FALSE):
        out.append(TRUE if v else FALSE)
    elif ttype == I8:
        out += int(v).to_bytes(1, "little", signed=True)
    elif ttype in (I16, I32, I64):
        _zigzag(int(v), out)
    elif ttype == DOUBLE:
        out += struct.pack("<d", v)
    elif ttype == BINARY:
        _varint(len(v), out)
        out += v
    elif ttype in (LIST, SET):
        n = len(v.items)
        out.append((n << 4 | v.etype) if n < 15 else (0xF0 | v.etype))
        if n >= 15:
            _varint(n, out)
        for item in v.items:
            _value(v.etype, item, out)
    elif ttype == MAP:
        _varint(len(v.items), out)
        if v.items:
            out.append(v.ktype << 4 | v.vtype)
        for k, x in v.items:
            _value(v.ktype, k, out)
            _value(v.vtype, x, out)
    elif ttype == STRUCT:
        _struct(v, out)
    else:
        raise ThriftError(f"unknown Thrift compact type {ttype}")


def _struct(s: Struct | Encoded, out: bytearray) -> None:
    if isinstance(s, Encoded):
        out += s.data
        return
    last = 0
    for fid, (ttype, v) in s.fields.items():
        if ttype in (TRUE, FALSE):
            ttype = TRUE if v else FALSE
        if 0 < fid - last <= 15:
            out.append((fid - last) << 4 | ttype)
        else:
            out.append(ttype)
            _zigzag(fid, out)
        last = fid
        if ttype not in (TRUE, FALSE):
            _value(ttype, v, out)
    out.append(0)


def encode(s: Struct | Encoded) -> bytes:
    out = bytearray()
    _struct(s, out)
    return bytes(out)
