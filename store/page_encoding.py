"""A Parquet data page's encoding, decoded just far enough for store/pages.py: the Thrift compact
PageHeader, and the repetition and definition levels (the RLE / bit-packed hybrid) read run by run,
so a page's row starts come out without one Python step per value.
"""

from __future__ import annotations

import struct

import numpy as np

HEADER_WINDOW = 256  # bytes read for a page header; a logits page header is ~30 (no statistics)


class Unsupported(Exception):
    """A valid file this reader does not handle: read it through Arrow instead."""


class Corrupt(Exception):
    """A page that is not what its header or CRC says."""


# -- Thrift compact protocol: just enough to read a PageHeader ------------------------------------
class Thrift:
    def __init__(self, buf: memoryview, pos: int = 0):
        self.buf, self.pos = buf, pos

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.buf[self.pos]
            self.pos += 1
            out |= (b & 0x7F) << shift
            if b < 0x80:
                return out
            shift += 7
            if shift > 63:
                raise Corrupt("varint too long in a page header")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, ttype: int):
        if ttype in (1, 2):  # compact protocol keeps a bool field's value in its type
            return ttype == 1
        if ttype == 3:
            self.pos += 1
            return self.buf[self.pos - 1]
        if ttype in (4, 5, 6):
            return self.zigzag()
        if ttype == 7:
            self.pos += 8
            return None
        if ttype == 8:
            n = self.varint()
            self.pos += n
            return bytes(self.buf[self.pos - n : self.pos])
        if ttype in (9, 10):
            head = self.buf[self.pos]
            self.pos += 1
            size = head >> 4 if head >> 4 != 15 else self.varint()
            return [self.value(head & 0x0F) for _ in range(size)]
        if ttype == 11:
            size = self.varint()
            kinds = self.buf[self.pos] if size else 0
            self.pos += 1 if size else 0
            return {self.value(kinds >> 4): self.value(kinds & 0x0F) for _ in range(size)}
        if ttype == 12:
            return self.struct()
        raise Corrupt(f"unknown thrift type {ttype} in a page header")

    def struct(self) -> dict[int, object]:
        out, fid = {}, 0
        while True:
            head = self.buf[self.pos]
            self.pos += 1
            if head == 0:
                return out
            fid = fid + (head >> 4) if head >> 4 else self.zigzag()
            out[fid] = self.value(head & 0x0F)


def unsigned(b) -> memoryview:
    """Unsigned bytes: Arrow buffers export signed chars, and 0xfe must read as 254."""
    return memoryview(b).cast("B")


# -- levels: the RLE / bit-packed hybrid, read run by run -------------------------------------------
def level_runs(buf: memoryview, width: int, count: int, small: int = 0):
    """(offset, length, value) per RLE run and (offset, length, values) per bit-packed run of the
    first `count` levels. A shard row is ~2 runs (a packed group holding its 0, then a run of 1s),
    so nothing here grows with the vocabulary. Width-1 packed runs of at most `small` bytes come
    as (bits as an int, their number)."""
    t, have, nbytes = Thrift(buf), 0, (width + 7) // 8
    while have < count:
        if t.pos >= len(buf):
            raise Corrupt(f"levels end after {have} of {count} values")
        head = t.varint()
        if head & 1 and width == 1 and head >> 1 <= small:
            n = head >> 1
            yield have, min(8 * n, count - have), (int.from_bytes(buf[t.pos : t.pos + n], "little"), 8 * n)
            t.pos += n
            have += 8 * n
        elif head & 1:  # bit-packed: groups of 8 values, `width` bytes per group
            n = (head >> 1) * width
            bits = np.unpackbits(np.frombuffer(buf[t.pos : t.pos + n], np.uint8), bitorder="little")
            vals = bits.reshape(-1, width) @ (1 << np.arange(width)) if width > 1 else bits
            t.pos += n
            yield have, min(len(vals), count - have), vals[: count - have]
            have += len(vals)
        else:
            v = int.from_bytes(buf[t.pos : t.pos + nbytes], "little")
            t.pos += nbytes
            yield have, min(head >> 1, count - have), v
            have += head >> 1


def row_starts(buf: memoryview, count: int) -> np.ndarray:
    """Where the repetition levels (width 1) are 0: the first value of each row. A row's 0 sits in
    a packed group of a byte or two, so those are read with int bit tricks, not numpy calls."""
    small, arrays = [], []
    for at, n, v in level_runs(buf, 1, count, small=8):
        if isinstance(v, int):
            if v == 0:
                arrays.append(np.arange(at, at + n))
        elif isinstance(v, tuple):  # (packed bits as an int, their number)
            inv = ~v[0] & ((1 << n) - 1)
            while inv:
                low = inv & -inv
                small.append(at + low.bit_length() - 1)
                inv ^= low
        else:
            arrays.append(at + np.flatnonzero(v == 0))
    if small:
        arrays.append(np.array(small))
    return np.sort(np.concatenate(arrays)) if len(arrays) > 1 else arrays[0] if arrays else np.zeros(0, np.int64)


def all_equal(buf: memoryview, width: int, count: int, value: int) -> bool:
    return all(
        (v == value).all() if isinstance(v, np.ndarray) else v == value for _, _, v in level_runs(buf, width, count)
    )


def split_levels(body: memoryview, has_rep: bool, n: int, max_def: int) -> tuple[np.ndarray, memoryview]:
    """A v1 page body -> (row starts in the page, the values' bytes); refuses nulls."""
    starts, pos = None, 0
    if has_rep:
        (size,) = struct.unpack_from("<I", body, pos)
        starts = row_starts(body[pos + 4 : pos + 4 + size], n)
        pos += 4 + size
    if max_def:
        (size,) = struct.unpack_from("<I", body, pos)
        if not all_equal(body[pos + 4 : pos + 4 + size], max_def.bit_length(), n, max_def):
            raise Unsupported("a null or an empty list")
        pos += 4 + size
    return (np.arange(n) if starts is None else starts), body[pos:]  # no repetition: a value is a row


def page_header(read, pos: int, end: int) -> tuple[dict, int]:
    """The page header at pos and where its body starts, read a small window at a time."""
    size = HEADER_WINDOW
    while True:
        buf = unsigned(read(min(size, end - pos), pos))
        try:
            t = Thrift(buf)
            hdr = t.struct()
            if t.pos > len(buf):  # a field ran past the window
                raise IndexError
            return hdr, pos + t.pos
        except (IndexError, struct.error, ValueError):
            if size >= end - pos or size > 1 << 20:
                raise Corrupt("a page header runs past its column chunk") from None
            size *= 16
