"""A slice of logits rows written as the small Parquet file pyarrow's writer gives for it (store/
shard_encoding.py's settings: byte-stream-split, zstd, page CRCs), byte for byte, without the
writer's per-value work.

Parquet's list<float32> writer builds two levels (int16) for every value and runs them through
its RLE encoder before the values are split and compressed: at 262,144 logits a row, ~0.15 ms of
a stored row's ~1.9 ms of CPU, where zstd and the row hash are most of it (docs/benchmark-notes.md).
A shard's lists are full rows of one vocabulary with no nulls, so a page's levels depend only on
how many rows it holds: they
are taken once per (vocabulary, rows a page) from pyarrow's own file of rows of zeros, and each
page is then those level bytes and the values' byte streams, compressed, with its CRC. The page
header and the footer are pyarrow's, decoded once per vocabulary and re-encoded with each page's
sizes (store/thrift_compact.py encodes what it decodes to the same bytes).

Pages end where pyarrow's do: after the first row that brings the page's values to PAGE_BYTES
(its default data page size), or after PAGE_ROWS rows. tests/test_logits_pages.py holds the two
to the same bytes over vocabularies below, at and above a page a row, for bf16 and float32 rows.

Data page v1 (Parquet's format, https://github.com/apache/parquet-format): the body is the
repetition levels, the definition levels (each a 4-byte length and RLE/bit-packed runs), then
the values, compressed as one. PageHeader: 1 type, 2 uncompressed size, 3 compressed size, 4 CRC-32
of the compressed body, 5 DataPageHeader (1 num_values).
"""

from __future__ import annotations

import struct
import threading
import zlib
from typing import Callable

import numpy as np
import pyarrow as pa

from store.parquet_splice import MAGIC, footer
from store.thrift_compact import I32, I64, LIST, STRUCT, Struct, TList, decode_prefix, encode

PAGE_BYTES = 1 << 20  # pyarrow's data_page_size: a page ends after the row whose values reach it
PAGE_ROWS = 20_000  # pyarrow's max_rows_per_page: or after this many rows (vocabularies under 14)


class OtherPages(Exception):
    """pyarrow ended a page somewhere else than this module would (another version's rule)."""


def rows_a_page(vocab: int) -> int:
    """Rows in a full page: the fewest whose 4-byte values reach PAGE_BYTES, at most PAGE_ROWS."""
    return min(PAGE_ROWS, max(1, -(-PAGE_BYTES // (4 * vocab))))


def page_header(data, pos: int) -> tuple[Struct, int]:
    """The page header at pos and where its page's body starts."""
    hdr, n = decode_prefix(memoryview(data)[pos : pos + 4096])
    return hdr, pos + n


def _signed(crc: int) -> int:
    return crc - (1 << 32) if crc >= 1 << 31 else crc


class Layout:
    """What pyarrow writes around one vocabulary's values: its page header, its footer, and each
    page size's levels, read from its files of rows of zeros."""

    def __init__(self, vocab: int, pyarrow_file: Callable[[np.ndarray], bytes], level: int):
        """pyarrow_file((rows, vocab) float32) -> pyarrow's slice file of those rows. Raises
        OtherPages where pyarrow's first page of one row more than a full page is not that page."""
        self.vocab, self.pyarrow_file = vocab, pyarrow_file
        self.codec = pa.Codec("zstd", level)
        self.lock = threading.Lock()
        full = rows_a_page(vocab)
        data = pyarrow_file(np.zeros((full + 1, vocab), np.float32))
        self.meta = footer(data)
        self.chunk = self.meta.get(4).items[0].get(1).items[0]
        self.header, _ = page_header(data, self.chunk.get(3).get(9))
        self.levels_of = {full: self._first_levels(data, full)}
        self._check(data, full + 1)

    def _check(self, want: bytes, rows: int) -> None:
        """PageWriter's file of `rows` rows of zeros is pyarrow's (`want`) byte for byte, else
        OtherPages: a pyarrow whose header, footer or levels differ from those this module writes."""
        out = np.zeros(len(want) + 4096, np.uint8)
        try:
            got = out[: PageWriter(self).write(np.zeros((rows, self.vocab), np.float32), out)].tobytes()
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a field this module sets is not there
            raise OtherPages(f"pyarrow's slice file has other fields ({type(e).__name__}: {e})") from e
        if got != want:
            raise OtherPages(f"pyarrow's file of {rows} rows of {self.vocab} zeros is not the one written here")

    def levels(self, rows: int) -> bytes:
        """The level bytes of a page of `rows` full rows (at most a full page's), as pyarrow writes them."""
        got = self.levels_of.get(rows)
        if got is not None:
            return got
        with self.lock:  # pyarrow writes a page size's zero rows once, whichever thread asks first
            if rows not in self.levels_of:
                self.levels_of[rows] = self._first_levels(
                    self.pyarrow_file(np.zeros((rows, self.vocab), np.float32)), rows
                )
            return self.levels_of[rows]

    def _first_levels(self, data: bytes, rows: int) -> bytes:
        """The levels of the first page of pyarrow's file `data`, which must hold `rows` rows."""
        meta = footer(data).get(4).items[0].get(1).items[0].get(3)
        hdr, at = page_header(data, meta.get(9))
        values = rows * self.vocab
        if hdr.get(5).get(1) != values:
            raise OtherPages(f"pyarrow's first page holds {hdr.get(5).get(1)} logits, not {rows} rows of {self.vocab}")
        body = self.codec.decompress(data[at : at + hdr.get(3)], hdr.get(2), asbytes=True)
        return body[: len(body) - 4 * values]


def _put(out: np.ndarray, pos: int, data) -> int:
    """data's bytes into out at pos; -> where they end. Refused past out's end (slice_bound sizes it)."""
    end = pos + len(data)
    if end > out.size:
        raise ValueError(f"a slice's Parquet file outgrows its buffer of {out.size} bytes")
    out[pos:end] = np.frombuffer(data, np.uint8)
    return end


def split_streams(native: np.ndarray, out: np.ndarray) -> None:
    """out (4, n) uint8: byte k of each value of native widened to float32 (little-endian), as
    byte-stream-split lays them out. bf16 (uint16 bits) widens to bits << 16: its low two streams
    are zeros."""
    if native.dtype == np.uint16:
        b = native.reshape(-1).view(np.uint8).reshape(-1, 2)
        out[:2] = 0
        out[2] = b[:, 0]
        out[3] = b[:, 1]
        return
    if native.dtype != np.float32:
        raise ValueError(f"logits of dtype {native.dtype}: float32 or bf16 bits are written")
    b = native.reshape(-1).view(np.uint8).reshape(-1, 4)
    for k in range(4):
        out[k] = b[:, k]


class PageWriter:
    """A slice's file for one vocabulary; one per thread (its body buffer is its own)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.body = np.zeros(0, np.uint8)

    def write(self, native: np.ndarray, out: np.ndarray) -> int:
        """native (rows, vocab) float32 or bf16 bits -> the file's bytes at out's start; its size."""
        rows, vocab = native.shape
        lay, per = self.layout, rows_a_page(vocab)
        out[:4] = np.frombuffer(MAGIC, np.uint8)
        pos, unc, comp, pages = 4, 0, 0, 0
        for a in range(0, rows, per):
            k = min(per, rows - a)
            levels, n = lay.levels(k), k * vocab
            size = len(levels) + 4 * n
            if self.body.size < size:
                self.body = np.empty(size, np.uint8)
            body = self.body[:size]
            body[: len(levels)] = np.frombuffer(levels, np.uint8)
            split_streams(native[a : a + k], body[len(levels) :].reshape(4, n))
            packed = lay.codec.compress(body, asbytes=False)
            head = encode(self._page(size, packed.size, zlib.crc32(packed), n))
            pos = _put(out, _put(out, pos, head), packed)
            unc, comp, pages = unc + len(head) + size, comp + len(head) + packed.size, pages + 1
        tail = encode(self._footer(rows, vocab, unc, comp, pages))
        return _put(out, _put(out, pos, tail), struct.pack("<I", len(tail)) + MAGIC)

    def _page(self, size: int, packed: int, crc: int, values: int) -> Struct:
        hdr = self.layout.header.copy()
        hdr.set(2, I32, size)
        hdr.set(3, I32, packed)
        hdr.set(4, I32, _signed(crc))
        data = hdr.get(5).copy()
        data.set(1, I32, values)
        hdr.set(5, STRUCT, data)
        return hdr

    def _footer(self, rows: int, vocab: int, unc: int, comp: int, pages: int) -> Struct:
        lay = self.layout
        meta = lay.chunk.get(3).copy()
        meta.set(5, I64, rows * vocab)
        meta.set(6, I64, unc)
        meta.set(7, I64, comp)
        stats = meta.get(13).items[0].copy()
        stats.set(3, I32, pages)
        meta.set(13, LIST, TList(STRUCT, [stats]))
        sizes = meta.get(16).copy()
        sizes.set(2, LIST, TList(I64, [rows, rows * vocab - rows]))
        sizes.set(3, LIST, TList(I64, [*sizes.get(3).items[:-1], rows * vocab]))
        meta.set(16, STRUCT, sizes)
        chunk = lay.chunk.copy()
        chunk.set(3, STRUCT, meta)
        group = lay.meta.get(4).items[0].copy()
        group.set(1, LIST, TList(STRUCT, [chunk]))
        group.set(2, I64, unc)
        group.set(3, I64, rows)
        group.set(6, I64, comp)
        out = lay.meta.copy()
        out.set(3, I64, rows)
        out.set(4, LIST, TList(STRUCT, [group]))
        return out
