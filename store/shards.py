"""A (cell, repeat) shard's rows: built as a LOGITS table, encoded as a shard encodes them (what a
node that cannot reach the warehouse sends to the driver), decoded and checked, and written into
the shard's file by ShardWriter, visible only after commit(). Where a shard lives: store/warehouse.py.

ShardWriter writes a row group per prompt. A prompt's logits are encoded in slices on the host's
cores (store/shard_encoding.py) and its small columns apart, and the pieces are spliced into one
row group (store/parquet_splice.py): an ordinary Parquet file, its columns encoded as one pyarrow
writer encodes them, its bytes the same whatever the thread count. Rows without values
(values=False), layer states and rows another node encoded (add_encoded) are encoded whole by
pyarrow, into memory, and spliced as they are (a few bytes a row, or rows already sent whole)."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from store.location import Writeback, named_io_errors, open_location
from store.parquet_splice import Part, Splicer
from store.prompt_rows import PromptRows
from store.schema import LOGITS, NOT_KEPT, REFUSED_KEY, TABLES, VALUES_KEY
from store.shard_encoding import (
    HEAD_SCHEMA,
    TAIL_SCHEMA,
    SliceEncoder,
    by_row,
    encode_part,
    list_column,
    logits_writer,
    store_threads,
)
from store.values import native_values, row_hash, widen

# A shard kind -> (table directory, file letter): logits/<cell>/r0.parquet, logits/<cell>/d0.parquet, ...
SHARD_FILES = {"logits": ("logits", "r"), "side": ("logits", "d"), "layer_states": ("layer_states", "r")}


def shard_key(cell_id: str, repeat: int, table: str = "logits") -> str:
    """A shard's key under the warehouse: <table directory>/<cell>/<letter><repeat>.parquet."""
    where, letter = SHARD_FILES[table]
    return f"{where}/{cell_id}/{letter}{repeat}.parquet"


def rows_table(
    run_id: str,
    cell_id: str,
    repeat: int,
    rows: PromptRows,
    buffer: np.ndarray | None = None,
    values: bool = True,
) -> pa.Table:
    """One prompt's rows as a LOGITS table. buffer: a float32 array of at least rows * vocab values
    the widened values go into, for a caller that writes the table before it reuses the buffer (a
    prompt's fresh 270 MB costs as much in page faults as the widening). values=False: every row
    hashed, its logits null (a shard that keeps no values, VALUES_KEY)."""
    native = rows.native
    n = len(native)
    assert n == len(rows.positions), (n, len(rows.positions))
    hashes = [row_hash(native[i]) for i in range(n)]
    if values:
        logits = list_column(widen(native, buffer))
    else:
        logits = pa.nulls(n, LOGITS.field("logits").type)
    columns = rows.columns(run_id, cell_id, repeat)
    return pa.table({**columns, "row_hash": pa.array(hashes, pa.string()), "logits": logits}, schema=LOGITS)


def _writer(where, table: str = "logits", values: bool = True) -> pq.ParquetWriter:
    if table == "layer_states":
        from store.layer_states import layer_writer

        return layer_writer(where)
    return logits_writer(where, LOGITS if values else LOGITS.with_metadata({VALUES_KEY: NOT_KEPT}))


@lru_cache(maxsize=None)
def _template(table: str, values: bool) -> bytes:
    """The Parquet file a shard's writer writes without rows: the footer a spliced shard's footer is built on."""
    sink = pa.BufferOutputStream()
    _writer(sink, table, values).close()
    return sink.getvalue().to_pybytes()


def encode_rows(rows: pa.Table, table: str = "logits") -> bytes:
    """One row group as the bytes of a small Parquet file, encoded as a shard encodes it
    (what a node that cannot reach the warehouse sends to the driver)."""
    sink = pa.BufferOutputStream()
    w = _writer(sink, table)
    w.write_table(by_row(rows))
    w.close()
    return sink.getvalue().to_pybytes()


def native_rows(rows: pa.Table) -> np.ndarray:
    """A LOGITS table's rows back in their native dtype, exactly: (rows, vocab)."""
    return native_values(rows, "logits", "logits_dtype")


def decode_rows(data: bytes, run_id: str, cell_id: str, repeat: int, table: str = "logits") -> pa.Table:
    """encode_rows' bytes back to a table, refused unless every row is this shard's and every
    row_hash matches its values (the bytes crossed a network)."""
    rows = pq.read_table(pa.BufferReader(data))
    if rows.schema != TABLES[SHARD_FILES[table][0]]:
        raise ValueError(f"rows for {cell_id} r{repeat}: not the {table} schema")
    for col, want in (("run_id", run_id), ("cell_id", cell_id), ("repeat", repeat)):
        got = set(rows.column(col).to_pylist())
        if got - {want}:
            raise ValueError(f"rows for {cell_id} r{repeat}: {col} {sorted(got - {want})[0]!r}, expected {want!r}")
    if table == "layer_states":
        from store.layer_states import check_rows

        check_rows(rows, f"rows for {cell_id} r{repeat}")
        return rows
    native = native_rows(rows)
    for i, h in enumerate(rows.column("row_hash").to_pylist()):
        if row_hash(native[i]) != h:
            raise ValueError(f"rows for {cell_id} r{repeat}: row {i} does not match its row_hash")
    return rows


class ShardWriter:
    """Streams one (cell, repeat) shard, a row group per prompt; visible only after commit()."""

    def __init__(
        self,
        warehouse: str | os.PathLike,
        run_id: str,
        cell_id: str,
        repeat: int,
        table: str = "logits",
        values: bool = True,
        threads: int | None = None,
    ):
        """values=False: a logits shard of row hashes without values (VALUES_KEY). threads: those
        a prompt's logits are encoded on (store_threads: LOGIT_MATRIX_STORE_THREADS, else the CPUs)."""
        loc = open_location(warehouse)
        self.table, self.values = table, values
        self.stage = loc.stage(shard_key(cell_id, repeat, table))
        self.path = loc.path(shard_key(cell_id, repeat, table))  # named by a write that fails
        self.run_id, self.cell_id, self.repeat = run_id, cell_id, repeat
        self.rows = 0
        self._slices = SliceEncoder(store_threads(threads))
        with named_io_errors(self.path):
            self._file = open(self.stage.tmp, "wb")
            self._splicer = Splicer(self._file, _template(table, values))
        self._writeback = Writeback(self._file)  # pages to disk beside the next prompts: commit's fsync has less left

    def add(self, rows: PromptRows) -> None:
        """One prompt's rows: their logits encoded in slices on the writer's threads, beside them
        the other columns."""
        native = rows.native
        if not self.values or not native.size:  # no logits to spread
            self.add_rows(rows_table(self.run_id, self.cell_id, self.repeat, rows, values=self.values))
            return
        assert native.ndim == 2 and len(native) == len(rows.positions), (native.shape, len(rows.positions))
        tasks = self._slices.start(native)
        try:
            self._splice(self._parts(rows.columns(self.run_id, self.cell_id, self.repeat), tasks), len(native))
        finally:
            self._slices.settle()

    def add_blocks(self, prompt_id: str, positions: list[int], next_ids: list, blocks: Iterator) -> None:
        """One prompt's rows as a streamed forward gives them: blocks yields (stored, shift) for
        consecutive runs of positions, in order, each (rows, vocab) valid until the next is asked
        for. Each block is encoded in slices and written before the next, into the prompt's one row
        group: the row hashes and shifts (a few bytes a row) wait for the tail columns, so memory
        holds one block, never the prompt. The rows are those add() writes of the same rows held whole."""
        head = {"hashes": [], "shifts": [], "dtype": None, "rows": 0}
        if not self.values:  # hashes only: nothing to splice per block
            for native, shift in blocks:
                self._note(head, native, shift)
            self.add_rows(self._hashed(prompt_id, positions, next_ids, head))
            return
        self._splice(self._block_parts(prompt_id, positions, next_ids, blocks, head), len(positions))

    def _note(self, head: dict, native: np.ndarray, shift: np.ndarray | None) -> None:
        """A block's dtype, hashes and shifts, kept for the prompt's columns after its logits."""
        if head["dtype"] not in (None, native.dtype):
            raise ValueError(f"a streamed prompt's blocks came as {head['dtype']} and {native.dtype}")
        head["dtype"], head["rows"] = native.dtype, head["rows"] + len(native)
        head["shifts"].append(shift)
        if not self.values:
            head["hashes"] += [row_hash(r) for r in native]

    def _columns(self, prompt_id, positions, next_ids, head: dict) -> dict[str, pa.Array]:
        if head["rows"] != len(positions):
            raise ValueError(f"prompt {prompt_id}: the forward gave {head['rows']} rows for {len(positions)} positions")
        shifts = head["shifts"]
        shift = None if not shifts or shifts[0] is None else np.concatenate(shifts)  # (rows,)
        empty = np.empty((0, 0), head["dtype"] or np.float32)  # only its dtype is read
        return PromptRows(prompt_id, positions, next_ids, empty, shift).columns(self.run_id, self.cell_id, self.repeat)

    def _hashed(self, prompt_id, positions, next_ids, head: dict) -> pa.Table:
        columns = self._columns(prompt_id, positions, next_ids, head)
        columns["row_hash"] = pa.array(head["hashes"], pa.string())
        columns["logits"] = pa.nulls(len(positions), LOGITS.field("logits").type)
        return pa.table(columns, schema=LOGITS)

    def _block_parts(self, prompt_id, positions, next_ids, blocks: Iterator, head: dict):
        """_parts() of a streamed prompt: the head columns once the first block says the dtype,
        then each block's slices, then the tail with every block's hashes and shifts."""
        hashes, first = [], True
        for native, shift in blocks:
            self._note(head, native, shift)
            if first:
                head_rows = PromptRows(prompt_id, positions, next_ids, native)
                columns = head_rows.columns(self.run_id, self.cell_id, self.repeat)
                yield encode_part(pa.table([columns[k] for k in HEAD_SCHEMA.names], schema=HEAD_SCHEMA))
                first = False
            if not native.size:
                continue
            try:
                for task in self._slices.start(native):
                    piece = task()
                    hashes += piece.hashes
                    yield piece.data
                    self._slices.release(piece)
            finally:
                self._slices.settle()  # the block's memory is the forward's again once this returns
        if first:
            raise ValueError(f"prompt {prompt_id}: a streamed forward gave no rows")
        columns = self._columns(prompt_id, positions, next_ids, head)
        columns["row_hash"] = pa.array(hashes, pa.string())
        yield encode_part(pa.table([columns[k] for k in TAIL_SCHEMA.names], schema=TAIL_SCHEMA))

    def _parts(self, columns: dict[str, pa.Array], tasks):
        """A prompt's parts in the file's column order: the columns before the logits, each slice's
        logits in row order as it is done (its pages written before the next is asked for), then
        row_hash and the columns after it."""
        yield encode_part(pa.table([columns[k] for k in HEAD_SCHEMA.names], schema=HEAD_SCHEMA))
        hashes = []
        for task in tasks:
            piece = task()
            hashes += piece.hashes
            yield piece.data
            self._slices.release(piece)  # written: the splicer asks for the next part only after
        columns["row_hash"] = pa.array(hashes, pa.string())
        yield encode_part(pa.table([columns[k] for k in TAIL_SCHEMA.names], schema=TAIL_SCHEMA))

    def add_layers(
        self, prompt_id: str, positions: list[int], states: dict[str, np.ndarray], depth: int, sources: dict[str, str]
    ) -> None:
        """A layer_states shard: one prompt's {state: (rows, hidden)} (store/layer_states.py)."""
        from store.layer_states import layer_rows_table

        self.add_rows(
            layer_rows_table(self.run_id, self.cell_id, self.repeat, prompt_id, positions, states, depth, sources)
        )

    def add_rows(self, rows: pa.Table) -> None:
        """One row group, encoded whole."""
        self._splice([encode_rows(rows, self.table)], rows.num_rows)

    def _splice(self, parts: Iterable, rows: int) -> None:
        """parts: Parquet files (buffers) of one row group's columns, in order (Splicer.add)."""
        with named_io_errors(self.path):
            self._splicer.add(Part.of(p) for p in parts)
            self._writeback.kick(self._splicer.pos)
        self.rows += rows

    def add_encoded(self, data: bytes) -> int:
        """A row group another node encoded (encode_rows); checked before it is written."""
        self.add_rows(decode_rows(data, self.run_id, self.cell_id, self.repeat, self.table))
        return self.rows

    def commit(self, refused: dict | None = None) -> str:
        """refused: {prompt_id: ...} whose rows the engine refused (REFUSED_KEY), in the footer."""
        self._slices.close()
        extra = {REFUSED_KEY: json.dumps(refused, sort_keys=True).encode()} if refused else None
        with named_io_errors(self.path):
            self._splicer.close(extra)
            self._writeback.wait()
            self._file.close()
            self.stage.commit()
        return shard_key(self.cell_id, self.repeat, self.table)

    def abort(self) -> None:
        self._slices.close()
        try:  # each may fail again (a full disk): the temp file goes all the same
            self._writeback.wait()
        finally:
            try:
                self._file.close()
            finally:
                self.stage.abort()
