"""How a shard's rows are encoded: the Parquet settings every logits shard and its parts share, and
a prompt's logits encoded in slices of rows at once on a thread pool, for ShardWriter
(store/shards.py) to splice into the prompt's one row group (store/parquet_splice.py).

Parquet's write of the logits column (byte-stream-split and zstd over 4 bytes a logit) is most of
a store's work (~85% of it on one core), and one pyarrow writer runs on one core. So a prompt's
rows are cut into slices of SLICE_VALUES values (whole rows), and each slice, on one of
store_threads() threads (a pool's and the caller's), has its rows hashed (sha256 of the native
bytes) and encoded as a small Parquet file of the logits column alone, the very file pyarrow's
writer gives, written page by page without its per-value level work (store/logits_pages.py);
hashlib, numpy and zstd let go of the GIL while they work, so the slices run on separate cores.
The caller also encodes the small columns (a few bytes a row) and writes each slice's pages to
the shard's file in row order as the slice is done. 2 threads store ~1.75x the rows a second
of one on a 2-core AMD EPYC (benchmarks/store_scaling.py, docs/benchmark-notes.md).

Why so:
- One row group per prompt stays: readers find a prompt by its row group (store/stream.py,
  store/pages.py, store/verify.py), and pages of one column chunk stand alone, so the slices'
  pages laid end to end are that chunk, each page with its own levels, encoding and CRC.
- Slices are cut by the rows' shape, never by the thread count: a shard's bytes are the same
  whatever the number of threads (tested). Each slice ends a page early: the file is within 0.02%
  of one writer's size. A prompt's last two slices are cut in quarters, so the threads finish it
  together rather than one working alone on its last slice.
- A slice is encoded into an output buffer kept from slice to slice (given back once written),
  not fresh memory: fresh buffers cost page faults and, across threads, TLB flushes (~13% of a
  2-thread store's time).
- The caller encodes slices too while it waits for the one it is to write next (Flight): as many
  busy threads as cores, none woken beside them to write.
- Rows without values, layer states and rows another node encoded keep one pyarrow writer a row
  group: there are no logits to spread.

LOGIT_MATRIX_STORE_THREADS sets the threads (a benchmark's sweep); else the CPUs the C kernels
use (common.native.threads: LOGIT_MATRIX_KERNEL_THREADS or OMP_NUM_THREADS caps them).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.buffers import room
from common.native import threads as cpu_threads
from common.output import log
from store.logits_pages import Layout, OtherPages, PageWriter
from store.schema import LOGITS
from store.values import ZSTD_LEVEL, row_hash, widen

# Byte-stream-split needs the leaf path of a list column; the flag alone ignores it.
LOGITS_LEAF = "logits.list.element"
DICTIONARY = ["run_id", "cell_id", "prompt_id", "logits_dtype"]  # repeated strings
STATISTICS = ["position", "repeat", "next_token_id"]  # min/max a reader may filter on
SLICE_VALUES = 1 << 20  # values a slice holds at most (4 MiB widened): 21 rows at a 49,152 vocabulary
THREADS_ENV = "LOGIT_MATRIX_STORE_THREADS"  # threads a shard's slices are encoded on (a benchmark sets it)
SLICE_SCHEMA = pa.schema([LOGITS.field("logits")])
_AT = LOGITS.get_field_index("logits")
HEAD_SCHEMA = pa.schema(list(LOGITS)[:_AT])  # the columns before the logits, and after them
TAIL_SCHEMA = pa.schema(list(LOGITS)[_AT + 1 :])


def store_threads(threads: int | None = None) -> int:
    """threads when given, else LOGIT_MATRIX_STORE_THREADS, else the CPUs this process may use
    (common.native.threads: capped by LOGIT_MATRIX_KERNEL_THREADS or OMP_NUM_THREADS)."""
    if threads is None:
        env = os.environ.get(THREADS_ENV, "")
        threads = int(env) if env.isdigit() else cpu_threads()
    return max(1, threads)


def logits_writer(where, schema: pa.Schema) -> pq.ParquetWriter:
    """A writer of a shard's columns in schema (all of LOGITS, or a part of them), each column with
    its shard settings: the same for the whole file and for each piece spliced into one."""
    return pq.ParquetWriter(
        where,
        schema,
        compression="zstd",
        compression_level=ZSTD_LEVEL,
        use_dictionary=DICTIONARY,
        use_byte_stream_split=[LOGITS_LEAF],
        write_statistics=STATISTICS,
        write_page_checksum=True,
    )  # a flipped byte fails its page's CRC on read (store/verify.py)


def by_row(rows: pa.Table) -> pa.Table:
    """rows with each list column (a row's logits or states) in one-row chunks, the same values.
    Parquet's writer builds a chunk's repetition and definition levels (two int16 per value) in
    buffers it grows by copying; a prompt's rows at once (67M values at a 262,144 vocabulary)
    outgrow the caches, one row at a time they do not: the same file's bytes, faster
    (docs/benchmark-notes.md)."""
    for i, field in enumerate(rows.schema):
        col = rows.column(i)
        if pa.types.is_list(field.type) and col.num_chunks < rows.num_rows:
            one = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()  # combining copies even one chunk
            rows = rows.set_column(i, field, pa.chunked_array([one.slice(r, 1) for r in range(len(one))], field.type))
    return rows


def encode_part(rows: pa.Table) -> pa.Buffer:
    """rows (a LOGITS table or a part of its columns) as a small Parquet file of one row group
    (in Arrow's memory: a copy into Python bytes would cost its page faults)."""
    sink = pa.BufferOutputStream()
    w = logits_writer(sink, rows.schema)
    w.write_table(by_row(rows))
    w.close()
    return sink.getvalue()


def write_pyarrow_slice(wide: np.ndarray, sink) -> None:
    """(rows, vocab) float32 -> sink (an Arrow output stream): the slice file pyarrow's writer gives."""
    w = logits_writer(sink, SLICE_SCHEMA)
    w.write_table(by_row(pa.table({"logits": list_column(wide)}, schema=SLICE_SCHEMA)))
    w.close()


def pyarrow_slice(wide: np.ndarray) -> bytes:
    """The bytes of write_pyarrow_slice's file: what PageWriter writes."""
    sink = pa.BufferOutputStream()
    write_pyarrow_slice(wide, sink)
    return sink.getvalue().to_pybytes()


_LAYOUTS: dict[int, Layout | None] = {}
_LAYOUTS_LOCK = threading.Lock()


def layout(vocab: int) -> Layout | None:
    """The page layout of a vocabulary's slices, read once a process from pyarrow's own files;
    None where this pyarrow ends its pages elsewhere (its writer then writes the slices)."""
    with _LAYOUTS_LOCK:
        if vocab not in _LAYOUTS:
            try:
                _LAYOUTS[vocab] = Layout(vocab, pyarrow_slice, ZSTD_LEVEL)
            except OtherPages as e:
                _LAYOUTS[vocab] = None
                _say_other_pages(vocab, e)
        return _LAYOUTS[vocab]


def list_column(wide: np.ndarray) -> pa.ListArray:
    """(rows, vocab) float32 -> a list<float32> array over the same memory."""
    n, vocab = wide.shape
    flat = pa.array(wide.reshape(-1), type=pa.float32())  # (rows * vocab,), no copy
    return pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * vocab, vocab, dtype=np.int32)), flat)


def slice_bounds(rows: int, vocab: int) -> list[tuple[int, int]]:
    """[first, end) rows of each slice of a prompt: SLICE_VALUES values (whole rows), the last two
    slices' rows in quarters, so the threads finish a prompt together (one thread alone on the last
    slice idles the others for half of it). Fixed by the shape alone, never the thread count."""
    per = max(1, SLICE_VALUES // vocab)  # rows a slice
    tail = max(0, rows - 2 * per)  # where the quarter slices start
    small = max(1, per // 4)
    return [(a, min(a + per, tail)) for a in range(0, tail, per)] + [
        (a, min(a + small, rows)) for a in range(tail, rows, small)
    ]


def slice_bound(values: int) -> int:
    """Bytes a slice's Parquet file of `values` floats takes at most: 4 a value, its repetition and
    definition levels under 3 bits (bit widths 1 and 2), zstd's worst case 1/256 more, a page
    header of under 100 bytes per 1 MiB page, and a footer of a few KiB. A file that did not fit
    would fail its write (FixedSizeBufferWriter refuses to write past its buffer's end)."""
    return values * 9 // 2 + (1 << 17)


@dataclass
class Slice:
    """One slice's rows encoded: their row hashes, and its Parquet file in `buf`'s first bytes."""

    hashes: list[str]
    buf: np.ndarray  # (capacity,) uint8, the SliceEncoder's: give it back with release()
    size: int

    @property
    def data(self) -> memoryview:
        return memoryview(self.buf)[: self.size]


class Flight:
    """One prompt's slices in flight: claimed in row order, each encoded once, by the pool's
    threads and by the caller while it waits for the slice it is to write next. The caller
    working too keeps as many threads busy as there are cores, where a caller asleep beside a
    full pool would wake to write and take a core from an encoding thread (a few % slower at 2
    threads: docs/benchmark-notes.md)."""

    def __init__(self, encode: Callable[[int, int], Slice], bounds: list[tuple[int, int]]):
        self.encode, self.bounds = encode, bounds
        self.claimed, self.lock = 0, threading.Lock()
        self.done = [threading.Event() for _ in bounds]
        self.out: list[Slice | BaseException | None] = [None] * len(bounds)

    def _claim(self) -> int | None:
        with self.lock:
            if self.claimed >= len(self.bounds):
                return None
            self.claimed += 1
            return self.claimed - 1

    def _run(self, i: int) -> None:
        try:
            self.out[i] = self.encode(*self.bounds[i])
        except BaseException as e:  # raised where the caller takes slice i (take)
            self.out[i] = e
        finally:
            self.done[i].set()

    def drain(self) -> None:
        """A pool thread's work: slices until none is left to claim."""
        while (i := self._claim()) is not None:
            self._run(i)

    def take(self, i: int) -> Slice:
        """Slice i, encoding others meanwhile while there are any; its failure raises here."""
        while not self.done[i].is_set() and (j := self._claim()) is not None:
            self._run(j)
            if isinstance(self.out[j], BaseException) and not isinstance(self.out[j], Exception):
                raise self.out[j]  # the caller interrupted (KeyboardInterrupt): at once
        self.done[i].wait()
        out = self.out[i]
        if isinstance(out, BaseException):
            raise out
        return out

    def stop(self) -> None:
        """No slice is claimed from here on (the caller gave up on the prompt)."""
        with self.lock:
            self.claimed = len(self.bounds)


class SliceEncoder:
    """A prompt's logits encoded in slices on `threads` threads: the caller's and a pool of the
    others. Each thread has a page buffer of its own (and a widening buffer for a dtype it
    widens), and each slice is encoded into an output buffer the caller gives back once it has
    written it: memory kept from slice to slice (fresh memory costs its page faults and, across
    threads, TLB flushes: docs/benchmark-notes.md)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._flight: tuple[Flight, list[Future]] | None = None  # the last start()'s, and its pool work
        self._local = threading.local()  # .pages: this thread's PageWriter; .wide: its widening buffer
        self._free: list[np.ndarray] = []  # output buffers given back, ready for the next slices
        self._lock = threading.Lock()

    def start(self, native: np.ndarray) -> list[Callable[[], Slice]]:
        """native: (rows, vocab), rows * vocab > 0. Each slice's task in row order, the pool
        already at work on them: calling one gives its Slice (the caller encoding slices itself
        until it is done). Call settle() after."""
        bounds = slice_bounds(*native.shape)
        flight = Flight(partial(self._slice, native), bounds)
        helpers = min(self.threads, len(bounds)) - 1
        if helpers and self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="shard-store")
        self._flight = (flight, [self._pool.submit(flight.drain) for _ in range(helpers)])
        return [partial(flight.take, i) for i in range(len(bounds))]

    def settle(self) -> None:
        """Waits out the pool's work on the last start()'s slices, taken or not: the caller may
        reuse its rows once this returns (also after an exception)."""
        if self._flight is not None:
            flight, work = self._flight
            self._flight = None
            flight.stop()
            wait(work)

    def release(self, s: Slice) -> None:
        """s's buffer is free again (its bytes written): a few are kept for the next slices."""
        with self._lock:
            if len(self._free) < 2 * self.threads + 2:
                self._free.append(s.buf)

    def _buffer(self, size: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.size >= size:
                    return self._free.pop(i)
        return np.empty(size, np.uint8)

    def _slice(self, native: np.ndarray, a: int, b: int) -> Slice:
        """Rows a..b of native hashed and encoded (on whichever thread claimed them): float32 and
        bf16 bits as they are, any other dtype widened to float32 first."""
        rows = native[a:b]  # (rows, vocab) native
        hashes = [row_hash(r) for r in rows]
        if rows.dtype not in (np.float32, np.uint16):
            rows = self._widened(rows)
        buf = self._buffer(slice_bound(rows.size))
        pages = self._pages(rows.shape[1])
        if pages is not None:
            try:
                return Slice(hashes, buf, pages.write(rows, buf))
            except OtherPages as e:  # a page size whose levels pyarrow writes otherwise: its writer from now on
                _other_pages(rows.shape[1], e)
                self._local.pages = None
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(buf))
        write_pyarrow_slice(self._widened(rows), sink)
        return Slice(hashes, buf, sink.tell())

    def _widened(self, rows: np.ndarray) -> np.ndarray:
        """rows as float32, widened into this thread's buffer (float32 rows are themselves)."""
        if rows.dtype != np.float32:
            self._local.wide = room(getattr(self._local, "wide", None), rows.size)
        return widen(rows, getattr(self._local, "wide", None))

    def _pages(self, vocab: int) -> PageWriter | None:
        """This thread's page writer for the vocabulary (its body buffer is its own), or None
        where pyarrow's pages do not end where PageWriter's would (another pyarrow's rule)."""
        pages = getattr(self._local, "pages", None)
        if pages is None or pages.layout.vocab != vocab:
            found = layout(vocab)
            pages = self._local.pages = None if found is None else PageWriter(found)
        return pages

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _other_pages(vocab: int, e: OtherPages) -> None:
    """This vocabulary's slices go through pyarrow's writer from now on, said once on stderr."""
    with _LAYOUTS_LOCK:
        said = vocab in _LAYOUTS and _LAYOUTS[vocab] is None
        _LAYOUTS[vocab] = None
    if not said:
        _say_other_pages(vocab, e)


def _say_other_pages(vocab: int, e: OtherPages) -> None:
    log(f"shard pages at a vocabulary of {vocab}: pyarrow's writer writes them ({e})")
