"""Reading and writing the warehouse, wherever it is (store/location.py). A file is visible only
when complete: locally temp file + fsync + rename, on S3 one whole object. A shard's rows are built,
encoded and streamed into their file by store/shards.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError
from store.cell_rows import CellRow
from store.location import PROBE, open_location, write_whole
from store.schema import FORMAT, SCHEMA_VERSION, TABLES, keeps_values, refused_prompts
from store.shard_encoding import LOGITS_LEAF, by_row
from store.shards import (
    SHARD_FILES,
    ShardWriter,
    decode_rows,
    encode_rows,
    native_rows,
    rows_table,
    shard_key,
)
from store.values import (
    ZSTD_LEVEL,
    logits_matrix,
    narrow_bf16,
    round_bf16,
    row_hash,
    shift_by_max,
    to_bf16,
    unshift,
    widen,
)

# Callers import these from here (a shard's rows, and the value codecs of store/values.py).
__all__ = [
    "LOGITS_LEAF",
    "MARKER",
    "META_KEY",
    "SHARD_FILES",
    "ZSTD_LEVEL",
    "ShardWriter",
    "Warehouse",
    "by_row",
    "decode_rows",
    "encode_rows",
    "logits_matrix",
    "narrow_bf16",
    "native_rows",
    "round_bf16",
    "row_hash",
    "row_hashes",
    "rows_table",
    "shift_by_max",
    "to_bf16",
    "unshift",
    "values_not_kept",
    "widen",
]

MARKER = "WAREHOUSE.json"
META_KEY = "logit_matrix"  # Parquet key-value metadata of analysis outputs


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
        self.loc.mkdirs(table)  # a plug-in's table has no directory in a warehouse made before it was installed
        write_whole(self.loc, key, lambda tmp: pq.write_table(t, tmp, compression="zstd", write_page_checksum=True))
        return key

    def remove_table(self, table: str, name: str) -> None:
        """Drop one analysis output file (e.g. metrics of a cell that no longer has a comparison)."""
        self.loc.delete(f"{table}/{name}.parquet")

    def read_all(self, table: str) -> list[dict]:
        """Every row of a table (all its files); [] when it has none yet."""
        files = self.table_files(table)
        return pq.read_table(files, filesystem=self.loc.fs).to_pylist() if files else []

    def cell_rows(self, status: str | None = None) -> list[CellRow]:
        """The cells table as records (status: only the cells of that status)."""
        return [CellRow.of(r) for r in self.read_all("cells") if status is None or r["status"] == status]

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
        return shard_key(cell_id, repeat, table)

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

    def shard_tally(self, cell_id: str, repeat: int) -> tuple[int, dict[str, dict]]:
        """A logits shard's rows and the prompts whose rows the engine refused (REFUSED_KEY), from
        its footer alone (one read)."""
        md = pq.read_metadata(self.shard_path(cell_id, repeat), filesystem=self.loc.fs)
        return md.num_rows, refused_prompts(md.metadata)

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
