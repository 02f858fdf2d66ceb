"""Reading and writing the warehouse. Every file write is temp file + fsync + rename."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError
from store.schema import FORMAT, LOGITS, SCHEMA_VERSION, TABLES

MARKER = "WAREHOUSE.json"
TMP_PREFIX = ".tmp-"
PROBE = ".probe"  # the run's nonce: which nodes see this directory (Warehouse.reaches)
# Byte-stream-split needs the leaf path of a list column; the flag alone ignores it.
LOGITS_LEAF = "logits.list.element"
ZSTD_LEVEL = 3


def _fsync_replace(tmp: Path, final: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def _tmp_for(final: Path) -> Path:
    return final.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}-{final.name}.part"


def native_dtype_of(arr: np.ndarray) -> str:
    """Backends return bf16 as raw uint16 bits, f16 as float16, fp32 as float32."""
    kinds = {np.dtype(np.uint16): "bf16", np.dtype(np.float16): "f16", np.dtype(np.float32): "fp32"}
    if arr.dtype not in kinds:
        raise TypeError(f"unsupported native logits dtype {arr.dtype}")
    return kinds[arr.dtype]


def widen(arr: np.ndarray) -> np.ndarray:
    """Native logits -> float32, exactly (bf16 bits go into the high half)."""
    if arr.dtype == np.uint16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32, copy=False)


def narrow_bf16(values: np.ndarray) -> np.ndarray:
    """float32 that came from bf16 -> the original uint16 bits; refuses lossy input."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise ValueError("values are not bf16: low mantissa bits are set")
    return (bits >> 16).astype(np.uint16)


def logits_matrix(col) -> np.ndarray:
    """A logits list<float32> column (array or chunked) -> (rows, vocab) float32; rows must share a length."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    lengths = np.diff(arr.offsets.to_numpy())
    if len(lengths) and (lengths != lengths[0]).any():
        raise ValueError("rows of different vocabulary sizes")
    vocab = int(lengths[0]) if len(lengths) else 0
    start = arr.offsets[0].as_py() if len(arr) else 0
    vals = arr.values.to_numpy(zero_copy_only=False)[start:start + vocab * len(arr)]
    return vals.astype(np.float32, copy=False).reshape(len(arr), vocab)


def row_hash(row: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(row).tobytes()).hexdigest()


class Warehouse:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- lifecycle -----------------------------------------------------------------
    def check(self) -> bool:
        """Validate an existing warehouse without writing. Returns whether it exists."""
        marker = self.root / MARKER
        if not self.root.exists():
            return False
        if not self.root.is_dir():
            raise UserError(f"{self.root}: warehouse path is not a directory")
        if not marker.is_file():
            if any(self.root.iterdir()):
                raise UserError(f"{self.root}: not a logit-matrix warehouse (no {MARKER}) and not empty")
            return False
        try:
            meta = json.loads(marker.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{marker}: unreadable warehouse marker: {e}") from None
        if meta.get("format") != FORMAT:
            raise UserError(f"{marker}: format {meta.get('format')!r} is not {FORMAT!r}")
        version = meta.get("schema_version")
        from store.migrations import MIGRATIONS

        if isinstance(version, int) and version < SCHEMA_VERSION and all(
                v in MIGRATIONS for v in range(version + 1, SCHEMA_VERSION + 1)):
            self.version = version  # readable now; migrate() before writing
            return True
        if version != SCHEMA_VERSION:
            raise UserError(f"{marker}: schema_version {version!r} is incompatible with this logit-matrix "
                            f"(reads and writes schema_version {SCHEMA_VERSION}); use a new --warehouse")
        return True

    def migrate(self, log=lambda m: None) -> None:
        """Bring an older warehouse up to SCHEMA_VERSION (additive steps only)."""
        from store.migrations import MIGRATIONS

        version = getattr(self, "version", SCHEMA_VERSION)
        for v in range(version + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[v](self.root)
            self._write_marker(v)
            log(f"{self.root}: migrated warehouse to schema_version {v} ({MIGRATIONS[v].__name__})")
        self.version = SCHEMA_VERSION

    def _write_marker(self, version: int) -> None:
        marker = self.root / MARKER
        tmp = _tmp_for(marker)
        tmp.write_text(json.dumps({"format": FORMAT, "schema_version": version}, indent=1) + "\n")
        _fsync_replace(tmp, marker)

    def require(self) -> "Warehouse":
        if not self.check():
            raise UserError(f"{self.root}: no warehouse here (run `matrix run --warehouse {self.root}` first)")
        return self

    def create(self) -> None:
        if self.check():
            return
        for name in TABLES:
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self._write_marker(SCHEMA_VERSION)
        self.version = SCHEMA_VERSION

    @contextlib.contextmanager
    def lock(self):
        """Exclusive writer lock: two runs on one warehouse would capture the same cells twice."""
        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                raise UserError(f"{self.root}: another matrix run is writing to this warehouse ({holder})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def write_probe(self, nonce: str) -> None:
        """A file only nodes that see this directory can read back: see reaches()."""
        probe = self.root / PROBE
        tmp = _tmp_for(probe)
        tmp.write_text(nonce)
        _fsync_replace(tmp, probe)

    @staticmethod
    def reaches(root: str | os.PathLike, nonce: str) -> bool:
        """Whether this node sees the driver's warehouse itself (a shared filesystem): it reads
        back the nonce the driver wrote for this run. A path that exists here but is another
        disk's directory reads another nonce, or none."""
        try:
            return (Path(root) / PROBE).read_text() == nonce
        except OSError:
            return False

    def sweep_tmp(self) -> list[Path]:
        """Remove temp files left by a killed writer (never visible to readers)."""
        gone = [p for p in self.root.rglob(f"{TMP_PREFIX}*") if p.is_file()]
        for p in gone:
            p.unlink()
        return gone

    # -- small tables -------------------------------------------------------------
    def table_files(self, table: str) -> list[Path]:
        return sorted((self.root / table).rglob("*.parquet"))

    def write_rows(self, table: str, name: str, rows: list[dict]) -> Path:
        final = self.root / table / f"{name}.parquet"
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_for(final)
        pq.write_table(pa.Table.from_pylist(rows, schema=TABLES[table]), tmp, compression="zstd")
        _fsync_replace(tmp, final)
        return final

    def write_table(self, table: str, name: str, data: pa.Table) -> Path:
        """A whole table file at once (analysis outputs), cast to the schema the store owns."""
        final = self.root / table / f"{name}.parquet"
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_for(final)
        pq.write_table(data.select(TABLES[table].names).cast(TABLES[table]), tmp, compression="zstd")
        _fsync_replace(tmp, final)
        return final

    def remove_table(self, table: str, name: str) -> None:
        """Drop one analysis output file (e.g. metrics of a cell that no longer has a comparison)."""
        (self.root / table / f"{name}.parquet").unlink(missing_ok=True)

    def read_all(self, table: str) -> list[dict]:
        """Every row of a table (all its files); [] when it has none yet."""
        files = self.table_files(table)
        return pq.read_table(files).to_pylist() if files else []

    def read_rows(self, table: str, name: str) -> list[dict]:
        path = self.root / table / f"{name}.parquet"
        return pq.read_table(path).to_pylist() if path.is_file() else []

    def has_rows(self, table: str, name: str) -> bool:
        return (self.root / table / f"{name}.parquet").is_file()

    # -- logits shards --------------------------------------------------------------
    def shard_path(self, cell_id: str, repeat: int) -> Path:
        return self.root / "logits" / cell_id / f"r{repeat}.parquet"

    def completed_repeats(self, cell_id: str) -> set[int]:
        d = self.root / "logits" / cell_id
        return {int(p.stem[1:]) for p in d.glob("r*.parquet")} if d.is_dir() else set()

    def read_shard(self, cell_id: str, repeat: int, columns: list[str] | None = None) -> pa.Table:
        """One (cell, repeat) shard, or just the named columns (every reader of a shard comes here)."""
        return pq.read_table(self.shard_path(cell_id, repeat), columns=columns)

    def shard_rows(self, cell_id: str, repeat: int) -> int:
        return pq.read_metadata(self.shard_path(cell_id, repeat)).num_rows

    def shard_hashes(self, cell_id: str, repeat: int) -> dict[tuple[str, int], str]:
        t = self.read_shard(cell_id, repeat, ["prompt_id", "position", "row_hash"])
        return {(p, int(q)): h for p, q, h in zip(*(t.column(c).to_pylist() for c in t.column_names))}


def rows_table(run_id: str, cell_id: str, repeat: int, prompt_id: str, positions: list[int],
               next_ids: Iterable[int | None], native: np.ndarray) -> pa.Table:
    """One prompt's rows as a LOGITS table. native: (rows, vocab) as returned by a backend."""
    n, vocab = native.shape
    assert n == len(positions), (n, len(positions))
    dtype = native_dtype_of(native)
    hashes = [row_hash(native[i]) for i in range(n)]
    values = pa.array(widen(native).reshape(-1), type=pa.float32())  # (rows * vocab,)
    offsets = pa.array(np.arange(0, (n + 1) * vocab, vocab, dtype=np.int32))
    return pa.table({
        "run_id": pa.array([run_id] * n), "cell_id": pa.array([cell_id] * n),
        "prompt_id": pa.array([prompt_id] * n), "position": pa.array(positions, pa.int32()),
        "next_token_id": pa.array(list(next_ids), pa.int32()),
        "repeat": pa.array([repeat] * n, pa.int32()),
        "logits_dtype": pa.array([dtype] * n),
        "logits": pa.ListArray.from_arrays(offsets, values),
        "row_hash": pa.array(hashes),
    }, schema=LOGITS)


def _writer(where) -> pq.ParquetWriter:
    return pq.ParquetWriter(
        where, LOGITS, compression="zstd", compression_level=ZSTD_LEVEL,
        use_dictionary=["run_id", "cell_id", "prompt_id", "logits_dtype"],
        use_byte_stream_split=[LOGITS_LEAF], write_statistics=["position", "repeat", "next_token_id"])


def encode_rows(rows: pa.Table) -> bytes:
    """One row group as the bytes of a small Parquet file, encoded as a shard encodes it
    (what a node that cannot reach the warehouse sends to the driver)."""
    sink = pa.BufferOutputStream()
    w = _writer(sink)
    w.write_table(rows)
    w.close()
    return sink.getvalue().to_pybytes()


def native_rows(rows: pa.Table) -> np.ndarray:
    """A LOGITS table's rows back in their native dtype, exactly: (rows, vocab)."""
    dtypes = set(rows.column("logits_dtype").to_pylist())
    if len(dtypes) > 1:
        raise ValueError(f"rows of several native dtypes: {sorted(dtypes)}")
    values = logits_matrix(rows.column("logits"))  # (rows, vocab) float32
    kind = dtypes.pop() if dtypes else "fp32"
    return narrow_bf16(values) if kind == "bf16" else values.astype(np.float16) if kind == "f16" else values


def decode_rows(data: bytes, run_id: str, cell_id: str, repeat: int) -> pa.Table:
    """encode_rows' bytes back to a table, refused unless every row is this shard's and every
    row_hash matches its values (the bytes crossed a network)."""
    rows = pq.read_table(pa.BufferReader(data))
    if rows.schema != LOGITS:
        raise ValueError(f"rows for {cell_id} r{repeat}: not the logits schema")
    for col, want in (("run_id", run_id), ("cell_id", cell_id), ("repeat", repeat)):
        got = set(rows.column(col).to_pylist())
        if got - {want}:
            raise ValueError(f"rows for {cell_id} r{repeat}: {col} {sorted(got - {want})[0]!r}, expected {want!r}")
    native = native_rows(rows)
    for i, h in enumerate(rows.column("row_hash").to_pylist()):
        if row_hash(native[i]) != h:
            raise ValueError(f"rows for {cell_id} r{repeat}: row {i} does not match its row_hash")
    return rows


class ShardWriter:
    """Streams one (cell, repeat) shard, a row group per prompt; visible only after commit()."""

    def __init__(self, warehouse_root: str | os.PathLike, run_id: str, cell_id: str, repeat: int):
        self.final = Warehouse(warehouse_root).shard_path(cell_id, repeat)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp_for(self.final)
        self.run_id, self.cell_id, self.repeat = run_id, cell_id, repeat
        self.rows = 0
        self._writer = _writer(self.tmp)

    def add(self, prompt_id: str, positions: list[int], next_ids: Iterable[int | None],
            native: np.ndarray) -> None:
        """native: (rows, vocab) as returned by a backend."""
        self.add_rows(rows_table(self.run_id, self.cell_id, self.repeat, prompt_id, positions, next_ids, native))

    def add_rows(self, rows: pa.Table) -> None:
        self._writer.write_table(rows)
        self.rows += rows.num_rows

    def add_encoded(self, data: bytes) -> int:
        """A row group another node encoded (encode_rows); checked before it is written."""
        self.add_rows(decode_rows(data, self.run_id, self.cell_id, self.repeat))
        return self.rows

    def commit(self) -> Path:
        self._writer.close()
        _fsync_replace(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        self._writer.close()
        self.tmp.unlink(missing_ok=True)
