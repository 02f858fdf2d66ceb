"""A shard read in pieces: its small columns once (the index), then one prompt's logits a few
rows at a time, each row checked against its row_hash as it arrives.

This is how `matrix analyze` reads: memory follows the rows asked for at once, never the
length of a prompt or of the corpus.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.buffers import room
from common.errors import UserError, first_line
from store import pages
from store.schema import keeps_values
from store.values import Bf16Rows, rows_at
from store.verify import DamagedShard, native_check
from store.warehouse import LOGITS_LEAF, Warehouse, logits_matrix, unshift, values_not_kept, widen

SEE_VERIFY = "run `matrix verify`, or `matrix analyze --skip-damaged` to leave it out"
SMALL = ["prompt_id", "position", "next_token_id", "logits_dtype", "row_hash"]
READ_BUFFER = 4 << 20  # bytes per read of a column chunk: a prompt's pages are never held whole


@dataclass
class Prompt:
    """One prompt's rows in a shard: a run of rows of one row group (our writer: the whole group),
    or of consecutive row groups, each of this prompt alone after the first (a node that cannot see
    the warehouse sends a long prompt in several: actors/depot.py)."""

    group: int  # its first row group
    offset: int  # its first row within the row group
    positions: np.ndarray  # (rows,) int64
    next_ids: np.ndarray  # (rows,) int64, -1 where there is no next token
    hashes: list[str]
    kind: str  # native dtype of the rows
    shift: np.ndarray | None = None  # (rows,) float32 subtracted before storing (`store: bf16`), else None
    more: tuple[int, ...] = ()  # the row groups it goes on into, in order

    @property
    def groups(self) -> list[int]:
        return [self.group, *self.more]


@dataclass
class ShardIndex:
    path: str
    cell_id: str
    repeat: int
    prompts: dict[str, Prompt]
    digest: str  # sha256 over every (prompt, position, row_hash): what the shard holds
    rows: int
    vocab: int  # 0 for a shard without rows
    metadata: pq.FileMetaData  # the footer, read once for every reader of the shard
    leaf: int  # the logits leaf column
    values: bool = True  # False: rows hashed, their values not kept (store/schema.py VALUES_KEY)


def _damaged(path: str, e: Exception) -> DamagedShard:
    return DamagedShard(f"{path}: damaged ({first_line(str(e), type(e).__name__)}); {SEE_VERIFY}")


def shard_index(wh: Warehouse, cell_id: str, repeat: int) -> ShardIndex:
    """A shard's small columns, by prompt: no logits are read."""
    path = wh.shard_path(cell_id, repeat)
    try:
        pf = pq.ParquetFile(path, filesystem=wh.loc.fs, page_checksum_verification=True)
        leaf = pages.leaf_index(pf.schema, LOGITS_LEAF)
        kept = keeps_values(pf.schema_arrow)
        prompts, h, vocabs, last = {}, hashlib.sha256(), set(), None  # last: (prompt, group, ran to its end)
        for g in range(pf.num_row_groups):
            md = pf.metadata.row_group(g)
            if md.num_rows and kept:
                vocabs.add(md.column(leaf).num_values // md.num_rows)
            t = pf.read_row_group(
                g, columns=SMALL + (["shift"] if "shift" in pf.schema_arrow.names else [])
            ).to_pydict()
            ids = t["prompt_id"]
            for a, b in _runs(ids):
                pid = ids[a]
                if len(set(t["logits_dtype"][a:b])) > 1:
                    raise ValueError(f"prompt {pid} mixes native dtypes")
                if pid in prompts:
                    _go_on(prompts, pid, g, a, b, md.num_rows, t, last)
                    last = (pid, g, b == md.num_rows)
                    continue
                last = (pid, g, b == md.num_rows)
                prompts[pid] = Prompt(
                    g,
                    a,
                    np.array(t["position"][a:b], np.int64),
                    np.array([-1 if v is None else v for v in t["next_token_id"][a:b]], np.int64),
                    t["row_hash"][a:b],
                    t["logits_dtype"][a],
                    _shift(t.get("shift"), a, b),
                )
            for pid, q, rh in zip(ids, t["position"], t["row_hash"]):
                h.update(f"{pid}\0{q}\0{rh}\n".encode())
    except (OSError, pa.ArrowException, ValueError, pages.Unsupported) as e:
        raise _damaged(path, e) from None
    if len(vocabs) > 1:
        raise UserError(f"{path}: rows of different vocabulary sizes {sorted(vocabs)} in one shard")
    h.update(f"vocab\0{sorted(vocabs)}".encode())  # a row's length is content too (a rewrite may keep stale hashes)
    return ShardIndex(
        path,
        cell_id,
        repeat,
        prompts,
        h.hexdigest(),
        sum(len(p.positions) for p in prompts.values()),
        vocabs.pop() if vocabs else 0,
        pf.metadata,
        leaf,
        kept,
    )


def _go_on(prompts: dict, pid: str, g: int, a: int, b: int, rows: int, t: dict, last) -> None:
    """Rows a..b of row group g that carry prompt pid on: only where its rows so far ended their
    row group, the one before, and these are the whole of group g."""
    p = prompts[pid]
    if last != (pid, p.groups[-1], True) or g != p.groups[-1] + 1 or (a, b) != (0, rows):
        raise ValueError(f"prompt {pid} is split across row groups that do not follow each other")
    if t["logits_dtype"][a] != p.kind:
        raise ValueError(f"prompt {pid} mixes native dtypes")
    nxt = [-1 if v is None else v for v in t["next_token_id"][a:b]]
    p.positions = np.concatenate([p.positions, np.array(t["position"][a:b], np.int64)])
    p.next_ids = np.concatenate([p.next_ids, np.array(nxt, np.int64)])
    p.hashes = p.hashes + t["row_hash"][a:b]
    shift = _shift(t.get("shift"), a, b)
    if (p.shift is None) != (shift is None):
        raise ValueError(f"prompt {pid} has rows stored two ways (shifted and not)")
    p.shift = None if shift is None else np.concatenate([p.shift, shift])
    p.more = (*p.more, g)


def _shift(col: list | None, a: int, b: int) -> np.ndarray | None:
    """A prompt's row shifts, or None where the rows were stored as produced (null, or a pre-v8 shard)."""
    if col is None or all(v is None for v in col[a:b]):
        return None
    return np.array([v or 0.0 for v in col[a:b]], np.float32)


def _runs(ids: list) -> list[tuple[int, int]]:
    """[start, end) of each run of equal values."""
    cut = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
    return [(a, b) for a, b in zip(cut, cut[1:]) if b > a]


class Scratch:
    """Buffers a reader puts its batches into (widened, or bf16 bits as stored), kept from prompt to
    prompt by the one caller that owns them: fresh memory for every batch costs its page faults (at
    a 262,144 vocabulary as much as the widening). Two, used in turn: a batch may still hold rows
    while the next is read."""

    def __init__(self):
        self.bufs, self.turn = [np.empty(0, np.float32), np.empty(0, np.float32)], 0

    def next(self, size: int) -> np.ndarray:
        self.turn ^= 1
        self.bufs[self.turn] = room(self.bufs[self.turn], size)
        return self.bufs[self.turn]


class Rows:
    """One prompt of one shard, streamed forward: take(indices) returns those rows (float32,
    widened from native) reading only as far as the largest index. Indices must not go back
    before what an earlier take() released. scratch: where batches are widened (one reader at a
    time per Scratch). stored: bf16 rows read from their pages come as they are stored (Bf16Rows:
    bits and shift, for the metric kernel), not widened."""

    def __init__(
        self,
        wh: Warehouse,
        index: ShardIndex,
        prompt_id: str,
        batch: int,
        scratch: Scratch | None = None,
        stored: bool = False,
    ):
        if not index.values:
            raise UserError(values_not_kept(index.path))
        self.index, self.prompt, self.scratch, self.stored = index, index.prompts[prompt_id], scratch, stored
        self.pf = pq.ParquetFile(
            index.path,
            filesystem=wh.loc.fs,
            metadata=index.metadata,
            page_checksum_verification=True,
            buffer_size=READ_BUFFER,
        )
        self.fs = wh.loc.fs
        self.batch = max(1, batch)
        self.sizes = [self.pf.metadata.row_group(g).num_rows for g in self.prompt.groups]
        self.group_rows = sum(self.sizes)  # every row of the prompt's row groups
        self._open()
        self.start, self.buf = 0, np.zeros((0, 0), np.float32)  # buf holds rows start .. start + len(buf)

    def _open(self) -> None:
        """Pages read by store/pages.py where it applies (faster than Arrow's list decode for bf16
        (docs/benchmark-notes.md), and the native rows are hashed as they are); Arrow's reader otherwise."""
        self.stream = self.batches = None
        try:
            if self.prompt.offset or len(self.prompt.positions) != self.group_rows:
                raise pages.Unsupported("a row group shared by several prompts (one native dtype is assumed)")
            # read (pread), not memory-mapped: a mapped file's pages stay in the process's RSS as
            # it reads on, so a long prompt's reader would look as big as the prompt's column chunk
            f = self.fs.open_input_file(self.index.path) if self.fs else pa.OSFile(self.index.path)
            self.file = f
            self.stream = self._leaf(0)
        except pages.Unsupported:
            self.batches = self.pf.iter_batches(
                batch_size=self.batch, row_groups=self.prompt.groups, columns=["logits"], use_threads=False
            )
        except (OSError, pa.ArrowException) as e:
            raise _damaged(self.index.path, e) from None
        self.read = 0  # rows of the row groups read so far

    def _leaf(self, i: int) -> pages.LeafStream:
        """The page reader of the prompt's i-th row group."""
        g = self.prompt.groups[i]
        return pages.LeafStream(self.file, self.pf.metadata, self.pf.schema, g, self.index.leaf, self.prompt.kind)

    def _next_rows(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The next batch as float32 rows, and the native rows when they came from pages."""
        if self.read >= self.group_rows:
            raise _damaged(self.index.path, ValueError(f"prompt row group {self.prompt.group} ended early"))
        if self.stream is None:
            try:
                b = next(self.batches)
            except StopIteration:
                raise _damaged(
                    self.index.path, ValueError(f"prompt row group {self.prompt.group} ended early")
                ) from None
            except (OSError, pa.ArrowException) as e:
                raise _damaged(self.index.path, e) from None
            self.read += b.num_rows
            try:
                return logits_matrix(b.column(0)), None  # (batch, vocab) float32
            except ValueError as e:
                raise UserError(f"{self.index.path}: {e} in one shard") from None
        ends = np.cumsum(self.sizes)  # a batch stops where a row group does: each has its own pages
        i = int(np.searchsorted(ends, self.read, side="right"))
        if self.read and self.read == ends[i - 1]:  # the last group read to its end: on into the next
            self.stream = self._leaf(i)
        n = min(self.batch, int(ends[i]) - self.read)
        into = None
        if self.stored and self.scratch is not None and self.prompt.kind == "bf16":  # kept as bits: in turn, reused
            size = n * self.index.vocab
            into = self.scratch.next((size + 1) // 2).view(np.uint16)[:size]
        try:
            native = self.stream.take(n, into)  # (n, vocab) native
        except pages.Corrupt as e:
            raise _damaged(self.index.path, e) from None
        self.read += n
        if self.stored and native.dtype == np.uint16:
            return native, native
        return widen(native, None if self.scratch is None else self.scratch.next(native.size)), native

    def _more(self) -> None:
        rows, native = self._next_rows()
        at = self.start + len(self.buf) - self.prompt.offset  # first new row, within the prompt
        lo, hi = max(at, 0), min(at + len(rows), len(self.prompt.hashes))  # another prompt's rows: not ours to check
        mine = slice(lo - at, max(hi - at, 0))
        bad = (
            [
                (i + lo - at, why)
                for i, why in native_check(
                    self.prompt.kind, rows[mine], self.prompt.hashes[lo:hi], None if native is None else native[mine]
                )
            ]
            if hi > lo
            else []
        )
        if bad:
            i, why = bad[0]
            raise DamagedShard(
                f"{self.index.path}: {len(bad)} row(s) damaged, first position "
                f"{self.prompt.positions[at + i]}: {why}; {SEE_VERIFY}"
            )
        self.buf = rows if not len(self.buf) else np.concatenate([self.buf, rows])

    def take(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | Bf16Rows:
        """Rows idx as (len(idx), vocab) float32, in out's first values when given (a buffer the
        caller reuses once it is done with them); Bf16Rows for a stored reader's bf16 pages (valid
        until the next take). Rows before min(idx) are released: taken in
        ascending chunks (the shard's own order) every row is read once."""
        if not len(idx):
            return np.zeros((0, self.index.vocab), np.float32)
        idx = idx + self.prompt.offset  # rows of the row group
        lo, hi = int(idx.min()), int(idx.max())
        if lo < self.start:  # positions out of order: read the prompt again from its start
            self._open()
            self.start, self.buf = 0, np.zeros((0, 0), np.float32)
        drop = lo - self.start
        if drop > 0 and len(self.buf):
            self.buf, self.start = self.buf[min(drop, len(self.buf)) :], self.start + min(drop, len(self.buf))
        while self.start + len(self.buf) <= hi:
            self._more()
        at = idx - self.start
        shift = None if self.prompt.shift is None else self.prompt.shift[idx - self.prompt.offset]
        if self.buf.dtype == np.uint16:  # stored: bf16 bits, as they came from the pages
            return Bf16Rows.of(rows_at(self.buf, at), shift)
        if out is None:
            rows = self.buf[at]  # a copy (fancy indexing): the buffer may be dropped later
            return rows if shift is None else unshift(rows, shift, inplace=True)  # the raw logits back
        return unshift(rows_at(self.buf, at), shift, out=out)  # the raw logits back, in one pass into out
