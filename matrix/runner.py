"""`matrix run`: work out what is missing, start every unfinished cell, and record what comes back.

The caller (the CLI) owns the Ray connection: this module expects `ray` to be initialised and
never shuts it down. Starting a cell's actors is matrix/launch.py; the rows of the small tables
are built by store/rows.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from backends.base import SkipCell
from common import ids
from common.errors import UserError
from common.files import sha256_file
from common.stack import Cell
from matrix import __version__, launch, placement
from matrix.cells import model_copy, stack_desc
from matrix.corpus import Prompt, tokenize
from matrix.launch import Call, Kind
from matrix.models import ResolvedModel, fetch
from matrix.spec import Spec
from store import SCHEMA_VERSION, Warehouse
from store import rows as R
from store.warehouse import row_hashes

HEARTBEAT_S = float(os.environ.get("LOGIT_MATRIX_HEARTBEAT_S", "60"))


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "logit-matrix": __version__}
    for dist in ("numpy", "pyarrow", "duckdb", "ray", "pyyaml", "torch", "transformers",
                 "accelerate", "safetensors", "gguf", "tokenizers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


@dataclass
class Plan:
    spec: Spec
    models: dict[str, ResolvedModel]
    prompts: dict[str, list[Prompt]]  # model -> prompts
    todo: dict[str, list[int]] = field(default_factory=dict)  # cell_id -> repeats to capture
    complete: list[str] = field(default_factory=list)
    special: dict[str, dict] = field(default_factory=dict)  # model -> reference bos/eos ids
    vocab: dict[str, int] = field(default_factory=dict)  # model -> reference vocab size (logits per row)
    # Set by bind(): the spec's cells bound to an engine build (cell_id = stack@build)
    cells: list[Cell] = field(default_factory=list)
    reference_cells: dict[str, str] = field(default_factory=dict)  # model -> bound cell id
    builds: dict[str, dict] = field(default_factory=dict)  # cell id -> its build's libraries
    left_out: dict[str, str] = field(default_factory=dict)  # stack id -> why it does not run this time
    reused: dict[str, str] = field(default_factory=dict)  # stack id -> the other build's cell it reuses


def prepare(spec: Spec, wh: Warehouse, log: Callable[[str], None]) -> Plan:
    """Resolve models, tokenise once per model, and work out what is left to do."""
    import transformers

    models, prompts, special, vocab = {}, {}, {}, {}
    for name, ref in spec.models.items():
        models[name] = m = fetch(ref, log=log)
        tok = transformers.AutoTokenizer.from_pretrained(m.hf_dir)
        config = transformers.AutoConfig.from_pretrained(m.hf_dir)
        vocab[name] = int(getattr(config, "vocab_size", 0) or 0) or len(tok)
        if len(tok) > vocab[name]:
            raise UserError(f"{m.hf_dir}: the tokenizer has {len(tok)} tokens but the model has "
                            f"vocab_size {vocab[name]}: tokenizer and model do not match")
        special[name] = {"bos": tok.bos_token_id, "eos": tok.eos_token_id}
        tok_file = os.path.join(m.hf_dir, "tokenizer.json")
        tok_sha = sha256_file(tok_file) if os.path.isfile(tok_file) else None
        prompts[name] = tokenize(spec.corpus, name, tok, spec.bos, tok_sha)
    return Plan(spec, models, prompts, special=special, vocab=vocab)


def bind(plan: Plan, wh: Warehouse, nodes: list, log: Callable[[str], None], reuse_other_builds: bool = False) -> None:
    """Bind every cell to the engine build of the node(s) it will run on (matrix/builds.py), then
    work out what is left to do. Run under the writer lock, with Ray initialised."""
    from matrix import builds

    captured: dict[str, set[str]] = {}
    for r in (wh.read_all("cells") if wh.check() else []):
        if r["status"] == "done" and r.get("build"):
            captured.setdefault(r["cell_id"].partition("@")[0], set()).add(r["build"])
    answers = builds.probe(plan.spec.cells, plan.models, nodes, log)
    plan.cells, plan.builds, plan.left_out = builds.bind(plan.spec.cells, answers, captured, log)
    for sid, why in plan.left_out.items():
        log(f"not run this time: {sid}: {why}")
    bound = {c.stack_id: c.cell_id for c in plan.cells}
    plan.reference_cells = {m: bound[s] for m, s in plan.spec.reference_cells.items() if s in bound}
    find_todo(plan, wh, reuse_other_builds, log)


def _other_build(cell: Cell, rows: dict[str, dict], repeats: int) -> dict | None:
    """The newest complete capture of this stack (and replica) by another engine build."""
    same = [r for cid, r in rows.items() if cid.partition("@")[0] == cell.stack_id and cid != cell.cell_id
            and r["status"] == "done" and (r["repeats"] or 0) >= repeats]
    return max(same, key=lambda r: r["finished_at"]) if same else None


def find_todo(plan: Plan, wh: Warehouse, reuse_other_builds: bool = False,
              log: Callable[[str], None] = lambda m: None) -> None:
    """Which (cell, repeat) captures are missing for the bound cells. A cell is its stack run by
    one engine build: a capture by another build counts only when the user says so."""
    spec = plan.spec
    plan.todo, plan.complete, plan.reused = {}, [], {}
    exists = wh.check()
    rows = {r["cell_id"]: r for r in wh.read_all("cells")} if exists else {}
    for i, cell in enumerate(plan.cells):
        done = wh.completed_repeats(cell.cell_id) if exists else set()
        missing = [r for r in range(spec.repeats) if r not in done]
        row = rows.get(cell.cell_id)
        if row and row["status"] == "skipped":
            plan.complete.append(cell.cell_id)  # deterministic: building it again fails the same way
        elif not missing and row and row["status"] == "done" and row["repeats"] >= spec.repeats:
            plan.complete.append(cell.cell_id)
        elif reuse_other_builds and (other := _other_build(cell, rows, spec.repeats)):
            plan.cells[i] = dataclasses.replace(cell, cell_id=other["cell_id"], build=other.get("build"))
            plan.complete.append(other["cell_id"])
            plan.reused[cell.stack_id] = other["cell_id"]
            if plan.reference_cells.get(cell.model) == cell.cell_id:
                plan.reference_cells[cell.model] = other["cell_id"]
            log(f"{cell.stack_id}: reusing {other['cell_id']}, captured by build {other.get('build') or 'unrecorded'} "
                f"on {other['host']}, instead of capturing build {cell.build}")
        else:
            plan.todo[cell.cell_id] = missing


def regroup_complete_cells(plan: Plan, wh: Warehouse, log: Callable[[str], None]) -> None:
    """Centroid grouping and calibration notes describe a cell without changing its arithmetic
    (they are not in the cell id): a spec that changes them re-labels captured cells instead
    of capturing them again."""
    cells = {c.cell_id: c for c in plan.cells}
    changed = 0
    for cid in plan.complete:
        rows = wh.read_rows("cells", cid)
        want = {"centroid_group": cells[cid].centroid_group, "centroid": plan.spec.centroid,
                "calibration": cells[cid].calibration}
        if rows and any(rows[0].get(k) != v for k, v in want.items()):
            wh.write_rows("cells", cid, [{**rows[0], **want}])
            changed += 1
    if changed:
        log(f"centroid grouping / calibration changed: relabelled {changed} captured cell(s); "
            "run `matrix analyze` again")


def mark_interrupted_runs(wh: Warehouse, log: Callable[[str], None]) -> None:
    """Runs still 'running' while we hold the writer lock were killed: say so."""
    for run in wh.read_all("runs"):
        if run["status"] == "running":
            wh.write_rows("runs", run["run_id"], [R.run_finished(
                run, "interrupted", finished_at=run["finished_at"],
                error="the process ended before the run finished")])
            log(f"run {run['run_id']} was interrupted; resuming its work")


def _cell_fields(plan: Plan, cell: Cell) -> dict:
    """The columns every cells row of this cell has, captured or skipped."""
    return {**cell.axes(), **R.model_fields(plan.models[cell.model]), "stride": plan.spec.stride,
            "corpus": plan.spec.corpus, "options": json.dumps(cell.opts, sort_keys=True),
            "centroid_group": cell.centroid_group, "centroid": plan.spec.centroid, "calibration": cell.calibration,
            "stack_id": ids.split_cell_id(cell.stack_id)[0], "replica": cell.replica, "build": cell.build}


def skipped_row(plan: Plan, cell: Cell, run_id: str, reason: str) -> dict:
    return R.cell_row(cell.cell_id, run_id, "skipped", **_cell_fields(plan, cell), skip_reason=reason, repeats=0,
                      host=None, build_libraries=json.dumps(plan.builds.get(cell.cell_id), sort_keys=True))


@dataclass
class Live:
    """One cell in flight: its actors, what has come back, and how many captures are still out."""

    cell: Cell
    started: launch.Started
    threads: int
    left: int
    loaded: dict | None = None
    parity: dict | None = None
    capture_s: float = 0.0


def done_row(plan: Plan, live: Live, run_id: str, wh: Warehouse) -> dict:
    spec, cell, loaded = plan.spec, live.cell, live.loaded
    art = loaded.get("artifact") or {}
    # shard 0 read once (on object storage each read is a request): its hashes, rows and dtype
    first = wh.read_shard(cell.cell_id, 0, ["prompt_id", "position", "row_hash", "logits_dtype"])
    hashes = [row_hashes(first)]
    hashes += [wh.shard_hashes(cell.cell_id, r) for r in range(1, spec.repeats)]
    ref = plan.reference_cells.get(cell.model)
    return R.cell_row(
        cell.cell_id, run_id, "done", **_cell_fields(plan, cell),
        bit_reproducible=all(h == hashes[0] for h in hashes[1:]),
        repeats=spec.repeats, rows_per_repeat=first.num_rows, n_prompts=len(plan.prompts[cell.model]),
        threads=loaded["settings"].get("threads"), bos_policy=spec.bos, is_reference=ref == cell.cell_id,
        reference_cell_id=ref, vocab_size=plan.vocab[cell.model], engine_vocab_size=loaded["vocab_size"],
        logits_dtype=first.column("logits_dtype")[0].as_py(),
        artifact=art.get("path"), artifact_sha256=art.get("sha256"),
        artifact_recipe=json.dumps(art.get("recipe"), sort_keys=True) if art else None,
        tokenizer_parity=live.parity["status"] if live.parity else "not_checked", max_tokens=cell.max_tokens,
        settings=json.dumps(loaded["settings"], sort_keys=True),
        fingerprint=json.dumps(loaded.get("fingerprint"), sort_keys=True, default=str),
        versions=json.dumps(loaded["versions"], sort_keys=True), host=loaded["host"], node_id=loaded["node_id"],
        rows_via=loaded["rows_via"], model_via=loaded["model_via"], load_seconds=loaded["load_seconds"],
        capture_seconds=live.capture_s, build_libraries=json.dumps(loaded["build_libraries"], sort_keys=True))


class Sweep:
    """The run loop's state: the cells in flight, the calls queued on their actors, the counts."""

    def __init__(self, plan: Plan, wh: Warehouse, run_id: str, nodes: list, log: Callable[[str], None], delivery):
        self.plan, self.wh, self.run_id, self.nodes, self.log = plan, wh, run_id, nodes, log
        self.delivery = delivery  # actors.stack_actor.Delivery
        self.via = {"node": 0, "driver": 0, "bytes_to_driver": 0}  # runs.rows_delivery
        self.live: dict[str, Live] = {}
        self.pending: dict = {}  # object ref -> launch.Call
        self.cells_total, self.cells_done = len(plan.cells), len(plan.complete)
        self.units_total = self.units_done = self.rows = 0
        self.t0 = time.perf_counter()

    def start(self, cell: Cell) -> None:
        plan = self.plan
        model, threads, repeats = plan.models[cell.model], placement.cell_threads(cell, self.nodes), plan.todo[cell.cell_id]
        work = launch.Work(self.run_id, self.delivery, plan.spec.stride, repeats,
                           [(p.prompt_id, p.text, p.token_ids) for p in plan.prompts[cell.model]],
                           plan.special[cell.model], plan.vocab[cell.model])
        started = launch.start(cell, stack_desc(cell, model), model_copy(model), threads, self.nodes, work)
        self.live[cell.cell_id] = Live(cell, started, threads, len(repeats))
        self.pending.update(started.calls)
        self.units_total += len(repeats)

    def drop(self, cid: str) -> None:
        for fut in [f for f, call in self.pending.items() if call.cell_id == cid]:
            del self.pending[fut]
        launch.stop(self.live.pop(cid).started)

    def skip(self, cid: str, reason: str) -> None:
        self.log(f"[cells {self.cells_done + 1}/{self.cells_total}] {cid} skipped: {reason}")
        live = self.live[cid]
        self.units_total -= live.left
        self.drop(cid)
        self.wh.write_rows("cells", cid, [skipped_row(self.plan, live.cell, self.run_id, reason)])
        self.cells_done += 1

    def record(self, call: Call, result: dict) -> None:
        live = self.live[call.cell_id]
        if call.kind is Kind.LOAD:
            live.loaded = result
            away = f"; weights {result['model_via']}, rows via the {result['rows_via']}" \
                if (result["model_via"], result["rows_via"]) != ("local", "node") else ""
            self.log(f"loaded {call.cell_id} on {result['host']} in {result['load_seconds']:.1f}s{away}")
        elif call.kind is Kind.PARITY:
            live.parity = result
            self._record_parity(call.cell_id, result)
        elif call.kind is Kind.CAPTURE:
            self.units_done += 1
            self.rows += result["rows"]
            live.capture_s += result["seconds"]
            live.left -= 1
            self.via[result["rows_via"]] += 1
            self.via["bytes_to_driver"] += result["bytes_sent"]
            rate = self.rows / max(time.perf_counter() - self.t0, 1e-9)
            self.log(f"[cells {self.cells_done}/{self.cells_total} | captures {self.units_done}/{self.units_total}] "
                     f"{call.cell_id} r{call.repeat}: {result['rows']} rows in {result['seconds']:.1f}s "
                     f"| rows {self.rows} | {rate:.1f} rows/s")
        if live.left == 0 and live.loaded is not None and live.parity is not None:
            self._finish(call.cell_id)

    def _record_parity(self, cid: str, result: dict) -> None:
        self.wh.write_rows("tokenizer_parity", cid, R.parity_rows(cid, self.run_id, self.live[cid].cell.engine,
                                                                  result["rows"]))
        if result["status"] == "mismatch":
            bad = [r for r in result["rows"] if not r["match"]]
            what = "; ".join(f"{r['prompt_id']}: {r['diagnosis']} at position {r['first_diff']}"
                             for r in bad[:3]) + "".join(f"; {p}" for p in result["problems"])
            self.log(f"tokenizer parity MISMATCH for {cid} ({len(bad)}/{len(result['rows'])} prompts): {what}"
                     " -- capture still uses the canonical ids")

    def _finish(self, cid: str) -> None:
        import ray

        live = self.live[cid]
        self.wh.write_rows("cells", cid, [done_row(self.plan, live, self.run_id, self.wh)])
        ray.get([a.close.remote() for a in live.started.actors])
        self.drop(cid)
        self.cells_done += 1
        self.log(f"[cells {self.cells_done}/{self.cells_total}] {cid} done")

    def loop(self, cluster_config: str | Path | None) -> None:
        import ray

        while self.pending:
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=HEARTBEAT_S)
            if not ready:  # nothing finished for a while: say what is still waiting, and on what
                self.log(self.heartbeat(placement.known_nodes(placement.cluster_nodes(), cluster_config)))
                continue
            call = self.pending.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except Exception as e:
                # After a failed load every later call of the cell raises the load's own exception
                # (StackActor._loaded), so a SkipCell from any of them is the load's outcome.
                cause = getattr(e, "cause", None)
                if not isinstance(cause, SkipCell):
                    raise
                self.skip(call.cell_id, str(cause).splitlines()[0])
                continue
            if call.kind is not Kind.RANK:  # another rank's load or forwards: rank 0 reports the cell
                self.record(call, result)

    def heartbeat(self, nodes: list) -> str:
        """One line while nothing finishes: which cells are not loaded yet, and where they can go now."""
        waiting = sorted(cid for cid, lv in self.live.items() if lv.loaded is None)
        where = [f"{cid} ({placement.where(self.live[cid].cell.device, self.live[cid].cell.tp, self.live[cid].threads, nodes)})"
                 for cid in waiting[:3]]
        more = f" and {len(waiting) - 3} more" if len(waiting) > 3 else ""
        state = (f"; {len(waiting)} cell(s) not loaded yet: " + ", ".join(where) + more) if waiting else ""
        # an actor runs its calls in order: a loaded cell's first pending capture is the one running
        busy = {}
        for call in self.pending.values():
            if call.kind is Kind.CAPTURE and self.live[call.cell_id].loaded is not None:
                busy[call.cell_id] = min(busy.get(call.cell_id, call.repeat), call.repeat)
        if busy:
            state += "; capturing: " + ", ".join(f"{cid} r{r}" for cid, r in sorted(busy.items())[:3]) \
                + (f" and {len(busy) - 3} more" if len(busy) > 3 else "")
        return (f"waiting {time.perf_counter() - self.t0:.0f}s in: captures {self.units_done}/{self.units_total}, "
                f"rows {self.rows}{state}")


def _begin(plan: Plan, wh: Warehouse, argv: list[str], address: str | None, log: Callable[[str], None],
           nonce: str) -> dict:
    """Under the writer lock, before any cell starts: tidy what a killed run left, write the
    prompts, and the run's own row (status running)."""
    spec = plan.spec
    wh.create()
    wh.write_probe(nonce)
    mark_interrupted_runs(wh, log)
    for p in wh.sweep_tmp():
        log(f"removed a partial file left by an interrupted run: {p}")
    for plist in plan.prompts.values():
        for p in plist:
            if not wh.has_rows("prompts", p.prompt_id):
                wh.write_rows("prompts", p.prompt_id, [R.prompt_row(**p.to_row(), n_tokens=len(p.token_ids))])
    run_id = ids.run_id()
    run = R.run_row(run_id, "running", started_at=R.now(), finished_at=None, spec_name=spec.name,
                    spec_path=str(spec.path), spec_sha256=spec.sha256, spec_yaml=spec.raw_text, argv=json.dumps(argv),
                    pid=os.getpid(), ray_address=address or "local", logit_matrix_version=__version__,
                    schema_version=SCHEMA_VERSION, versions=json.dumps(library_versions(), sort_keys=True),
                    cells_total=len(plan.cells), cells_done=len(plan.complete), rows_written=0, error=None)
    wh.write_rows("runs", run_id, [run])
    return run


def execute(plan: Plan, wh: Warehouse, argv: list[str], address: str | None,
            log: Callable[[str], None], cluster_config: str | Path | None = None) -> dict:
    """Run every unfinished cell of a bound plan (bind()); returns a summary. Requires ray to be initialised."""
    spec = plan.spec
    cells = {c.cell_id: c for c in plan.cells}
    todo = [cells[cid] for cid in plan.todo]
    todo.sort(key=lambda c: c.cell_id not in plan.reference_cells.values())  # the reference first
    nodes = placement.known_nodes(placement.cluster_nodes(), cluster_config)
    import ray

    from actors.depot import DriverDepot, depot_options
    from actors.stack_actor import Delivery

    nonce = ids.probe_nonce()
    run = _begin(plan, wh, argv, address, log, nonce)
    depot = DriverDepot.options(**depot_options(ray.get_runtime_context().get_node_id())).remote(wh.where)
    sweep, status = Sweep(plan, wh, run["run_id"], nodes, log, Delivery(wh.where, nonce, depot)), "failed"
    try:
        for cell in todo:
            sweep.start(cell)
        log(f"{len(todo)} cell(s) to run, {sweep.units_total} capture(s); {len(plan.complete)} already complete")
        sweep.loop(cluster_config)
        status = "done"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        err = getattr(e, "cause", None) or e  # the actor's own exception, not Ray's wrapper
        run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
        raise
    finally:
        for cid in list(sweep.live):
            sweep.drop(cid)
        ray.kill(depot)
        wh.write_rows("runs", run["run_id"], [R.run_finished(run, status, cells_done=sweep.cells_done,
                                                              rows_written=sweep.rows,
                                                              rows_delivery=json.dumps(sweep.via))])
    elapsed = time.perf_counter() - sweep.t0
    return {"run_id": run["run_id"], "cells_total": len(plan.cells), "cells_done": sweep.cells_done,
            "cells_run": len(todo), "rows_written": sweep.rows, "seconds": round(elapsed, 2),
            "rows_per_second": round(sweep.rows / max(elapsed, 1e-9), 2), "rows_delivery": sweep.via,
            "skipped": spec.skipped, "left_out": plan.left_out, "reused": plan.reused}
