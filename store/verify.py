"""Checking a warehouse against itself, reading only: every row's values against its row_hash,
every shard's row count against its cell, every table file against Parquet (and the page CRCs
the writers add). `matrix verify` reports; `matrix analyze` and `matrix run` refuse what fails.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError, first_line
from store import pages
from store.schema import keeps_values
from store.warehouse import LOGITS_LEAF, Warehouse, logits_matrix, row_hash

ROW_COLUMNS = ["prompt_id", "position", "logits_dtype", "logits", "row_hash"]
SMALL_COLUMNS = [c for c in ROW_COLUMNS if c != "logits"]


class DamagedShard(UserError):
    """A shard that does not parse, or whose rows do not match their hashes."""


@dataclass(frozen=True)
class Damage:
    path: str
    what: str
    cell_id: str | None = None
    repeat: int | None = None
    prompt_id: str | None = None
    position: int | None = None

    def detail(self) -> str:
        """What is wrong and where inside the file: `repeat 1 prompt p position 32: ...`."""
        at = " ".join(
            f"{k} {v}"
            for k, v in (("repeat", self.repeat), ("prompt", self.prompt_id), ("position", self.position))
            if v is not None
        )
        return f"{at}: {self.what}" if at else self.what

    def line(self) -> str:
        return f"{self.path}: {self.detail()}"

    def to_dict(self) -> dict:
        return asdict(self)


def _first_line(e: Exception) -> str:
    return first_line(str(e), type(e).__name__)


def native_check(
    kind: str, values: np.ndarray, hashes: list[str], native: np.ndarray | None = None
) -> list[tuple[int, str]]:
    """(row index, why) of each row of widened values (rows, vocab) float32 that is not exactly a
    `kind` value or whose native bytes do not hash to its row_hash. native: the same rows in their
    native dtype when the caller read them so (store/pages.py, which checked the low bits): hashed as
    they are."""
    if native is not None:
        lossy = np.zeros(len(values), bool)
    elif kind == "bf16":
        halves = values.view(np.uint16)  # (rows, 2 * vocab): little-endian, low half first
        lossy = halves[:, 0::2].any(-1)  # a widened bf16 has a zero low half
        native = halves[:, 1::2]  # the bf16 bits, a strided view (no pass over the data)
    elif kind == "f16":
        native = values.astype(np.float16)
        lossy = (native.astype(np.float32).view(np.uint32) != values.view(np.uint32)).any(-1)
    else:
        native, lossy = values, np.zeros(len(values), bool)
    out = []
    for i in range(len(values)):
        if lossy[i]:
            out.append((i, f"values are not {kind} (the low bits of a widened value are set)"))
        elif row_hash(native[i]) != hashes[i]:  # row_hash makes the row contiguous
            out.append((i, "values do not match row_hash"))
    return out


def bad_rows(rows: pa.Table, values: np.ndarray | None = None) -> list[tuple[int, str]]:
    """(row index, why) of every row whose values are not what its row_hash says. values: the
    rows' logits already decoded by the caller (logits_matrix), so they are not decoded twice."""
    if values is None:
        values = logits_matrix(rows.column("logits"))  # (rows, vocab) float32, widened from native
    kinds = np.array(rows.column("logits_dtype").to_pylist())
    hashes = rows.column("row_hash").to_pylist()
    out = []
    for kind in set(kinds):
        idx = np.flatnonzero(kinds == kind)
        out += [(int(idx[j]), why) for j, why in native_check(kind, values[idx], [hashes[i] for i in idx])]
    return sorted(out)


def check_rows(
    rows: pa.Table, path: str, cell_id: str | None, repeat: int | None, values: np.ndarray | None = None
) -> list[Damage]:
    prompts, positions = rows.column("prompt_id").to_pylist(), rows.column("position").to_pylist()
    return [Damage(path, why, cell_id, repeat, prompts[i], positions[i]) for i, why in bad_rows(rows, values)]


def verify_shard(
    wh: Warehouse, cell_id: str, repeat: int, expected_rows: int | None, table: str = "logits"
) -> tuple[list[Damage], int, int]:
    """(damage, rows checked, file bytes) of one shard (a logits shard, or a cell's side file: the
    same schema), row group by row group (bounded memory)."""
    if table == "layer_states":
        return verify_layer_shard(wh, cell_id, repeat)
    path = wh.shard_path(cell_id, repeat, table)
    try:
        pf = pq.ParquetFile(path, filesystem=wh.loc.fs, page_checksum_verification=True)
        leaf = pages.leaf_index(pf.schema, LOGITS_LEAF)
        f = wh.loc.fs.open_input_file(path) if wh.loc.fs else pa.OSFile(path)  # read, not mapped: RSS follows the page
    except Exception as e:  # a truncated or overwritten file: Parquet says why
        return [Damage(path, f"unreadable: {_first_line(e)}", cell_id, repeat)], 0, 0
    damage, rows = [], 0
    kept = keeps_values(pf.schema_arrow)
    with f:
        for g in range(pf.num_row_groups):
            try:
                t = pf.read_row_group(g, columns=SMALL_COLUMNS)
                damage += (
                    _check_group(pf, f, g, leaf, t, path, cell_id, repeat)
                    if kept
                    else _check_unkept(pf, g, path, cell_id, repeat)
                )
            except Exception as e:
                damage.append(Damage(path, f"row group {g} unreadable: {_first_line(e)}", cell_id, repeat))
                continue
            rows += t.num_rows
    if expected_rows is not None and pf.metadata.num_rows != expected_rows:
        damage.append(
            Damage(path, f"{pf.metadata.num_rows} rows, the cell has {expected_rows} per repeat", cell_id, repeat)
        )
    return damage, rows, _size(wh, path)


def verify_layer_shard(wh: Warehouse, cell_id: str, repeat: int) -> tuple[list[Damage], int, int]:
    """A layers: cell's hidden states: every row's values against its row_hash, a row group at a time."""
    from store.layer_states import native_states

    path = wh.shard_path(cell_id, repeat, "layer_states")
    try:
        pf = pq.ParquetFile(path, filesystem=wh.loc.fs, page_checksum_verification=True)
    except Exception as e:
        return [Damage(path, f"unreadable: {_first_line(e)}", cell_id, repeat)], 0, 0
    damage, rows = [], 0
    for g in range(pf.num_row_groups):
        try:
            t = pf.read_row_group(g)
            native = native_states(t)  # (rows, hidden) native dtype
        except Exception as e:
            damage.append(Damage(path, f"row group {g} unreadable: {_first_line(e)}", cell_id, repeat))
            continue
        d = t.select(["prompt_id", "position", "layer", "row_hash"]).to_pydict()
        damage += [
            Damage(
                path,
                f"layer {d['layer'][i]}: values do not match row_hash",
                cell_id,
                repeat,
                d["prompt_id"][i],
                d["position"][i],
            )
            for i in range(t.num_rows)
            if row_hash(native[i]) != d["row_hash"][i]
        ]
        rows += t.num_rows
    return damage, rows, _size(wh, path)


def _size(wh: Warehouse, path: str) -> int:
    return wh.loc.fs.get_file_info(path).size if wh.remote else os.path.getsize(path)


def _check_unkept(pf, g: int, path: str, cell_id: str | None, repeat: int | None) -> list[Damage]:
    """A row group of a shard that keeps no values (store/schema.py VALUES_KEY): every row's
    logits null; its row hashes have nothing here to be checked against."""
    logits = pf.read_row_group(g, columns=["logits"]).column(0)
    if logits.null_count != len(logits):
        return [
            Damage(
                path,
                f"row group {g}: {len(logits) - logits.null_count} row(s) with values in a shard that keeps none",
                cell_id,
                repeat,
            )
        ]
    return []


def _check_group(
    pf, f, g: int, leaf: int, t: pa.Table, path: str, cell_id: str | None, repeat: int | None
) -> list[Damage]:
    """One row group: its logits read from their pages (store/pages.py) and hashed in their native
    dtype; through Arrow where that reader does not apply (several dtypes, an unexpected encoding)."""
    kinds = set(t.column("logits_dtype").to_pylist())
    try:
        if len(kinds) != 1:
            raise pages.Unsupported("several native dtypes")
        native = pages.read_row_group_leaf(f, pf.metadata, pf.schema, g, leaf).rows(kinds.pop())
    except pages.Unsupported:
        full = pf.read_row_group(g, columns=ROW_COLUMNS)
        return check_rows(full, path, cell_id, repeat)
    except pages.Corrupt as e:
        return [Damage(path, f"row group {g}: {e}", cell_id, repeat)]
    if len(native) != t.num_rows:
        return [Damage(path, f"row group {g}: {len(native)} logits rows for {t.num_rows} rows", cell_id, repeat)]
    hashes = t.column("row_hash").to_pylist()
    bad = [i for i in range(len(native)) if row_hash(native[i]) != hashes[i]]
    prompts, positions = t.column("prompt_id").to_pylist(), t.column("position").to_pylist()
    return [Damage(path, "values do not match row_hash", cell_id, repeat, prompts[i], positions[i]) for i in bad]


def verify_table_files(wh: Warehouse, tables: Iterable[str]) -> list[Damage]:
    return [d for table in tables for d in verify_files(wh, wh.table_files(table))]


def verify_files(wh: Warehouse, paths: list[str]) -> list[Damage]:
    out = []
    for path in paths:
        try:
            pq.read_table(path, filesystem=wh.loc.fs, page_checksum_verification=True)
        except Exception as e:
            out.append(Damage(path, f"unreadable: {_first_line(e)}"))
    return out


SHARD_TABLES = ("logits", "layer_states")  # files of rows with their row hashes: checked row by row


def _shards(wh: Warehouse) -> set[tuple[str, int, str]]:
    """(cell, repeat, table) of every shard file: logits r<n> / d<n> (side), layer_states r<n>."""
    out = set()
    for prefix in SHARD_TABLES:
        for key in wh.loc.list(f"{prefix}/"):
            cid, name = key.split("/")[1], key.split("/")[-1]
            m = re.fullmatch(r"([rd])(\d+)\.parquet", name)
            if m is None or (m[1] == "d" and prefix != "logits"):  # not a file this version writes
                continue
            out.add((cid, int(m[2]), "side" if m[1] == "d" else prefix))
    return out


def _expected(wh: Warehouse, bad_tables: set[str], side_tables) -> dict[str, tuple]:
    """cell -> (repeats, rows per repeat, the shard tables it must have) of every done cells row,
    read from the cells files not found damaged (bad_tables)."""
    expected = {}
    for path in wh.table_files("cells"):
        if path not in bad_tables:
            for c in pq.read_table(path, filesystem=wh.loc.fs).to_pylist():
                if c["status"] == "done":
                    side = ("logits",) + tuple(side_tables(c))
                    expected[c["cell_id"]] = (c["repeats"], c["rows_per_repeat"], side)
    return expected


def _missing(wh: Warehouse, expected: dict[str, tuple], shards: set, wanted) -> list[Damage]:
    """A shard a done cell must have and the warehouse has not, for the cells asked for."""
    return [
        Damage(wh.shard_path(cid, r, t), "missing: the cell is done but has no such shard", cid, r)
        for cid, (repeats, _, side) in expected.items()
        for t in side
        for r in range(repeats)
        if (cid, r, t) not in shards and wanted(cid)
    ]


def verify(
    wh: Warehouse,
    cells: list[str] | None = None,
    log: Callable[[str], None] = lambda m: None,
    *,
    side_tables: Callable[[dict], tuple[str, ...]],
) -> dict:
    """Every table file and every shard (of `cells`, a list of cell ids or stack-id prefixes, when
    given). side_tables: the shard tables a done cells row has beside its logits (the per-cell
    extras': extras.side_tables); a missing one is damage. Returns the report; nothing is written."""
    from store.schema import TABLES

    t0 = time.perf_counter()
    damage = verify_table_files(wh, [t for t in TABLES if t not in SHARD_TABLES])
    expected = _expected(wh, {d.path for d in damage}, side_tables)
    shards = _shards(wh)  # (cell, repeat, table) present

    def wanted(cid: str) -> bool:
        return not cells or any(cid == c or cid.startswith(c) for c in cells)

    damage += _missing(wh, expected, shards, wanted)
    todo = sorted(k for k in shards if wanted(k[0]))
    rows = size = 0
    for i, (cid, r, t) in enumerate(todo, 1):  # the row count is checked for a capture's shard only
        d, n, b = verify_shard(wh, cid, r, expected.get(cid, (0, None))[1] if t == "logits" else None, t)
        damage, rows, size = damage + d, rows + n, size + b
        el = time.perf_counter() - t0
        log(
            f"[shards {i}/{len(todo)}] {cid} {'' if t == 'logits' else t + ' '}r{r}: {n} rows"
            f"{', DAMAGED' if d else ''} | {size / 2**20:.0f} MiB in {el:.1f}s "
            f"({size / 2**20 / max(el, 1e-9):.0f} MiB/s)"
        )
    el = time.perf_counter() - t0
    return {
        "warehouse": wh.where,
        "shards": len(todo),
        "rows": rows,
        "bytes": size,
        "seconds": round(el, 2),
        "mib_per_s": round(size / 2**20 / max(el, 1e-9), 1),
        "damage": [d.to_dict() for d in damage],
        "damaged_files": sorted({d.path for d in damage}),
    }
