"""A (cell, repeat) shard's rows: built as a LOGITS table, encoded as a shard encodes them (what a
node that cannot reach the warehouse sends to the driver), decoded and checked, and streamed into
the shard's file by ShardWriter, visible only after commit(). Where a shard lives: store/warehouse.py."""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.buffers import room
from store.location import named_io_errors, open_location
from store.schema import LOGITS, NOT_KEPT, REFUSED_KEY, TABLES, VALUES_KEY
from store.values import ZSTD_LEVEL, native_dtype_of, native_values, row_hash, widen

# Byte-stream-split needs the leaf path of a list column; the flag alone ignores it.
LOGITS_LEAF = "logits.list.element"
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
    prompt_id: str,
    positions: list[int],
    next_ids: Iterable[int | None],
    native: np.ndarray,
    shift: np.ndarray | None = None,
    path: list[str] | None = None,
    step: list[int] | None = None,
    buffer: np.ndarray | None = None,
    values: bool = True,
) -> pa.Table:
    """One prompt's rows as a LOGITS table. native: (rows, vocab) as returned by a backend, or as
    stored (`store: bf16`) with shift (rows,) what was subtracted from each row; path / step per
    row for a side file (null for a capture's rows). buffer: a float32 array of at least
    rows * vocab values the widened values go into, for a caller that writes the table before
    it reuses the buffer (a prompt's fresh 270 MB costs as much in page faults as the widening).
    values=False: every row hashed, its logits null (a shard that keeps no values, VALUES_KEY)."""
    n, vocab = native.shape
    assert n == len(positions), (n, len(positions))
    dtype = native_dtype_of(native)
    hashes = [row_hash(native[i]) for i in range(n)]
    if values:
        flat = pa.array(widen(native, buffer).reshape(-1), type=pa.float32())  # (rows * vocab,)
        logits = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * vocab, vocab, dtype=np.int32)), flat)
    else:
        logits = pa.nulls(n, LOGITS.field("logits").type)
    return pa.table(
        {
            "run_id": pa.array([run_id] * n),
            "cell_id": pa.array([cell_id] * n),
            "prompt_id": pa.array([prompt_id] * n),
            "position": pa.array(positions, pa.int32()),
            "next_token_id": pa.array(list(next_ids), pa.int32()),
            "repeat": pa.array([repeat] * n, pa.int32()),
            "logits_dtype": pa.array([dtype] * n),
            "logits": logits,
            "row_hash": pa.array(hashes),
            "shift": pa.array(shift if shift is not None else np.full(n, None), pa.float32()),
            "path": pa.array(path if path is not None else [None] * n, pa.string()),
            "step": pa.array(step if step is not None else [None] * n, pa.int32()),
        },
        schema=LOGITS,
    )


def _writer(where, table: str = "logits", values: bool = True) -> pq.ParquetWriter:
    if table == "layer_states":
        from store.layer_states import layer_writer

        return layer_writer(where)
    schema = LOGITS if values else LOGITS.with_metadata({VALUES_KEY: NOT_KEPT})
    return pq.ParquetWriter(
        where,
        schema,
        compression="zstd",
        compression_level=ZSTD_LEVEL,
        use_dictionary=["run_id", "cell_id", "prompt_id", "logits_dtype"],
        use_byte_stream_split=[LOGITS_LEAF],
        write_statistics=["position", "repeat", "next_token_id"],
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
    ):
        """values=False: a logits shard of row hashes without values (VALUES_KEY)."""
        loc = open_location(warehouse)
        self.table, self.values = table, values
        self.stage = loc.stage(shard_key(cell_id, repeat, table))
        self.path = loc.path(shard_key(cell_id, repeat, table))  # named by a write that fails
        self.run_id, self.cell_id, self.repeat = run_id, cell_id, repeat
        self.rows = 0
        self._wide = None  # the widened values of the prompt being written (rows_table's buffer)
        with named_io_errors(self.path):
            self._writer = _writer(self.stage.tmp, table, values)

    def add(
        self,
        prompt_id: str,
        positions: list[int],
        next_ids: Iterable[int | None],
        native: np.ndarray,
        shift: np.ndarray | None = None,
        path: list[str] | None = None,
        step: list[int] | None = None,
    ) -> None:
        """native: (rows, vocab) as returned by a backend (or as stored, with each row's shift)."""
        if self.values:
            self._wide = room(self._wide, native.size)
        self.add_rows(
            rows_table(
                self.run_id,
                self.cell_id,
                self.repeat,
                prompt_id,
                positions,
                next_ids,
                native,
                shift,
                path,
                step,
                buffer=self._wide,
                values=self.values,
            )
        )  # written below: the buffer is free again

    def add_layers(
        self, prompt_id: str, positions: list[int], states: dict[str, np.ndarray], depth: int, sources: dict[str, str]
    ) -> None:
        """A layer_states shard: one prompt's {state: (rows, hidden)} (store/layer_states.py)."""
        from store.layer_states import layer_rows_table

        self.add_rows(
            layer_rows_table(self.run_id, self.cell_id, self.repeat, prompt_id, positions, states, depth, sources)
        )

    def add_rows(self, rows: pa.Table) -> None:
        with named_io_errors(self.path):
            self._writer.write_table(by_row(rows))
        self.rows += rows.num_rows

    def add_encoded(self, data: bytes) -> int:
        """A row group another node encoded (encode_rows); checked before it is written."""
        self.add_rows(decode_rows(data, self.run_id, self.cell_id, self.repeat, self.table))
        return self.rows

    def commit(self, refused: dict | None = None) -> str:
        """refused: {prompt_id: ...} whose rows the engine refused (REFUSED_KEY), in the footer."""
        with named_io_errors(self.path):
            if refused:
                self._writer.add_key_value_metadata({REFUSED_KEY: json.dumps(refused, sort_keys=True)})
            self._writer.close()
            self.stage.commit()
        return shard_key(self.cell_id, self.repeat, self.table)

    def abort(self) -> None:
        try:
            self._writer.close()  # may fail again (a full disk): the temp file goes all the same
        finally:
            self.stage.abort()
