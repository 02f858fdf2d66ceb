"""The logits leaf of a shard, read straight from its Parquet pages.

Arrow rebuilds a list<float> column from its repetition and definition levels one element at
a time, and that alone costs about as much as the zstd decompression (benchmarks/
verify_throughput.py). A shard's lists are all full rows of one vocabulary with no nulls, so the
levels only have to say where rows start. This reader checks each page's CRC, decompresses it,
reads the row starts from the repetition levels (store/page_encoding.py decodes headers and
levels), and undoes byte-stream-split with numpy. It hands back the native bytes a row hash is
taken over, so `matrix verify` never widens bf16.

Anything it does not expect (a dictionary page, a null, another encoding or codec) raises
Unsupported; callers then read the row group through Arrow, which stays the authority.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from store.page_encoding import Corrupt, Unsupported, page_header, row_starts, split_levels, unsigned

PLAIN, RLE, BYTE_STREAM_SPLIT = 0, 3, 9
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# glibc hands a freed page buffer straight back; Arrow's mimalloc pool returns it to the OS and
# page-faults the next one in, and decompression slows (docs/benchmark-notes.md).
POOL = pa.system_memory_pool()
CODECS = {"ZSTD": "zstd", "SNAPPY": "snappy", "GZIP": "gzip", "LZ4": "lz4", "BROTLI": "brotli"}


@dataclass
class Leaf:
    """One row group's float leaf: each page's byte streams, and where each row starts."""

    pages: list[np.ndarray]  # per page (4, n) uint8: byte k of each of its n values (little-endian)
    starts: np.ndarray  # (rows,) index of each row's first value
    values: int

    def rows(self, kind: str, into: np.ndarray | None = None) -> np.ndarray:
        """(rows, vocab) in the native dtype (bf16: uint16 bits), for bf16 into `into`'s first
        values when given (a buffer the caller reuses: fresh memory costs its page faults). Raises
        Corrupt where a row is not a whole vocabulary or a widened value has low bits set."""
        n = len(self.starts)
        vocab = self.values // n if n else 0
        if n and (self.values % n or (self.starts != np.arange(n) * vocab).any()):
            raise Corrupt("rows of different lengths")
        if kind == "bf16" and into is not None:
            if into.dtype != np.uint16 or into.size < self.values or not into.flags.c_contiguous:
                raise ValueError(f"a buffer for {self.values} bf16 values, not {into.dtype} x {into.size}")
            out = into.reshape(-1)[: self.values]
        else:
            out = np.empty(self.values, np.uint16 if kind == "bf16" else np.uint32)
        at = 0
        # shifts and ors over whole streams: faster than a uint8 transpose (docs/benchmark-notes.md)
        for s in self.pages:
            o = out[at : at + s.shape[1]]
            if kind == "bf16":
                if np.count_nonzero(s[:2]):  # count_nonzero is SIMD; any() on uint8 is not
                    raise Corrupt("values are not bf16 (the low bits of a widened value are set)")
                o[:] = s[3]
                o <<= 8
                o |= s[2]
            else:
                o[:] = s[3]
                for k in (2, 1, 0):
                    o <<= 8
                    o |= s[k]
            at += s.shape[1]
        if kind == "bf16":
            return out.reshape(n, vocab)
        wide = out.view(np.float32).reshape(n, vocab)
        if kind == "f16":
            native = wide.astype(np.float16)
            if (native.astype(np.float32).view(np.uint32) != out.reshape(n, vocab)).any():
                raise Corrupt("values are not f16 (a widened value does not narrow exactly)")
            return native
        return wide


def _page_values(kind: int, hdr: dict, body: memoryview, codec, has_rep: bool, max_def: int):
    """One data page -> (row starts in the page, (4, n) byte streams)."""
    if kind == DATA_PAGE:
        dph = hdr[5]
        n, enc = dph[1], dph[2]
        raw = unsigned(codec.decompress(body, decompressed_size=hdr[2], memory_pool=POOL)) if codec else body
        rep, vals = split_levels(raw, has_rep, n, max_def)
    else:
        dph = hdr[8]
        n, nulls, enc, def_len, rep_len = dph[1], dph[2], dph[4], dph[5], dph[6]
        if nulls:
            raise Unsupported("a null or an empty list")
        rep = row_starts(body[:rep_len], n) if has_rep else np.arange(n)
        rest = body[rep_len + def_len :]
        vals = (
            unsigned(codec.decompress(rest, decompressed_size=hdr[2] - rep_len - def_len, memory_pool=POOL))
            if codec and dph.get(7, True)
            else rest
        )
    if enc not in (PLAIN, BYTE_STREAM_SPLIT):
        raise Unsupported(f"encoding {enc}")
    if len(vals) != 4 * n:
        raise Corrupt(f"a page of {n} values holds {len(vals)} bytes")
    arr = np.frombuffer(vals, np.uint8)
    # BSS keeps byte k of every value together; PLAIN interleaves them.
    streams = arr.reshape(4, n) if enc == BYTE_STREAM_SPLIT else arr.reshape(n, 4).T
    return rep, streams


def data_pages(read, start: int, end: int):
    """(kind, header, body) of each data page between byte offsets start and end, its CRC checked
    when it has one. read(n, pos) gives n bytes at pos: a slice of a chunk in memory, or an open
    file's read_at, so a stream holds one page at a time."""
    pos = start
    while pos < end:
        hdr, at = page_header(read, pos, end)
        kind, size = hdr.get(1), hdr.get(3)
        if size is None or at + size > end:
            raise Corrupt("a page runs past its column chunk")
        body = unsigned(read(size, at))
        pos = at + size
        if 4 in hdr and zlib.crc32(body) != hdr[4] & 0xFFFFFFFF:
            raise Corrupt("page CRC mismatch")
        if kind == DICTIONARY_PAGE:
            raise Unsupported("a dictionary page")
        if kind in (DATA_PAGE, DATA_PAGE_V2):  # an index page carries no values
            yield kind, hdr, body


def chunk_pages(chunk: pa.Buffer | bytes):
    """data_pages of a whole column chunk already in memory."""
    buf = unsigned(chunk)
    return data_pages(lambda n, pos: buf[pos : pos + n], 0, len(buf))


def codec(name: str):
    if name != "UNCOMPRESSED" and name not in CODECS:
        raise Unsupported(f"codec {name}")
    return pa.Codec(CODECS[name]) if name in CODECS else None


def read_leaf(chunk: pa.Buffer | bytes, codec_name: str, has_rep: bool, max_def: int, num_values: int) -> Leaf:
    """A float leaf's column chunk (every page of one row group) -> Leaf."""
    c = codec(codec_name)
    starts, streams, values = [], [], 0
    for kind, hdr, body in chunk_pages(chunk):
        rows, s = _page_values(kind, hdr, body, c, has_rep, max_def)
        starts.append(values + rows)
        streams.append(s)
        values += s.shape[1]
    if values != num_values:
        raise Corrupt(f"{values} values, the column chunk says {num_values}")
    return Leaf(streams, np.concatenate(starts) if len(starts) != 1 else starts[0], values)


def leaf_index(schema, path: str) -> int:
    """The index of the leaf column `path` (e.g. logits.list.element) in a Parquet schema."""
    for i in range(len(schema)):
        if schema.column(i).path == path:
            return i
    raise Unsupported(f"no leaf column {path}")


def column_chunk(f, metadata, group: int, leaf: int) -> pa.Buffer:
    """The bytes of one column chunk (its pages with their headers) from an open Arrow file."""
    c = metadata.row_group(group).column(leaf)
    start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
    return f.read_at(c.total_compressed_size, start)


def read_row_group_leaf(f, metadata, schema, group: int, leaf: int) -> Leaf:
    """Row group `group`'s leaf column `leaf` from an open Arrow file (local or object store)."""
    c, col = _float_leaf(metadata, schema, group, leaf)
    if col.max_repetition_level > 1:
        raise Unsupported("a nested list")
    return read_leaf(
        column_chunk(f, metadata, group, leaf),
        c.compression,
        col.max_repetition_level == 1,
        col.max_definition_level,
        c.num_values,
    )


def _float_leaf(metadata, schema, group: int, leaf: int):
    """(column chunk metadata, column schema) of a FLOAT leaf; Unsupported for any other type."""
    c, col = metadata.row_group(group).column(leaf), schema.column(leaf)
    if c.physical_type != "FLOAT":
        raise Unsupported(f"physical type {c.physical_type}")
    return c, col


class LeafStream:
    """Row group `group`'s float leaf read a page at a time from an open Arrow file: take(n)
    gives the next n rows in the native dtype. It holds one page plus what is left of the last
    one, so memory follows n, never the row group. Raises Unsupported at once for a column it
    does not handle (read it through Arrow), Corrupt for a bad page."""

    def __init__(self, f, metadata, schema, group: int, leaf: int, kind: str):
        c, col = _float_leaf(metadata, schema, group, leaf)
        rows = metadata.row_group(group).num_rows
        if col.max_repetition_level != 1 or c.has_dictionary_page or not rows or c.num_values % rows:
            raise Unsupported("not one full-vocabulary list per row")
        self.kind, self.codec = kind, codec(c.compression)
        self.max_def, self.vocab = col.max_definition_level, c.num_values // rows
        self.pages = data_pages(f.read_at, c.data_page_offset, c.data_page_offset + c.total_compressed_size)
        self.seen = 0  # values read from pages so far
        self.left: list[np.ndarray] = []  # (4, k) byte streams read but not yet taken

    def _page(self) -> None:
        page = next(self.pages, None)
        if page is None:
            raise Corrupt("the column chunk ended before its rows did")
        starts, s = _page_values(*page, self.codec, True, self.max_def)
        first = -(-self.seen // self.vocab) * self.vocab  # the first row start at or after seen
        want = np.arange(first, self.seen + s.shape[1], self.vocab)
        if len(starts) != len(want) or (self.seen + starts != want).any():
            raise Corrupt("rows of different lengths")
        self.seen += s.shape[1]
        self.left.append(s)

    def take(self, n: int, into: np.ndarray | None = None) -> np.ndarray:
        """The next n rows, (n, vocab) native (bf16: uint16 bits, into `into` as Leaf.rows)."""
        need = n * self.vocab
        while sum(s.shape[1] for s in self.left) < need:
            self._page()
        out, got = [], 0
        while got < need:
            s = self.left[0]
            k = min(s.shape[1], need - got)
            out.append(s[:, :k])
            got += k
            if k == s.shape[1]:
                self.left.pop(0)
            else:
                self.left[0] = s[:, k:]
        return Leaf(out, np.arange(n) * self.vocab, need).rows(self.kind, into)
