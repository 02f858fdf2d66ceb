"""A cell's outcome as its cells row: done (with what its captures measured), skipped or failed.

The run loop (matrix/run/sweep.py) decides the outcome; this module only writes it down, so every
column of a cells row has one home.
"""

from __future__ import annotations

import json
import time

import extras
from common import ids
from common.stack import Cell
from matrix.run.failures import Failure
from matrix.run.live import Live
from matrix.run.plan import Plan
from store import Warehouse
from store import rows as R
from store.cell_rows import CellRow
from store.floors import StorageFloor
from store.warehouse import row_hashes


def _cell_fields(plan: Plan, cell: Cell) -> dict:
    """The columns every cells row of this cell has, captured or skipped."""
    return {
        **cell.axes(),
        **R.model_fields(plan.models[cell.model].resolved),
        "stride": plan.spec.stride,
        "positions": plan.spec.positions.to_json(),
        "corpus": plan.spec.corpus,
        "options": json.dumps(cell.opts, sort_keys=True),
        "centroid_group": cell.centroid_group,
        "centroid": plan.spec.centroid,
        "calibration": cell.calibration,
        "stack_id": ids.base_stack(cell.stack_id),
        "replica": cell.replica,
        "build": cell.build,
        **extras.cell_records(cell),
    }


def skipped_row(plan: Plan, cell: Cell, run_id: str, reason: str) -> dict:
    return R.cell_row(
        cell.cell_id,
        run_id,
        "skipped",
        **_cell_fields(plan, cell),
        skip_reason=reason,
        repeats=0,
        host=None,
        build_libraries=json.dumps(plan.builds.get(cell.cell_id), sort_keys=True),
    )


def failed_row(plan: Plan, live: Live, run_id: str, failure: Failure, attempts: int) -> dict:
    """A cell that raised, or whose actor died more often than the spec's retries allow. Its
    complete shards stay (the next run captures only the missing repeats)."""
    loaded = live.loaded or {}
    return R.cell_row(
        live.cell.cell_id,
        run_id,
        "failed",
        **_cell_fields(plan, live.cell),
        repeats=0,
        error_class=failure.error_class,
        error=failure.message,
        attempts=attempts,
        host=loaded.get("host"),
        node_id=loaded.get("node_id"),
        build_libraries=json.dumps(plan.builds.get(live.cell.cell_id), sort_keys=True),
    )


def done_row(plan: Plan, live: Live, run_id: str, wh: Warehouse, attempts: int = 1) -> dict:
    spec, cell, loaded = plan.spec, live.cell, live.loaded
    art = loaded.get("artifact") or {}
    # shard 0 read once (on object storage each read is a request): its hashes, rows and dtype
    first = wh.read_shard(cell.cell_id, 0, ["prompt_id", "position", "row_hash", "logits_dtype"])
    hashes = [row_hashes(first)]
    hashes += [wh.shard_hashes(cell.cell_id, r) for r in range(1, spec.repeats)]
    ref = plan.reference_cells.get(cell.model)
    return R.cell_row(
        cell.cell_id,
        run_id,
        "done",
        **_cell_fields(plan, cell),
        bit_reproducible=all(h == hashes[0] for h in hashes[1:]),
        repeats=spec.repeats,
        rows_per_repeat=first.num_rows,
        n_prompts=len(plan.models[cell.model].prompts),
        threads=loaded["settings"].get("threads"),
        bos_policy=spec.bos,
        is_reference=ref == cell.cell_id,
        reference_cell_id=ref,
        vocab_size=plan.models[cell.model].vocab,
        engine_vocab_size=loaded["vocab_size"],
        logits_dtype=first.column("logits_dtype")[0].as_py(),
        artifact=art.get("path"),
        artifact_sha256=art.get("sha256"),
        artifact_recipe=json.dumps({**art["recipe"], **_candidate_facts(plan, cell)}, sort_keys=True) if art else None,
        tokenizer_parity=live.parity["status"] if live.parity else "not_checked",
        max_tokens=cell.max_tokens,
        settings=json.dumps(loaded["settings"], sort_keys=True),
        fingerprint=json.dumps(loaded.get("fingerprint"), sort_keys=True, default=str),
        versions=json.dumps(loaded["versions"], sort_keys=True),
        host=loaded["host"],
        node_id=loaded["node_id"],
        rows_via=loaded["rows_via"],
        model_via=loaded["model_via"],
        load_seconds=loaded["load_seconds"],
        loaded_by=loaded.get("loaded_by"),
        storage=StorageFloor.of_captures(live.storage).to_json(),
        **extra_columns(live),
        length_refusals=refusals_column(live.refusals),
        capture_seconds=live.capture_s,
        build_libraries=json.dumps(loaded["build_libraries"], sort_keys=True),
        attempts=attempts,
    )


def extra_columns(live: Live) -> dict[str, str | None]:
    """Each per-cell extra's cells column, from its part of every capture's manifest (null without)."""
    return {
        x.column: x.record(live.extras[x.key]) if live.extras.get(x.key) else None
        for x in extras.registered()
        if x.column
    }


def refusals_column(parts: dict[int, dict | None]) -> str | None:
    """cells.length_refusals from this run's captures' manifests (repeat -> length_refusals): what
    the engine refused for the length fed (actors/capture.py feed()), null where it refused none.
    Every repeat refuses the same (the kernel decides by shape): that record, with the repeats it
    is of; where they differ, each repeat's."""
    if not any(parts.values()):
        return None
    seen = {json.dumps(p, sort_keys=True) for p in parts.values()}
    if len(seen) == 1:
        return json.dumps({**next(iter(parts.values())), "repeats": sorted(parts)}, sort_keys=True)
    return json.dumps({"by_repeat": {str(r): p for r, p in sorted(parts.items())}}, sort_keys=True)


def _refused_note(refused: dict | None) -> str:
    """What a capture's log line says of the lengths the engine refused ("" where none)."""
    out = ""
    if refused and refused["longer_feeds"]:
        out += f" ({len(refused['longer_feeds'])} prompt(s) fed a longer prefix: the engine refused the one they need)"
    if refused and refused["skipped"]:
        first = next(iter(refused["skipped"].values()))
        out += (
            f" ({refused['skipped_rows']} row(s) of {len(refused['skipped'])} prompt(s) left out, "
            f"every length refused: {first['reason']})"
        )
    return out


def _candidate_facts(plan: Plan, cell: Cell) -> dict:
    """A published file's label and what its header declares (quant type, importance matrix)."""
    if not cell.artifact:
        return {}
    from matrix.spec.candidate_check import header_facts

    return {**header_facts(cell, plan.models[cell.model].resolved), **({"label": cell.label} if cell.label else {})}


class Outcomes:
    """What a run records as its cells end: their cells rows, tokenizer parity, the metrics measured in
    the actors, the runs row's counts, and the progress lines. The run loop decides; this writes."""

    def __init__(self, plan: Plan, wh: Warehouse, run: dict, log):
        self.plan, self.wh, self.run, self.run_id, self.log = plan, wh, run, run["run_id"], log
        self.cells_total, self.cells_done = len(plan.cells), len(plan.complete)
        self.units_done = self.rows = self.inline_written = 0
        self.units_total = 0  # captures the run will make (the loop adds and removes them)
        self.via = {"node": 0, "driver": 0, "bytes_to_driver": 0}  # runs.rows_delivery
        self.failed: dict[str, Failure] = {}  # cell id -> why
        self.finished: set[str] = set(plan.complete)  # cells whose shards are all in the warehouse
        self.t0 = time.perf_counter()

    def progress(self) -> None:
        """The runs row follows the sweep, so an interrupted run still shows what it did."""
        self.wh.write_rows(
            "runs",
            self.run_id,
            [
                {
                    **self.run,
                    "cells_done": self.cells_done,
                    "rows_written": self.rows,
                    "cells_failed": len(self.failed),
                    "rows_delivery": json.dumps(self.via),
                }
            ],
        )

    def skipped(self, live: Live, reason: str) -> None:
        cid = live.cell.cell_id
        self.log(f"[cells {self.cells_done + 1}/{self.cells_total}] {cid} skipped: {reason}")
        self.wh.write_rows("cells", cid, [skipped_row(self.plan, live.cell, self.run_id, reason)])
        self.cells_done += 1
        self.progress()

    def failed_cell(self, live: Live, failure: Failure, attempt: int) -> None:
        cid = live.cell.cell_id
        self.failed[cid] = failure
        self.wh.write_rows("cells", cid, [failed_row(self.plan, live, self.run_id, failure, attempt)])
        self.log(
            f"[cells {self.cells_done}/{self.cells_total}] {cid} FAILED after {attempt} attempt(s): {failure.line()}"
        )
        self.progress()

    def done(self, live: Live, attempts: int, close) -> None:
        """close(): stops the cell's actors, once its row is written, and starts what waited for
        the cell (finished by then), so those load while the rest is recorded here."""
        cid = live.cell.cell_id
        row = done_row(self.plan, live, self.run_id, self.wh, attempts)
        self.wh.write_rows("cells", cid, [row])
        self.finished.add(cid)
        try:
            close()
        finally:  # a waiting cell that fails to start still finds this one recorded whole
            self.cells_done += 1
            self.log(f"[cells {self.cells_done}/{self.cells_total}] {cid} done")
            self._store_inline(row, live)
            self.progress()

    def loaded(self, live: Live, cid: str, result: dict) -> None:
        live.loaded = result
        away = (
            f"; weights {result['model_via']}, rows via the {result['rows_via']}"
            if result["model_via"] not in ("local", "gguf") or result["rows_via"] != "node"
            else ""
        )
        how = f"{cid} took over the model {result['loaded_by']} loaded" if result.get("loaded_by") else f"loaded {cid}"
        self.log(f"{how} on {result['host']} (pid {result['pid']}) in {result['load_seconds']:.1f}s{away}")

    def parity(self, live: Live, cid: str, result: dict) -> None:
        live.parity = result
        self.wh.write_rows("tokenizer_parity", cid, R.parity_rows(cid, self.run_id, live.cell.engine, result["rows"]))
        if result["status"] == "mismatch":
            bad = [r for r in result["rows"] if not r["match"]]
            what = "; ".join(
                f"{r['prompt_id']}: {r['diagnosis']} at position {r['first_diff']}" for r in bad[:3]
            ) + "".join(f"; {p}" for p in result["problems"])
            self.log(
                f"tokenizer parity MISMATCH for {cid} ({len(bad)}/{len(result['rows'])} prompts): {what}"
                " -- capture still uses the canonical ids"
            )

    def captured(self, live: Live, cid: str, repeat: int, result: dict) -> None:
        self.units_done += 1
        self.rows += result["rows"]
        live.capture_s += result["seconds"]
        live.storage.append(result["storage"])
        for key, part in result.get("extras", {}).items():  # each per-cell extra's part of the manifest
            live.extras.setdefault(key, []).append(part)
        live.refusals[repeat] = refused = result.get("length_refusals")
        if result.get("metrics") is not None:
            live.inline[repeat] = result["metrics"]
        live.left -= 1
        self.via[result["rows_via"]] += 1
        self.via["bytes_to_driver"] += result["bytes_sent"]
        rate = self.rows / max(time.perf_counter() - self.t0, 1e-9)
        self.log(
            f"[cells {self.cells_done}/{self.cells_total} | captures {self.units_done}/{self.units_total}] "
            f"{cid} r{repeat}: {result['rows']} rows in {result['seconds']:.1f}s"
            + (
                f" (measured against the reference in {m['seconds']:.1f}s of it)"
                if (m := result.get("metrics")) and "seconds" in m
                else ""
            )
            + _refused_note(refused)
            + " "
            f"| rows {self.rows} | {rate:.1f} rows/s"
        )

    def _store_inline(self, row: dict, live: Live) -> None:
        """The metrics the cell's actor measured, written as `matrix analyze` would write them."""
        if not live.inline:
            return
        errors = sorted({f"{m['error']}" for m in live.inline.values() if "error" in m})
        if errors:
            self.log(
                f"{row['cell_id']}: metrics not measured in the actor ({errors[0]}); `matrix analyze` measures them"
            )
            return
        from analysis.analyze import store_inline

        ref_id = next(iter(live.inline.values()))["reference"]
        ref = (
            row
            if ref_id == row["cell_id"]
            else next(r for r in self.wh.read_rows("cells", ref_id) if r["status"] == "done")
        )
        if store_inline(self.wh, CellRow.of(row), CellRow.of(ref), live.inline, self.log):
            self.inline_written += 1
        else:
            self.log(f"{row['cell_id']}: some repeats were captured in an earlier run; `matrix analyze` measures them")
