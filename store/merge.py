"""`matrix merge`: warehouses captured elsewhere (a machine outside the cluster, another site) into one.

Everything is checked before anything is written: each source's schema version, each model's
weights against the destination's model of that name, each cell present on both sides row hash
for row hash, and every incoming shard against its row hashes (as `matrix verify` does). A
refusal is one line and exit 2 with the destination untouched; a damaged shard leaves its cell
out (nothing of that cell is copied) and the rest goes on. Files are copied byte for byte, so a
row keeps its run id and hash; a cell's `cells` row is written last, so a merge that stops midway
leaves nothing a reader counts as done, and running it again finishes it. Analysis outputs are
not copied: `matrix analyze` on the destination measures the new cells against its reference.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Callable

import pyarrow.parquet as pq

from common.errors import UserError
from store.location import write_whole
from store.schema import SCHEMA_VERSION
from store.verify import verify_shard
from store.warehouse import MARKER, Warehouse

HASH_COLUMNS = {
    "logits": ["repeat", "prompt_id", "position", "path", "step", "row_hash"],
    "side": ["repeat", "prompt_id", "position", "path", "step", "row_hash"],
    "layer_states": ["repeat", "prompt_id", "position", "layer", "row_hash"],
}


@dataclass
class Incoming:
    """What one source brings: its cells to copy, those already present, those left out and why."""

    src: Warehouse
    copy: list[dict] = field(default_factory=list)  # cells rows
    present: list[str] = field(default_factory=list)  # identical cells the destination has
    left_out: dict[str, str] = field(default_factory=dict)  # cell id -> why (damage, not done)
    shards: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # cell id -> (table, repeat)


def open_source(where: str) -> Warehouse:
    src = Warehouse(where)
    if not src.check():
        raise UserError(f"{where}: no warehouse here")
    version = getattr(src, "version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{where}/{MARKER}: schema_version {version}, this logit-matrix merges "
            f"{SCHEMA_VERSION}: `matrix analyze --warehouse {where}` brings it up to date first"
        )
    return src


def shard_list(wh: Warehouse, cell: dict, side_tables: Callable[[dict], tuple[str, ...]]) -> list[tuple[str, int]]:
    """(table, repeat) of every shard a done cell has: its logits, and its extras' tables."""
    return [(t, r) for t in ("logits",) + tuple(side_tables(cell)) for r in range(cell["repeats"] or 0)]


def row_keys(wh: Warehouse, cell_id: str, shards: list[tuple[str, int]]) -> dict:
    """{(table, repeat, prompt, position, ...): row_hash} over a cell's shards (small columns only)."""
    out = {}
    for table, r in shards:
        path = wh.shard_path(cell_id, r, table)
        names = set(pq.read_schema(path, filesystem=wh.loc.fs).names)
        cols = [c for c in HASH_COLUMNS[table] if c in names]
        t = pq.read_table(path, columns=cols, filesystem=wh.loc.fs).to_pylist()
        out.update({(table, r, *(row[c] for c in cols if c != "row_hash")): row["row_hash"] for row in t})
    return out


def check_models(dest_cells: list[dict], sources: list[tuple[Warehouse, list[dict]]]) -> None:
    """One model name, one set of weights: across the destination and every source (the first
    side that names a model sets its weights). Weights are the dequantised checkpoint's digest
    (weights_sha256) and the file it came from (source_sha256); a GGUF run as it is has only the
    latter. Each is compared where both sides have it."""
    keys = ("weights_sha256", "source_sha256")
    seen: dict[tuple[str, str], tuple[str, str]] = {}  # (model, field) -> (value, where it was seen)
    for c in dest_cells:
        for key in keys:
            if c.get(key):
                seen.setdefault((c["model"], key), (c[key], "the destination"))
    for src, cells in sources:
        for c in cells:
            for key in keys:
                if c["status"] != "done" or not c.get(key):
                    continue
                have, where = seen.setdefault((c["model"], key), (c[key], str(src.where)))
                if c[key] != have:
                    raise UserError(
                        f"{src.where}/cells/{c['cell_id']}.parquet: {key} {c[key]} "
                        f"for model {c['model']!r}, {where} has {have} for that name"
                    )


def _check_prompts(src: Warehouse, dest: Warehouse) -> None:
    ours = {p["prompt_id"]: p["ids_sha256"] for p in dest.read_all("prompts")} if dest.check() else {}
    for p in src.read_all("prompts"):
        if p["prompt_id"] in ours and ours[p["prompt_id"]] != p["ids_sha256"]:
            raise UserError(
                f"{src.where}/prompts/{p['prompt_id']}.parquet: ids_sha256 {p['ids_sha256']}, the "
                f"destination's prompt of that id has {ours[p['prompt_id']]}"
            )


def plan_source(src: Warehouse, dest: Warehouse, side_tables: Callable, log: Callable[[str], None]) -> Incoming:
    """Every check of one source against the destination; raises UserError for a refusal."""
    inc = Incoming(src)
    cells = src.read_all("cells")
    dest_cells = {c["cell_id"]: c for c in (dest.read_all("cells") if dest.check() else [])}
    _check_prompts(src, dest)
    for c in sorted(cells, key=lambda c: c["cell_id"]):
        cid = c["cell_id"]
        if c["status"] != "done":
            inc.left_out[cid] = f"{c['status']} there (nothing captured to merge)"
            continue
        shards = shard_list(src, c, side_tables)
        mine = dest_cells.get(cid)
        if mine is not None and mine["status"] == "done":
            theirs, ours = row_keys(src, cid, shards), row_keys(dest, cid, shard_list(dest, mine, side_tables))
            if theirs != ours:
                diff = len(set(theirs.items()) ^ set(ours.items()))
                raise UserError(
                    f"{src.where}/cells/{cid}.parquet: cell {cid} is in the destination with different "
                    f"rows ({len(theirs)} rows there, {len(ours)} here, {diff} differ); merge refused"
                )
            inc.present.append(cid)
            continue
        damage = [
            d
            for t, r in shards
            for d in verify_shard(src, cid, r, c["rows_per_repeat"] if t == "logits" else None, t)[0]
        ]
        if damage:
            inc.left_out[cid] = f"damaged: {damage[0].path}: {damage[0].detail()}"
            log(f"{cid}: not merged: {inc.left_out[cid]}")
            continue
        inc.copy.append(c)
        inc.shards[cid] = shards
    return inc


def copy_file(src: Warehouse, dest: Warehouse, key: str) -> None:
    """One file, byte for byte, through a temp file that becomes the destination's only once whole."""
    path = src.loc.path(key)

    def write(tmp) -> None:
        with src.loc.fs.open_input_stream(path) if src.loc.fs else open(path, "rb") as f, open(tmp, "wb") as out:
            shutil.copyfileobj(f, out, 8 << 20)

    write_whole(dest.loc, key, write)


def copy_cell(inc: Incoming, dest: Warehouse, cell: dict, have: dict[str, set]) -> int:
    """A cell's shards (and no other: a failed capture's leftovers go), its parity rows, the runs
    its rows name and its prompts where the destination lacks them, then its cells row."""
    src, cid = inc.src, cell["cell_id"]
    keys = [Warehouse.shard_key(cid, r, table) for table, r in inc.shards[cid]]
    for key in keys:
        copy_file(src, dest, key)
    for stale in set(dest.loc.list(f"logits/{cid}/") + dest.loc.list(f"layer_states/{cid}/")) - set(keys):
        dest.loc.delete(stale)
    extra = [("tokenizer_parity", cid)] if src.has_rows("tokenizer_parity", cid) else []
    runs, prompts = shard_values(src, cid, inc.shards[cid], ("run_id", "prompt_id"))
    extra += [("runs", r) for r in sorted(runs | {cell["run_id"]}) if r not in have["runs"] and src.has_rows("runs", r)]
    extra += [("prompts", p) for p in sorted(prompts) if p not in have["prompts"]]
    for table, name in extra:
        copy_file(src, dest, f"{table}/{name}.parquet")
        have.setdefault(table, set()).add(name)
    copy_file(src, dest, f"cells/{cid}.parquet")  # last: the cell counts as done only now
    return len(keys) + len(extra) + 1


def shard_values(src: Warehouse, cid: str, shards: list[tuple[str, int]], columns: tuple[str, ...]) -> list[set[str]]:
    """The distinct values of small columns (run_id, prompt_id) over a cell's logits shards, one
    read of each shard."""
    out: list[set[str]] = [set() for _ in columns]
    for table, r in shards:
        if table == "logits":
            t = pq.read_table(src.shard_path(cid, r), columns=list(columns), filesystem=src.loc.fs)
            for seen, col in zip(out, columns):
                seen |= set(t.column(col).unique().to_pylist())
    return out


def merge(sources: list[str], into: str, side_tables: Callable, log: Callable[[str], None]) -> dict:
    """Check every source, then copy what is new. Returns the report (what was copied, skipped,
    left out). Nothing is written to the destination (not even its marker) until every check passed."""
    dest = Warehouse(into)
    dest.check()  # a destination of an incompatible version fails here, before anything
    srcs = [open_source(s) for s in sources]
    if any(s.where == dest.where for s in srcs):
        raise UserError(f"{into}: the destination is also a source")
    made = dest.loc.state() == "missing" and not dest.remote
    if made:  # a directory's lock file needs its directory; it goes again if the merge is refused
        dest.loc.mkdirs("")
    try:
        with dest.lock(log):
            plans = _plan(srcs, dest, side_tables, log)
            dest.create()
            dest.migrate(log)
            return _copy(plans, dest, log)
    except UserError:
        if made and [p.name for p in dest.loc.root.iterdir()] in ([], [".lock"]):
            shutil.rmtree(dest.loc.root)
        raise


def _plan(srcs: list[Warehouse], dest: Warehouse, side_tables: Callable, log) -> list[Incoming]:
    check_models(dest.read_all("cells") if dest.check() else [], [(s, s.read_all("cells")) for s in srcs])
    plans = [plan_source(s, dest, side_tables, log) for s in srcs]
    _check_between(plans)
    return plans


def _copy(plans: list[Incoming], dest: Warehouse, log) -> dict:
    have = {t: {k.split("/")[-1].removesuffix(".parquet") for k in dest.loc.list(f"{t}/")} for t in ("runs", "prompts")}
    report = {"into": dest.where, "sources": []}
    for inc in plans:
        files = 0
        for i, cell in enumerate(inc.copy, 1):
            files += copy_cell(inc, dest, cell, have)
            log(
                f"[merge {i}/{len(inc.copy)}] {inc.src.where}: {cell['cell_id']} "
                f"({len(inc.shards[cell['cell_id']])} shard(s))"
            )
        report["sources"].append(
            {
                "source": inc.src.where,
                "merged": [c["cell_id"] for c in inc.copy],
                "already_present": inc.present,
                "left_out": inc.left_out,
                "files": files,
            }
        )
    return report


def _check_between(plans: list[Incoming]) -> None:
    """Two sources that bring the same cell id must bring the same rows (the first one is copied)."""
    seen: dict[str, Incoming] = {}
    for inc in plans:
        for cell in list(inc.copy):
            cid = cell["cell_id"]
            if cid not in seen:
                seen[cid] = inc
                continue
            first = seen[cid]
            if row_keys(first.src, cid, first.shards[cid]) != row_keys(inc.src, cid, inc.shards[cid]):
                raise UserError(
                    f"{inc.src.where}/cells/{cid}.parquet: cell {cid} is also in {first.src.where} "
                    "with different rows; merge refused"
                )
            inc.copy.remove(cell)
            inc.present.append(cid)
