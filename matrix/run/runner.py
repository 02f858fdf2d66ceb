"""A run's plan, stage by stage: prepare (models resolved, prompts tokenised once, extras resolved),
bind (each cell to the engine build of the nodes it will run on) and find what is left to capture.
matrix/run/execute.py then runs it."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable, Collection

import extras
from common.errors import UserError, first_line
from common.files import sha256_file
from common.stack import Cell
from matrix.run.plan import ModelPlan, Plan
from matrix.spec import calibration, candidate_check, candidates
from matrix.spec.cells import Matrix
from matrix.spec.corpus import tokenize
from matrix.spec.models import fetch
from matrix.spec.parse import Spec
from store import Warehouse


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(hf_dir: str, stamp: tuple):
    """(tokenizer, config) of a checkpoint, read once per process while its files are unchanged
    (stamp): parsing a large tokenizer.json costs seconds, and the API runs many sweeps in one
    process. Both are only read from here on."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(hf_dir), transformers.AutoConfig.from_pretrained(hf_dir)


def _stamp(hf_dir: str) -> tuple:
    """What identifies a checkpoint directory's files as they are now: name, size, mtime, ctime
    (empty for what is not a local directory, which is then read afresh)."""
    if not os.path.isdir(hf_dir):
        return ()
    out = []
    for e in sorted(os.scandir(hf_dir), key=lambda e: e.name):
        if e.is_file():
            st = e.stat()
            out.append((e.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


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
            stamp = _stamp(m.hf_dir)
            tok, config = _hf_tokenizer(m.hf_dir, stamp) if stamp else _hf_tokenizer.__wrapped__(m.hf_dir, ())
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
                candidate_check.check(candidates.resolve(cell, m), config, tok, vocab)
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
        done = tuple((x.key, x.resolve(v, c, facts, prompts, fail)) for x, v in extras.of(c) if not x.option)
        return c.with_stack(extras=tuple(sorted(done)))

    return tuple(resolved(c) for c in cells)


def side_rows(plan: Plan, cell: Cell, without: Collection[str] = ()) -> dict[str, tuple[int, bool]]:
    """{table: (rows one repeat adds to it, whether that count is exact)} for the cell's extras.
    without: prompts whose rows the engine refused (Warehouse.shard_tally), in no table."""
    prompts = [p for p in plan.models[cell.model].prompts if p.prompt_id not in without]
    fed = [plan.spec.positions.fed(p.token_ids, cell.max_tokens)[1] for p in prompts]
    lengths = [len(p.token_ids) for p in prompts]
    out: dict[str, tuple[int, bool]] = {}
    for x, v in ((x, v) for x, v in extras.of(cell) if x.table):  # one without a table writes the cell's rows
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


def expected_rows(plan: Plan, cell: Cell, without: Collection[str] = ()) -> int:
    """Rows one repeat of this cell holds: its sampled positions over every prompt (but those of
    `without`, whose rows the engine refused: Warehouse.shard_tally)."""
    return sum(
        len(plan.spec.positions.fed(p.token_ids, cell.max_tokens)[1])
        for p in plan.models[cell.model].prompts
        if p.prompt_id not in without
    )


def complete_shards(plan: Plan, wh: Warehouse, cell: Cell, resume: Resume, log: Callable[[str], None]) -> set[int]:
    """The repeats whose shard is complete: it parses, with the cell's row count (a file that only
    exists is not done). With recapture_damaged every row is checked against its hash too, and a
    damaged shard is moved aside (never deleted) to be captured again; without, it is refused."""
    done = set()
    for r in sorted(wh.completed_repeats(cell.cell_id)):
        why = _shard_problem(plan, wh, cell, r, resume.recapture_damaged)
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


def _shard_problem(plan: Plan, wh: Warehouse, cell: Cell, repeat: int, check_rows: bool) -> str | None:
    """Why a repeat's shards are not a complete capture of the cell, or None. The rows of the
    prompts the engine refused (its logits shard's footer names them) are in none of them.
    check_rows: every row checked against its hash too (store/verify.py)."""
    from store.verify import verify_shard

    try:
        n, refused = wh.shard_tally(cell.cell_id, repeat)
    except Exception as e:  # a truncated or overwritten file: Parquet says why
        return "unreadable: " + first_line(str(e), type(e).__name__)
    want = expected_rows(plan, cell, refused)
    if check_rows:
        damage, _, _ = verify_shard(wh, cell.cell_id, repeat, want)
        why = damage[0].detail() if damage else None
    else:
        why = None if n == want else f"{n} rows, the cell has {want} per repeat"
    for table, (rows, exact) in side_rows(plan, cell, refused).items():  # the extras' shards, complete too
        why = why or _side_shard_problem(wh, cell, repeat, table, rows, exact)
    return why


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


def _reusable_build(cell, rows: dict[str, dict], spec, wh: Warehouse) -> dict | None:
    """The cells row of another build's complete capture of this cell's stack that the run may
    take instead of capturing it (--reuse-other-builds); under keep_rows: all, only one whose
    every shard kept its values."""
    other = _other_build(cell, rows, spec.repeats)
    if other and (
        spec.keep_rows != "all"
        or all(wh.shard_keeps_values(other["cell_id"], r) for r in wh.completed_repeats(other["cell_id"]))
    ):
        return other
    return None


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
    for i, cell in enumerate(plan.cells):
        done = complete_shards(plan, wh, cell, resume, log) if exists else set()
        missing = [r for r in range(spec.repeats) if r not in done]
        row = rows.get(cell.cell_id)
        if row and row["status"] == "skipped":
            complete.append(cell.cell_id)  # deterministic: building it again fails the same way
        elif row and row["status"] == "failed" and resume.skip_failed:
            left_out[cell.stack_id] = (
                f"failed in run {row['run_id']} ({row['error_class']}: {row['error']}); --skip-failed"
            )
        elif not missing and row and row["status"] == "done" and row["repeats"] >= spec.repeats:
            complete.append(cell.cell_id)
        elif resume.reuse_other_builds and (other := _reusable_build(cell, rows, spec, wh)):
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
    """Centroid grouping, calibration notes and the partners the plug-ins grade a cell against
    describe a cell without changing its arithmetic (they are not in the cell id): a spec that
    changes them re-labels captured cells instead of capturing them again."""
    cells = {c.cell_id: c for c in plan.cells}
    changed = 0
    for cid in plan.complete:
        rows = wh.read_rows("cells", cid)
        want = {
            "centroid_group": cells[cid].centroid_group,
            "centroid": plan.spec.centroid,
            "calibration": cells[cid].calibration,
            **extras.cell_records(cells[cid]),
        }
        if rows and any(rows[0].get(k) != v for k, v in want.items()):
            wh.write_rows("cells", cid, [{**rows[0], **want}])
            changed += 1
    if changed:
        log(
            f"centroid grouping / calibration / partners changed: relabelled {changed} captured cell(s); "
            "run `matrix analyze` again"
        )
