"""Reading and writing the warehouse, wherever it is (store/location.py). A file is visible only
when complete: locally temp file + fsync + rename, on S3 one whole object."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.buffers import room
from common.errors import UserError
from store.location import PROBE, named_io_errors, open_location, write_whole
from store.schema import FORMAT, LOGITS, NOT_KEPT, SCHEMA_VERSION, TABLES, VALUES_KEY, keeps_values
from store.values import ZSTD_LEVEL, native_dtype_of, row_hash, widen
from store.values import logits_matrix as logits_matrix  # readers take the row encoding's names from here
from store.values import narrow_bf16 as narrow_bf16
from store.values import native_values as native_values
from store.values import round_bf16 as round_bf16
from store.values import shift_by_max as shift_by_max
from store.values import to_bf16 as to_bf16
from store.values import unshift as unshift

MARKER = "WAREHOUSE.json"
META_KEY = "logit_matrix"  # Parquet key-value metadata of analysis outputs
# Byte-stream-split needs the leaf path of a list column; the flag alone ignores it.
LOGITS_LEAF = "logits.list.element"
# A shard kind -> (table directory, file letter): logits/<cell>/r0.parquet, logits/<cell>/d0.parquet, ...
SHARD_FILES = {"logits": ("logits", "r"), "side": ("logits", "d"), "layer_states": ("layer_states", "r")}


class Warehouse:
    """The warehouse at a location: a directory here, or an s3:// prefix (store/location.py)."""

    def __init__(self, where: str | os.PathLike):
        self.loc = open_location(where)
        self.where = str(self.loc)  # what messages name, and what actors are given

    @property
    def remote(self) -> bool:
        return self.loc.remote

    # -- lifecycle -----------------------------------------------------------------
    def check(self) -> bool:
        """Validate an existing warehouse without writing. Returns whether it exists."""
        state = self.loc.state()
        if state == "missing":
            return False
        if state == "not a directory":
            raise UserError(f"{self.where}: warehouse path is not a directory")
        if not self.loc.exists(MARKER):
            # our own bookkeeping (.probe, .lease.json, .lock) does not make a prefix "used"
            if state == "used" and any(not Path(k).name.startswith(".") for k in self.loc.list("", "")):
                raise UserError(f"{self.where}: not a logit-matrix warehouse (no {MARKER}) and not empty")
            return False
        try:
            meta = json.loads(self.loc.read_bytes(MARKER))
        except json.JSONDecodeError as e:
            raise UserError(f"{self.where}/{MARKER}: unreadable warehouse marker: {e}") from None
        if meta.get("format") != FORMAT:
            raise UserError(f"{self.where}/{MARKER}: format {meta.get('format')!r} is not {FORMAT!r}")
        version = meta.get("schema_version")
        from store.migrations import MIGRATIONS

        if (
            isinstance(version, int)
            and version < SCHEMA_VERSION
            and all(v in MIGRATIONS for v in range(version + 1, SCHEMA_VERSION + 1))
        ):
            self.version = version  # readable now; migrate() before writing
            return True
        if version != SCHEMA_VERSION:
            raise UserError(
                f"{self.where}/{MARKER}: schema_version {version!r} is incompatible with this "
                f"logit-matrix (reads and writes schema_version {SCHEMA_VERSION}); use a new --warehouse"
            )
        return True

    def migrate(self, log=lambda m: None) -> None:
        """Bring an older warehouse up to SCHEMA_VERSION (additive steps only)."""
        from store.migrations import MIGRATIONS

        version = getattr(self, "version", SCHEMA_VERSION)
        for v in range(version + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[v].apply(self.loc)
            self._write_marker(v)
            log(f"{self.where}: migrated warehouse to schema_version {v} ({MIGRATIONS[v].name})")
        self.version = SCHEMA_VERSION

    def _write_marker(self, version: int) -> None:
        self.loc.write_bytes(
            MARKER, (json.dumps({"format": FORMAT, "schema_version": version}, indent=1) + "\n").encode()
        )

    def require(self) -> "Warehouse":
        if not self.check():
            raise UserError(f"{self.where}: no warehouse here (run `matrix run --warehouse {self.where}` first)")
        return self

    def create(self) -> None:
        if self.check():
            return
        for name in TABLES:
            self.loc.mkdirs(name)
        self._write_marker(SCHEMA_VERSION)
        self.version = SCHEMA_VERSION

    def lock(self, log=lambda m: None):
        """Exclusive writer lock: two runs on one warehouse would capture the same cells twice.
        A directory: flock; an object store: a lease object (store/objdir.py). log: where taking
        over a dead writer's lease is said."""
        return self.loc.lock(f"pid {os.getpid()}", log)

    def write_probe(self, nonce: str) -> None:
        """A file only nodes that see this warehouse can read back: see reaches()."""
        self.loc.write_bytes(PROBE, nonce.encode())

    @staticmethod
    def reaches(where: str, nonce: str) -> bool:
        """Whether this node reaches the driver's warehouse itself (a shared filesystem, or the
        bucket with credentials): it reads back the nonce the driver wrote for this run. A path
        that exists here but is another disk's directory reads another nonce, or none."""
        try:
            return open_location(where).read_bytes(PROBE).decode() == nonce
        except (OSError, UserError):
            return False  # then its rows go through the driver

    def sweep_tmp(self) -> list[str]:
        """Remove temp files left by a killed writer (never visible to readers)."""
        return self.loc.sweep_tmp()

    # -- small tables -------------------------------------------------------------
    def table_files(self, table: str) -> list[str]:
        """The table's files, as paths the location's filesystem (self.loc.fs) reads."""
        return [self.loc.path(k) for k in self.loc.list(f"{table}/")]

    def write_rows(self, table: str, name: str, rows: list[dict]) -> str:
        return self._write_file(table, name, pa.Table.from_pylist(rows, schema=TABLES[table]))

    def write_table(self, table: str, name: str, data: pa.Table, meta: dict | None = None) -> str:
        """A whole table file at once (analysis outputs), cast to the schema the store owns; meta
        goes into the file's key-value metadata (table_meta reads it back from the footer alone)."""
        t = data.select(TABLES[table].names).cast(TABLES[table])
        if meta:
            t = t.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
        return self._write_file(table, name, t)

    def table_meta(self, table: str, name: str) -> dict | None:
        """What write_table(meta=) stored, or None (no file, no metadata, or an unreadable footer)."""
        key = f"{table}/{name}.parquet"
        if not self.loc.exists(key):
            return None
        try:
            kv = pq.read_metadata(self.loc.path(key), filesystem=self.loc.fs).metadata or {}
        except (OSError, pa.ArrowException):
            return None  # a damaged output is recomputed, never trusted
        raw = kv.get(META_KEY.encode())
        return json.loads(raw) if raw else None

    def _write_file(self, table: str, name: str, t: pa.Table) -> str:
        """Every small table file is written here: whole, zstd, with page checksums (store/verify.py)."""
        key = f"{table}/{name}.parquet"
        write_whole(self.loc, key, lambda tmp: pq.write_table(t, tmp, compression="zstd", write_page_checksum=True))
        return key

    def remove_table(self, table: str, name: str) -> None:
        """Drop one analysis output file (e.g. metrics of a cell that no longer has a comparison)."""
        self.loc.delete(f"{table}/{name}.parquet")

    def read_all(self, table: str) -> list[dict]:
        """Every row of a table (all its files); [] when it has none yet."""
        files = self.table_files(table)
        return pq.read_table(files, filesystem=self.loc.fs).to_pylist() if files else []

    def read_rows(self, table: str, name: str) -> list[dict]:
        key = f"{table}/{name}.parquet"
        return pq.read_table(self.loc.path(key), filesystem=self.loc.fs).to_pylist() if self.loc.exists(key) else []

    def has_rows(self, table: str, name: str) -> bool:
        return self.loc.exists(f"{table}/{name}.parquet")

    # -- logits shards --------------------------------------------------------------
    # table: "logits" (a capture's rows), "layer_states" (hidden states: a second shard of each repeat)
    # or "side" (the d<repeat> file: logits rows off the plain prefill, each with its path, beside the
    # prefill row they are compared with; written by the per-cell extras)
    @staticmethod
    def shard_key(cell_id: str, repeat: int, table: str = "logits") -> str:
        where, letter = SHARD_FILES[table]
        return f"{where}/{cell_id}/{letter}{repeat}.parquet"

    def shard_path(self, cell_id: str, repeat: int, table: str = "logits") -> str:
        return self.loc.path(self.shard_key(cell_id, repeat, table))

    def completed_repeats(self, cell_id: str, table: str = "logits") -> set[int]:
        where, letter = SHARD_FILES[table]
        return {int(Path(k).stem[1:]) for k in self.loc.list(f"{where}/{cell_id}/") if Path(k).name.startswith(letter)}

    def read_shard(
        self, cell_id: str, repeat: int, columns: list[str] | None = None, table: str = "logits"
    ) -> pa.Table:
        """One (cell, repeat) shard, or just the named columns (every reader of a shard comes here)."""
        return pq.read_table(
            self.shard_path(cell_id, repeat, table),
            columns=columns,
            filesystem=self.loc.fs,
            page_checksum_verification=True,
        )

    def move_aside(self, cell_id: str, repeat: int, aside: str, table: str = "logits") -> str:
        """Move a damaged shard to <aside>/logits/... (kept for inspection; readers no longer see it)."""
        key = self.shard_key(cell_id, repeat, table)
        self.loc.move(key, f"{aside}/{key}")
        return self.loc.path(f"{aside}/{key}")

    def shard_rows(self, cell_id: str, repeat: int, table: str = "logits") -> int:
        return pq.read_metadata(self.shard_path(cell_id, repeat, table), filesystem=self.loc.fs).num_rows

    def shard_keeps_values(self, cell_id: str, repeat: int) -> bool:
        """False for a shard of row hashes whose values were not kept (VALUES_KEY)."""
        return keeps_values(pq.read_schema(self.shard_path(cell_id, repeat), filesystem=self.loc.fs))

    def require_values(self, cell_id: str, repeat: int) -> None:
        """For a reader of a shard's logits: one line where its values were not kept."""
        if not self.shard_keeps_values(cell_id, repeat):
            raise UserError(values_not_kept(self.shard_path(cell_id, repeat)))

    def shard_hashes(self, cell_id: str, repeat: int) -> dict[tuple[str, int], str]:
        return row_hashes(self.read_shard(cell_id, repeat, ["prompt_id", "position", "row_hash"]))


def values_not_kept(path: str) -> str:
    return (
        f"{path}: its rows were measured and hashed where they were captured, their values not kept "
        "(keep_rows: references); capture the cell again under keep_rows: all to read them"
    )


def row_hashes(rows: pa.Table) -> dict[tuple[str, int], str]:
    """(prompt_id, position) -> row_hash of a shard's rows (a table with at least those columns)."""
    return {
        (p, int(q)): h for p, q, h in zip(*(rows.column(c).to_pylist() for c in ("prompt_id", "position", "row_hash")))
    }


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
        self.stage = loc.stage(Warehouse.shard_key(cell_id, repeat, table))
        self.path = loc.path(Warehouse.shard_key(cell_id, repeat, table))  # named by a write that fails
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

    def commit(self) -> str:
        with named_io_errors(self.path):
            self._writer.close()
            self.stage.commit()
        return Warehouse.shard_key(self.cell_id, self.repeat, self.table)

    def abort(self) -> None:
        try:
            self._writer.close()  # may fail again (a full disk): the temp file goes all the same
        finally:
            self.stage.abort()
