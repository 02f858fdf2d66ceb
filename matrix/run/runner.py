"""`matrix run`: work out what is missing, start every unfinished cell, and record what comes back.

Cells run on an executor (matrix/run/launch.py): Ray's or this machine's. With Ray the caller
(the CLI) owns the connection: this module expects `ray` to be initialised and never shuts it down.
The rows of the small tables
are built by store/rows.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

import extras
from common import ids
from common.errors import UserError, first_line
from common.files import sha256_file
from common.stack import Cell
from matrix import __version__
from matrix.run import failures
from matrix.run.plan import ModelPlan, Plan
from matrix.run.sweep import Sweep
from matrix.spec import calibration, candidates
from matrix.spec.cells import Matrix
from matrix.spec.corpus import tokenize
from matrix.spec.models import fetch
from matrix.spec.parse import Spec
from store import SCHEMA_VERSION, Warehouse
from store import rows as R


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "logit-matrix": __version__}
    for dist in (
        "numpy",
        "pyarrow",
        "duckdb",
        "ray",
        "pyyaml",
        "torch",
        "transformers",
        "accelerate",
        "safetensors",
        "gguf",
        "tokenizers",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def prepare(matrix: Matrix, wh: Warehouse, log: Callable[[str], None]) -> Plan:
    """Resolve models, tokenise once per model, and work out what is left to do."""
    from matrix.spec import gguf_model

    spec, models = matrix.spec, {}
    cells = matrix.cells
    for name, ref in spec.models.items():
        free = gguf_model.hf_free(matrix, name)  # llama.cpp on GGUF files alone: no dequantised copy, no transformers
        m = fetch(ref, log=log, dequantise=not free)
        if free:
            tok, config = gguf_model.load(m.gguf_path)
        else:
            import transformers

            tok = transformers.AutoTokenizer.from_pretrained(m.hf_dir)
            config = transformers.AutoConfig.from_pretrained(m.hf_dir)
        vocab = int(getattr(config, "vocab_size", 0) or 0) or len(tok)
        if len(tok) > vocab:
            raise UserError(
                f"{m.hf_dir}: the tokenizer has {len(tok)} tokens but the model has "
                f"vocab_size {vocab}: tokenizer and model do not match"
            )
        tok_file = os.path.join(m.hf_dir, "tokenizer.json") if m.hf_dir else None
        tok_sha = sha256_file(tok_file) if tok_file and os.path.isfile(tok_file) else None
        prompts = tuple(tokenize(spec.corpus, name, tok, spec.bos, tok_sha, log))
        for cell in matrix.cells:  # a published file of another model is refused before anything runs
            if cell.artifact and cell.model == name:
                candidates.check(candidates.resolve(cell, m), config, tok, vocab)
        calibration.check(spec, [c for c in matrix.cells if c.model == name], prompts, tok)
        hidden = int(getattr(getattr(config, "text_config", None) or config, "hidden_size", 0) or 0)
        cells = resolve_extras(spec, cells, name, {"depth": _depth(config), "hidden": hidden}, prompts)
        special = {"bos": tok.bos_token_id, "eos": tok.eos_token_id}
        models[name] = ModelPlan(m, prompts, special, vocab, hidden)
    return Plan(dataclasses.replace(matrix, cells=cells), models)


def _depth(config) -> int:
    cfg = getattr(config, "text_config", None) or config  # multimodal configs keep the LM's depth inside
    return int(getattr(cfg, "num_hidden_layers", 0) or 0)


def resolve_extras(spec: Spec, cells: tuple[Cell, ...], model: str, facts: dict, prompts: list) -> tuple[Cell, ...]:
    """Each per-cell extra of the model's cells resolved against the model and its prompts
    (Extra.resolve; what it cannot hold is exit 2), before anything runs."""

    def fail(msg: str) -> UserError:
        return UserError(f"{spec.path}: {msg}")

    def resolved(c: Cell) -> Cell:
        if c.model != model or not c.extras:
            return c
        done = tuple((x.key, x.resolve(v, c, facts, prompts, fail)) for x, v in extras.of(c))
        return c.with_stack(extras=tuple(sorted(done)))

    return tuple(resolved(c) for c in cells)


def side_rows(plan: Plan, cell: Cell) -> dict[str, tuple[int, bool]]:
    """{table: (rows one repeat adds to it, whether that count is exact)} for the cell's extras."""
    prompts = plan.models[cell.model].prompts
    fed = [plan.spec.positions.fed(p.token_ids, cell.max_tokens)[1] for p in prompts]
    lengths = [len(p.token_ids) for p in prompts]
    out: dict[str, tuple[int, bool]] = {}
    for x, v in extras.of(cell):
        rows, exact = x.side_rows(v, fed, lengths)
        got = out.get(x.table, (0, True))
        out[x.table] = (got[0] + rows, got[1] and exact)
    return out


@dataclass(frozen=True)
class Resume:
    """How a run treats what earlier runs left (the `matrix run` flags of the same names)."""

    reuse_other_builds: bool = False
    skip_failed: bool = False
    recapture_damaged: bool = False
    own_cluster: bool = False  # this run started its Ray cluster (no --address), or runs locally: see builds.probe


def bind(
    plan: Plan, wh: Warehouse, ex, log: Callable[[str], None], resume: Resume = Resume(), nodes: list | None = None
) -> Plan:
    """Bind every cell to the engine build of the node(s) it will run on (matrix/run/builds.py), then
    work out what is left to do. Run under the writer lock; ex: the executor (launch.Executor);
    nodes: those of ex, with the node types a launcher config can start."""
    from matrix.run import builds

    rows = wh.read_all("cells") if wh.check() else []  # read once: the builds and find_todo use it
    answers = builds.probe(
        plan.matrix.cells, plan.resolved(), ex.nodes() if nodes is None else nodes, log, ex, resume.own_cluster
    )
    cells, built, left_out = builds.bind(plan.matrix.cells, answers, builds.captured_builds(rows), log)
    for sid, why in left_out.items():
        log(f"not run this time: {sid}: {why}")
    bound = {c.stack_id: c.cell_id for c in cells}
    refs = {m: bound[s] for m, s in plan.matrix.reference_stacks.items() if s in bound}
    plan = dataclasses.replace(plan, cells=tuple(cells), builds=built, left_out=left_out, reference_cells=refs)
    return find_todo(plan, wh, resume, log, rows)


def _other_build(cell: Cell, rows: dict[str, dict], repeats: int) -> dict | None:
    """The newest complete capture of this stack (and replica) by another engine build: one whose
    id is the stack at its recorded build (or the stack alone, captured before builds were recorded)."""
    same = [
        r
        for cid, r in rows.items()
        if cid != cell.cell_id
        and r["status"] == "done"
        and (r["repeats"] or 0) >= repeats
        and cid == cell.bound(r.get("build")).cell_id
    ]
    return max(same, key=lambda r: r["finished_at"]) if same else None


def expected_rows(plan: Plan, cell: Cell) -> int:
    """Rows one repeat of this cell holds: its sampled positions over every prompt."""
    return sum(len(plan.spec.positions.fed(p.token_ids, cell.max_tokens)[1]) for p in plan.models[cell.model].prompts)


def complete_shards(plan: Plan, wh: Warehouse, cell: Cell, resume: Resume, log: Callable[[str], None]) -> set[int]:
    """The repeats whose shard is complete: it parses, with the cell's row count (a file that only
    exists is not done). With recapture_damaged every row is checked against its hash too, and a
    damaged shard is moved aside (never deleted) to be captured again; without, it is refused."""
    from store.verify import verify_shard

    want, side, done = expected_rows(plan, cell), side_rows(plan, cell), set()
    for r in sorted(wh.completed_repeats(cell.cell_id)):
        if resume.recapture_damaged:
            damage, _, _ = verify_shard(wh, cell.cell_id, r, want)
            why = damage[0].detail() if damage else None
        else:
            try:
                n = wh.shard_rows(cell.cell_id, r)
                why = None if n == want else f"{n} rows, the cell has {want} per repeat"
            except Exception as e:  # a truncated or overwritten file: Parquet says why
                why = "unreadable: " + first_line(str(e), type(e).__name__)
        for table, (rows, exact) in side.items():  # the extras' shards, complete too
            why = why or _side_shard_problem(wh, cell, r, table, rows, exact)
        if why is None and (lost := _values_lost(plan, wh, cell.cell_id, r)):
            log(
                f"{wh.shard_path(cell.cell_id, r)}: its rows' values were not kept (keep_rows: references) {lost}; "
                "capturing it again"
            )
        elif why is None:
            done.add(r)
        elif resume.recapture_damaged:
            aside = wh.move_aside(cell.cell_id, r, plan.aside)
            log(f"{wh.shard_path(cell.cell_id, r)}: damaged ({why}); moved to {aside}, capturing it again")
        else:
            raise UserError(
                f"{wh.shard_path(cell.cell_id, r)}: damaged ({why}); run `matrix verify`, or "
                "`matrix run --recapture-damaged` to move it aside and capture it again"
            )
    return done


def _values_lost(plan: Plan, wh: Warehouse, cell_id: str, repeat: int) -> str | None:
    """Why a shard whose values were not kept cannot count as done, or None: the spec now keeps
    every stack's values, or the metrics measured from it never reached the warehouse (the run
    that captured it ended before the cell did), and nothing can measure it now."""
    if wh.shard_keeps_values(cell_id, repeat):
        return None
    if plan.spec.keep_rows == "all":
        return "and the spec keeps every stack's values now"
    return None if wh.table_meta("metrics", cell_id) is not None else "and no metrics of them were stored"


def _side_shard_problem(
    wh: Warehouse, cell: Cell, repeat: int, table: str, rows: int, exact: bool = True
) -> str | None:
    try:
        n = wh.shard_rows(cell.cell_id, repeat, table)
    except FileNotFoundError:
        return f"its {table} shard is missing"
    except Exception as e:
        return f"{table} shard unreadable: " + first_line(str(e), type(e).__name__)
    if n == rows or (not exact and n >= rows):
        return None
    return f"{table}: {n} rows, the cell has {'' if exact else 'at least '}{rows} per repeat"


def find_todo(
    plan: Plan,
    wh: Warehouse,
    resume: Resume = Resume(),
    log: Callable[[str], None] = lambda m: None,
    cell_rows: list[dict] | None = None,
) -> Plan:
    """Which (cell, repeat) captures are missing for the bound cells. A cell is its stack run by
    one engine build: a capture by another build counts only when the user says so. A cell that
    failed is tried again (its complete shards kept), unless skip_failed."""
    spec = plan.spec
    todo, complete, reused, cells = {}, [], {}, list(plan.cells)
    left_out, refs = dict(plan.left_out), dict(plan.reference_cells)
    exists = wh.check()
    if cell_rows is None:
        cell_rows = wh.read_all("cells") if exists else []
    rows = {r["cell_id"]: r for r in cell_rows}
    reuse_other_builds, skip_failed = resume.reuse_other_builds, resume.skip_failed
    for i, cell in enumerate(plan.cells):
        done = complete_shards(plan, wh, cell, resume, log) if exists else set()
        missing = [r for r in range(spec.repeats) if r not in done]
        row = rows.get(cell.cell_id)
        if row and row["status"] == "skipped":
            complete.append(cell.cell_id)  # deterministic: building it again fails the same way
        elif row and row["status"] == "failed" and skip_failed:
            left_out[cell.stack_id] = (
                f"failed in run {row['run_id']} ({row['error_class']}: {row['error']}); --skip-failed"
            )
        elif not missing and row and row["status"] == "done" and row["repeats"] >= spec.repeats:
            complete.append(cell.cell_id)
        elif (
            reuse_other_builds
            and (other := _other_build(cell, rows, spec.repeats))
            and (
                spec.keep_rows != "all"
                or all(wh.shard_keeps_values(other["cell_id"], r) for r in wh.completed_repeats(other["cell_id"]))
            )
        ):
            cells[i] = cell.bound(other.get("build"))
            complete.append(other["cell_id"])
            reused[cell.stack_id] = other["cell_id"]
            if refs.get(cell.model) == cell.cell_id:
                refs[cell.model] = other["cell_id"]
            log(
                f"{cell.stack_id}: reusing {other['cell_id']}, captured by build {other.get('build') or 'unrecorded'} "
                f"on {other['host']}, instead of capturing build {cell.build}"
            )
        else:
            todo[cell.cell_id] = tuple(missing)
    return dataclasses.replace(
        plan,
        cells=tuple(cells),
        todo=todo,
        complete=tuple(complete),
        reused=reused,
        left_out=left_out,
        reference_cells=refs,
    )


def regroup_complete_cells(plan: Plan, wh: Warehouse, log: Callable[[str], None]) -> None:
    """Centroid grouping and calibration notes describe a cell without changing its arithmetic
    (they are not in the cell id): a spec that changes them re-labels captured cells instead
    of capturing them again."""
    cells = {c.cell_id: c for c in plan.cells}
    changed = 0
    for cid in plan.complete:
        rows = wh.read_rows("cells", cid)
        want = {
            "centroid_group": cells[cid].centroid_group,
            "centroid": plan.spec.centroid,
            "calibration": cells[cid].calibration,
        }
        if rows and any(rows[0].get(k) != v for k, v in want.items()):
            wh.write_rows("cells", cid, [{**rows[0], **want}])
            changed += 1
    if changed:
        log(
            f"centroid grouping / calibration changed: relabelled {changed} captured cell(s); "
            "run `matrix analyze` again"
        )


def mark_interrupted_runs(wh: Warehouse, log: Callable[[str], None]) -> None:
    """Runs still 'running' while we hold the writer lock were killed, or could not record their
    end (a marker on this machine says how they ended): say so."""
    markers = failures.read_markers(wh.where)
    for run in wh.read_all("runs"):
        if run["status"] == "running":
            m = markers.get(run["run_id"]) or {
                "status": "interrupted",
                "error": "the process ended before the run finished",
            }
            wh.write_rows(
                "runs",
                run["run_id"],
                [R.run_finished(run, m["status"], finished_at=run["finished_at"], error=m["error"])],
            )
            failures.drop_marker(wh.where, run["run_id"])
            log(
                f"run {run['run_id']} ended {m['status']}"
                + (f" ({m['error']})" if m["error"] else "")
                + "; resuming its work"
            )


def _record_end(wh: Warehouse, row: dict, log: Callable[[str], None]) -> OSError | None:
    """The run's last row; when the warehouse cannot take it (its disk is full), the outcome goes
    to a marker in this machine's cache for the next run to record. Returns that write's error."""
    try:
        wh.write_rows("runs", row["run_id"], [row])
        return None
    except OSError as e:
        path = failures.leave_marker(wh.where, row["run_id"], row["status"], row["error"])
        log(
            f"could not record the end of run {row['run_id']} in the warehouse "
            f"({failures.storage_line(e, wh.where) if failures.storage_error(e) else e}); kept in {path}, "
            "for the next run to record"
        )
        return e


def _begin(
    plan: Plan,
    wh: Warehouse,
    argv: list[str],
    address: str | None,
    executor: str,
    log: Callable[[str], None],
    nonce: str,
) -> dict:
    """Under the writer lock, before any cell starts: tidy what a killed run left, write the
    prompts, and the run's own row (status running)."""
    spec = plan.spec
    wh.create()
    wh.write_probe(nonce)
    mark_interrupted_runs(wh, log)  # also done by the CLI before planning; here for direct callers
    for p in wh.sweep_tmp():
        log(f"removed a partial file left by an interrupted run: {p}")
    for m in plan.models.values():
        for p in m.prompts:
            if not wh.has_rows("prompts", p.prompt_id):
                wh.write_rows("prompts", p.prompt_id, [R.prompt_row(**p.to_row(), n_tokens=len(p.token_ids))])
    run_id = ids.run_id()
    run = R.run_row(
        run_id,
        "running",
        started_at=R.now(),
        finished_at=None,
        spec_name=spec.name,
        spec_path=str(spec.path),
        spec_sha256=spec.sha256,
        spec_yaml=spec.raw_text,
        argv=json.dumps(argv),
        pid=os.getpid(),
        ray_address=(address or "local") if executor == "ray" else None,
        executor=executor,
        logit_matrix_version=__version__,
        schema_version=SCHEMA_VERSION,
        versions=json.dumps(library_versions(), sort_keys=True),
        cells_total=len(plan.cells),
        cells_done=len(plan.complete),
        rows_written=0,
        error=None,
    )
    wh.write_rows("runs", run_id, [run])
    return run


def wait_exited(pids: list[int], timeout_s: float = 15.0) -> None:
    """Until these processes of this machine have exited. A killed Ray actor is reported dead
    before its process is gone, and until then a file it holds open (a partial shard it was
    writing, already unlinked) keeps its space: on a full disk the run's end could not be written."""
    end = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < end and _running(pid):
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no files; its parent reaps it when it will)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the pid still exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def execute(
    plan: Plan,
    wh: Warehouse,
    argv: list[str],
    address: str | None,
    log: Callable[[str], None],
    ex,
    nonce: str | None = None,
) -> dict:
    """Run every unfinished cell of a bound plan (bind()) on the executor ex (launch.Executor);
    returns a summary. nonce: this run's, when a host was started with it ahead of the run."""
    cells = {c.cell_id: c for c in plan.cells}
    todo = [cells[cid] for cid in plan.todo]
    todo.sort(key=lambda c: c.cell_id not in plan.reference_cells.values())  # the reference first
    nonce = nonce or ids.probe_nonce()
    run = _begin(plan, wh, argv, address, ex.name, log, nonce)
    sweep, status = Sweep(plan, wh, run, ex, log, ex.open(wh.where, nonce)), "failed"
    try:
        for cell in todo:
            sweep.start(cell)
        waiting = sum(len(v) for v in sweep.waiting.values())
        log(
            f"{len(todo)} cell(s) to run, {sweep.out.units_total} capture(s); {len(plan.complete)} already complete"
            + (f"; {waiting} start once their reference is done (reference_metrics: in_actor)" if waiting else "")
        )
        sweep.loop()
        status = "done"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        full = failures.storage_error(e)
        if full is not None:  # a driver-side write: the same one line as an actor's
            e = failures.StorageError(failures.storage_line(full, wh.where))
        err = getattr(e, "cause", None) or e  # the actor's own exception, not Ray's wrapper
        run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
        if full is not None:
            raise e from None
        raise
    finally:
        stopped = [a for lv in sweep.live.values() for a in lv.started.actors]
        here = [
            lv.loaded["pid"] for lv in sweep.live.values() if lv.loaded and lv.loaded.get("host") == platform.node()
        ]
        ex.shutdown()  # first: no host still waiting for its turn starts while the others stop
        for cid in list(sweep.live):
            sweep.drop(cid)
        if stopped:  # a stopped run leaves no temp file: its killed actors' partial shards go too
            ex.wait_gone(stopped)
            wait_exited(here)
            for p in wh.sweep_tmp():
                log(f"removed the partial file of a stopped capture: {p}")
        unrecorded = _record_end(
            wh,
            R.run_finished(
                run,
                status,
                cells_done=sweep.out.cells_done,
                rows_written=sweep.out.rows,
                rows_delivery=json.dumps(sweep.out.via),
                cells_failed=len(sweep.out.failed),
            ),
            log,
        )
    if unrecorded is not None:
        raise unrecorded
    elapsed = time.perf_counter() - sweep.out.t0
    return {
        "run_id": run["run_id"],
        "cells_total": len(plan.cells),
        "cells_done": sweep.out.cells_done,
        "cells_run": len(todo),
        "rows_written": sweep.out.rows,
        "seconds": round(elapsed, 2),
        "rows_per_second": round(sweep.out.rows / max(elapsed, 1e-9), 2),
        "rows_delivery": sweep.out.via,
        "metrics_in_actor": sweep.out.inline_written,
        "skipped": plan.matrix.skipped,
        "left_out": plan.left_out,
        "reused": plan.reused,
        "failed": {cid: f.line() for cid, f in sweep.out.failed.items()},
        "bad_input": next((f.message for f in sweep.out.failed.values() if f.bad_input), None),
    }
