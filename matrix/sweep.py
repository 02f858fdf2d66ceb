"""The run loop: the cells in flight, what comes back from their actors, and the rows it records.

matrix/runner.py plans a run and calls Sweep.loop; a cell's outcome (done, skipped, failed,
retried) is decided here, one cell at a time, so one cell's failure never ends the others.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from backends.base import SkipCell
from common import ids
from common.stack import Cell
from actors.capture import storage_summary
from matrix import launch, placement
from matrix.cells import model_copy, stack_desc
from matrix.failures import Failure, StorageError, classify, storage_error, storage_line
from matrix.launch import Call, Kind
from matrix.plan import Plan
from store import Warehouse
from store import rows as R
from store.warehouse import row_hashes

HEARTBEAT_S = float(os.environ.get("LOGIT_MATRIX_HEARTBEAT_S", "60"))


def _cell_fields(plan: Plan, cell: Cell) -> dict:
    """The columns every cells row of this cell has, captured or skipped."""
    return {**cell.axes(), **R.model_fields(plan.models[cell.model]), "stride": plan.spec.stride,
            "positions": plan.spec.positions.to_json(),
            "corpus": plan.spec.corpus, "options": json.dumps(cell.opts, sort_keys=True),
            "centroid_group": cell.centroid_group, "centroid": plan.spec.centroid, "calibration": cell.calibration,
            "stack_id": ids.split_cell_id(cell.stack_id)[0], "replica": cell.replica, "build": cell.build}


def skipped_row(plan: Plan, cell: Cell, run_id: str, reason: str) -> dict:
    return R.cell_row(cell.cell_id, run_id, "skipped", **_cell_fields(plan, cell), skip_reason=reason, repeats=0,
                      host=None, build_libraries=json.dumps(plan.builds.get(cell.cell_id), sort_keys=True))


def failed_row(plan: Plan, live: "Live", run_id: str, failure: Failure, attempts: int) -> dict:
    """A cell that raised, or whose actor died more often than the spec's retries allow. Its
    complete shards stay (the next run captures only the missing repeats)."""
    loaded = live.loaded or {}
    return R.cell_row(live.cell.cell_id, run_id, "failed", **_cell_fields(plan, live.cell), repeats=0,
                      error_class=failure.error_class, error=failure.message, attempts=attempts,
                      host=loaded.get("host"), node_id=loaded.get("node_id"),
                      build_libraries=json.dumps(plan.builds.get(live.cell.cell_id), sort_keys=True))


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
    storage: list = field(default_factory=list)  # each capture's storage summary (actors/capture.py)
    # What rank 0's actor is doing now (its calls run in order) and since when; "placing" has no
    # time limit (it waits for a node), the others have the spec's.
    phase: str = "placing"
    since: float = field(default_factory=time.perf_counter)
    repeats: list[int] = field(default_factory=list)  # captures not back yet, in queue order
    capture_limit_s: float = 0.0  # capture_timeout_s, or its default for this cell's tokens
    inline: dict = field(default_factory=dict)  # repeat -> metrics its actor measured (reference_metrics: in_actor)
    layers: dict | None = None  # a layers: cell's capture manifest part (actors/capture.py)
    decode: list = field(default_factory=list)  # a decode: cell's capture manifest parts, one per repeat
    prefix: list = field(default_factory=list)  # a prefix_cache: cell's, one per repeat


# Without capture_timeout_s: this long per token fed in one repeat, at least CAPTURE_FLOOR_S. Two
# seconds a token is ~4x the slowest capture measured here (HF bf16 on AVX2 without AMX: 0.56 s).
CAPTURE_S_PER_TOKEN = 2.0
CAPTURE_FLOOR_S = 600.0


def done_row(plan: Plan, live: Live, run_id: str, wh: Warehouse, attempts: int = 1) -> dict:
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
        artifact_recipe=json.dumps({**art["recipe"], **_candidate_facts(plan, cell)}, sort_keys=True) if art else None,
        tokenizer_parity=live.parity["status"] if live.parity else "not_checked", max_tokens=cell.max_tokens,
        settings=json.dumps(loaded["settings"], sort_keys=True),
        fingerprint=json.dumps(loaded.get("fingerprint"), sort_keys=True, default=str),
        versions=json.dumps(loaded["versions"], sort_keys=True), host=loaded["host"], node_id=loaded["node_id"],
        rows_via=loaded["rows_via"], model_via=loaded["model_via"], load_seconds=loaded["load_seconds"],
        storage=json.dumps(storage_summary(live.storage), sort_keys=True), layers=_layers_field(live),
        decode=_decode_field(live), prefix_cache=_prefix_field(live),
        capture_seconds=live.capture_s, build_libraries=json.dumps(loaded["build_libraries"], sort_keys=True),
        attempts=attempts)


def _layers_field(live: Live) -> str | None:
    """cells.layers: what a layers: cell recorded: indices, depth, the engine's tensor names, rows."""
    got = live.layers
    if not got:
        return None
    return json.dumps({"layers": got["layers"], "depth": got["depth"], "rows_per_repeat": got["rows"],
                       "sources": got.get("sources")}, sort_keys=True)


def _decode_field(live: Live) -> str | None:
    """cells.decode: steps, starts, rows per repeat, and how far decode rows were from the prefill's."""
    if not live.decode:
        return None
    d = live.decode
    return json.dumps({"steps": d[0]["steps"], "at": d[0]["at"], "rows_per_repeat": d[0]["rows"],
                       "identical_rows": sum(x["identical_rows"] for x in d), "rows": sum(x["rows"] for x in d) // 2,
                       "max_abs_diff_vs_prefill": max(x["max_abs_diff_vs_prefill"] for x in d),
                       "decode_seconds": sum(x["seconds"] for x in d)}, sort_keys=True)


def _prefix_field(live: Live) -> str | None:
    """cells.prefix_cache: per prompt the tokens the warm cache served, and how far its rows were."""
    if not live.prefix:
        return None
    d = live.prefix
    return json.dumps({"rows_per_repeat": d[0]["rows"], "hits": d[0]["hits"],
                       "identical_rows": sum(x["identical_rows"] for x in d), "rows": sum(x["rows"] for x in d) // 2,
                       "max_abs_diff_vs_prefill": max(x["max_abs_diff_vs_prefill"] for x in d),
                       "seconds": sum(x["seconds"] for x in d)}, sort_keys=True)


def _candidate_facts(plan: Plan, cell: Cell) -> dict:
    """A published file's label and what its header declares (quant type, importance matrix)."""
    if not cell.artifact:
        return {}
    from matrix.candidates import header_facts

    return {**header_facts(cell, plan.models[cell.model]), **({"label": cell.label} if cell.label else {})}


class Sweep:
    """The run loop's state: the cells in flight, the calls queued on their actors, the counts."""

    def __init__(self, plan: Plan, wh: Warehouse, run: dict, nodes: list, log: Callable[[str], None], delivery):
        self.plan, self.wh, self.run, self.run_id, self.nodes, self.log = plan, wh, run, run["run_id"], nodes, log
        self.attempts: dict[str, int] = {}  # cell id -> times started in this run
        self.failed: dict[str, Failure] = {}  # cell id -> why
        self.delivery = delivery  # actors.stack_actor.Delivery
        self.via = {"node": 0, "driver": 0, "bytes_to_driver": 0}  # runs.rows_delivery
        self.live: dict[str, Live] = {}
        self.pending: dict = {}  # object ref -> launch.Call
        self.cells_total, self.cells_done = len(plan.cells), len(plan.complete)
        self.units_total = self.units_done = self.rows = 0
        self.t0 = time.perf_counter()
        self.finished: set[str] = set(plan.complete)  # cells whose shards are all in the warehouse
        self.waiting: dict[str, list[Cell]] = {}  # model -> cells started once its reference is done
        self.inline_written = 0

    def start(self, cell: Cell) -> None:
        """Start a cell; under `reference_metrics: in_actor` a model's other cells wait for its
        reference's shards (they measure their rows against them as they capture)."""
        plan, ref = self.plan, self.plan.reference_cells.get(cell.model)
        if plan.spec.reference_metrics != "in_actor" or ref is None:
            return self._start(cell, None)
        if ref != cell.cell_id and ref in self.live:  # the reference first (execute starts it first)
            self.waiting.setdefault(cell.model, []).append(cell)
            self.units_total += len(plan.todo[cell.cell_id])  # counted now, so progress shows the whole run
            return None
        return self._start(cell, ref if ref == cell.cell_id or ref in self.finished else None)

    def release(self, model: str) -> None:
        """The model's reference is done, failed or skipped: its waiting cells start now (measuring
        in the actor only against a reference that is done)."""
        ref = self.plan.reference_cells.get(model)
        for cell in self.waiting.pop(model, []):
            self.units_total -= len(self.plan.todo[cell.cell_id])  # _start counts them again
            self._start(cell, ref if ref in self.finished else None)

    def _start(self, cell: Cell, metrics_ref: str | None) -> None:
        plan = self.plan
        model, threads, repeats = plan.models[cell.model], placement.cell_threads(cell, self.nodes), plan.todo[cell.cell_id]
        work = launch.Work(self.run_id, self.delivery, plan.spec.positions, repeats,
                           [(p.prompt_id, p.text, p.token_ids) for p in plan.prompts[cell.model]],
                           plan.special[cell.model], plan.vocab[cell.model], plan.spec.store, metrics_ref)
        started = launch.start(cell, stack_desc(cell, model), model_copy(model), threads, self.nodes, work)
        self.live[cell.cell_id] = Live(cell, started, threads, len(repeats), repeats=sorted(repeats),
                                       capture_limit_s=self.capture_limit(cell))
        self.pending.update(started.calls)
        self.units_total += len(repeats)

    def drop(self, cid: str) -> None:
        for fut in [f for f, call in self.pending.items() if call.cell_id == cid]:
            del self.pending[fut]
        launch.stop(self.live.pop(cid).started)

    def retire(self, cid: str) -> Live:
        """Stop a cell that will not finish in this attempt: its captures still out leave the total."""
        live = self.live[cid]
        self.units_total -= live.left
        self.drop(cid)
        return live

    def skip(self, cid: str, reason: str) -> None:
        self.log(f"[cells {self.cells_done + 1}/{self.cells_total}] {cid} skipped: {reason}")
        live = self.retire(cid)
        self.wh.write_rows("cells", cid, [skipped_row(self.plan, live.cell, self.run_id, reason)])
        self.cells_done += 1
        self.progress()
        self._reference_over(live.cell)

    def _reference_over(self, cell: Cell) -> None:
        if self.plan.reference_cells.get(cell.model) == cell.cell_id:
            self.release(cell.model)

    def progress(self) -> None:
        """The runs row follows the sweep, so an interrupted run still shows what it did."""
        self.wh.write_rows("runs", self.run_id, [{**self.run, "cells_done": self.cells_done, "rows_written": self.rows,
                                                  "cells_failed": len(self.failed),
                                                  "rows_delivery": json.dumps(self.via)}])

    def on_error(self, call: Call, exc: Exception) -> None:
        """One of a cell's calls raised: skip, retry or fail that cell, and only that cell."""
        cid = call.cell_id
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SkipCell):
            # After a failed load every later call of the cell raises the load's own exception
            # (StackActor._loaded), so a SkipCell from any of them is the load's outcome.
            self.skip(cid, str(cause).splitlines()[0])
            return
        full = storage_error(exc)
        if full is not None:  # the warehouse's disk, not the cell: every other cell would fail too
            raise StorageError(storage_line(full, self.wh.where)) from None
        failure, attempt = classify(exc), self.attempts.get(cid, 1)
        if attempt <= failure.retries_allowed(self.plan.spec.retries):
            self.log(f"{cid}: {failure.line()} -- starting it again (attempt {attempt + 1} of at most "
                     f"{failure.retries_allowed(self.plan.spec.retries) + 1})")
            live = self.retire(cid)
            done = self.wh.completed_repeats(cid)  # shards the dead actor finished are kept
            self.plan.todo[cid] = [r for r in self.plan.todo[cid] if r not in done]
            self.attempts[cid] = attempt + 1
            self.start(live.cell)
            return
        self.give_up(cid, failure, attempt)

    def give_up(self, cid: str, failure: Failure, attempt: int) -> None:
        live = self.retire(cid)
        self.failed[cid] = failure
        self.wh.write_rows("cells", cid, [failed_row(self.plan, live, self.run_id, failure, attempt)])
        self.log(f"[cells {self.cells_done}/{self.cells_total}] {cid} FAILED after {attempt} attempt(s): {failure.line()}")
        self.progress()
        self._reference_over(live.cell)

    def capture_limit(self, cell: Cell) -> float:
        """Seconds one repeat may take (worked out once, when the cell starts)."""
        spec = self.plan.spec
        if spec.capture_timeout_s:
            return spec.capture_timeout_s
        fed = sum(min(len(p.token_ids), cell.max_tokens or len(p.token_ids)) for p in self.plan.prompts[cell.model])
        return max(CAPTURE_FLOOR_S, CAPTURE_S_PER_TOKEN * fed)

    def limit(self, live: Live) -> tuple[float, str] | None:
        """(seconds, spec key) for what the cell's actor is doing now; None while it is being placed."""
        if live.phase == "placing":
            return None
        if live.phase == "loading":
            return self.plan.spec.load_timeout_s, "load_timeout_s"
        return live.capture_limit_s, "capture_timeout_s"

    def advance(self, live: Live, call: Call) -> None:
        """A call of rank 0 came back: the next one in its queue starts now. (Two calls done by
        the same wait may come back in either order, so the phase follows what is back, not the order.)"""
        if call.kind is Kind.CAPTURE and call.repeat in live.repeats:
            live.repeats.remove(call.repeat)
        # any call of rank 0 that came back means its actor exists: never "placing" again
        phase = ("loading" if live.loaded is None
                 else "tokenizer parity" if live.parity is None
                 else f"capture r{live.repeats[0]}" if live.repeats else "closing")
        if phase != live.phase:
            live.phase, live.since = phase, time.perf_counter()

    def overdue(self) -> None:
        """Stop every cell whose engine ran past its time limit, and record it failed."""
        now = time.perf_counter()
        for cid, live in list(self.live.items()):
            lim = self.limit(live)
            if lim and now - live.since > lim[0]:
                self.give_up(cid, Failure("Timeout", f"{live.phase} ran past {lim[0]:.0f}s ({lim[1]}); its engine was "
                                                     "stopped", infrastructure=False), self.attempts.get(cid, 1))

    def next_deadline(self) -> float:
        """Seconds until the first time limit of a cell in flight runs out (inf: none)."""
        left = [live.since + lim[0] - time.perf_counter() for live in self.live.values() if (lim := self.limit(live))]
        return min(left, default=float("inf"))

    def record(self, call: Call, result: dict) -> None:
        live = self.live[call.cell_id]
        try:
            self._record(live, call, result)
        finally:
            if call.cell_id in self.live:
                self.advance(live, call)

    def _record(self, live: Live, call: Call, result: dict) -> None:
        if call.kind is Kind.READY:
            return
        if call.kind is Kind.LOAD:
            live.loaded = result
            away = f"; weights {result['model_via']}, rows via the {result['rows_via']}" \
                if (result["model_via"], result["rows_via"]) != ("local", "node") else ""
            self.log(f"loaded {call.cell_id} on {result['host']} (pid {result['pid']}) in {result['load_seconds']:.1f}s{away}")
        elif call.kind is Kind.PARITY:
            live.parity = result
            self._record_parity(call.cell_id, result)
        elif call.kind is Kind.CAPTURE:
            self.units_done += 1
            self.rows += result["rows"]
            live.capture_s += result["seconds"]
            live.storage.append(result["storage"])
            if result.get("layers"):
                live.layers = result["layers"]
            if result.get("decode"):
                live.decode.append(result["decode"])
            if result.get("prefix_cache"):
                live.prefix.append(result["prefix_cache"])
            if result.get("metrics") is not None:
                live.inline[call.repeat] = result["metrics"]
            live.left -= 1
            self.via[result["rows_via"]] += 1
            self.via["bytes_to_driver"] += result["bytes_sent"]
            rate = self.rows / max(time.perf_counter() - self.t0, 1e-9)
            self.log(f"[cells {self.cells_done}/{self.cells_total} | captures {self.units_done}/{self.units_total}] "
                     f"{call.cell_id} r{call.repeat}: {result['rows']} rows in {result['seconds']:.1f}s"
                     + (f" (measured against the reference in {m['seconds']:.1f}s of it)"
                        if (m := result.get("metrics")) and "seconds" in m else "") + " "
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
        row = done_row(self.plan, live, self.run_id, self.wh, self.attempts.get(cid, 1))
        self.wh.write_rows("cells", cid, [row])
        ray.get([a.close.remote() for a in live.started.actors])
        self.drop(cid)
        self.cells_done += 1
        self.finished.add(cid)
        self.log(f"[cells {self.cells_done}/{self.cells_total}] {cid} done")
        self._store_inline(row, live)
        self.progress()
        self._reference_over(live.cell)

    def _store_inline(self, row: dict, live: Live) -> None:
        """The metrics the cell's actor measured, written as `matrix analyze` would write them."""
        if not live.inline:
            return
        errors = sorted({f"{m['error']}" for m in live.inline.values() if "error" in m})
        if errors:
            self.log(f"{row['cell_id']}: metrics not measured in the actor ({errors[0]}); `matrix analyze` measures them")
            return
        from analysis.analyze import store_inline

        ref_id = next(iter(live.inline.values()))["reference"]
        ref = row if ref_id == row["cell_id"] else \
            next(r for r in self.wh.read_rows("cells", ref_id) if r["status"] == "done")
        if store_inline(self.wh, row, ref, live.inline, self.log):
            self.inline_written += 1
        else:
            self.log(f"{row['cell_id']}: some repeats were captured in an earlier run; `matrix analyze` measures them")

    def loop(self, cluster_config: str | Path | None) -> None:
        import ray

        last_event = last_beat = time.perf_counter()
        while self.pending or self.waiting:
            if not self.pending:  # cannot happen (a reference's end releases its cells); never strand them
                for model in list(self.waiting):
                    self.release(model)
                continue
            quiet = time.perf_counter() - max(last_event, last_beat)
            wait = max(0.05, min(HEARTBEAT_S - quiet, self.next_deadline()))
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=wait)
            if not ready:
                self.overdue()
                if time.perf_counter() - max(last_event, last_beat) >= HEARTBEAT_S:
                    # nothing finished for a while: say what is still waiting, and on what
                    self.log(self.heartbeat(placement.known_nodes(placement.cluster_nodes(), cluster_config)))
                    last_beat = time.perf_counter()
                continue
            last_event = time.perf_counter()
            call = self.pending.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except Exception as e:  # the call's cell answers for it (on_error), never the sweep
                self.on_error(call, e)
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
        now = time.perf_counter()
        busy = sorted((cid, lv) for cid, lv in self.live.items() if lv.loaded is not None)
        if busy:  # what each loaded cell's engine is doing, and for how long (its time limit applies)
            state += "; running: " + ", ".join(f"{cid} {lv.phase} for {now - lv.since:.0f}s"
                                                 for cid, lv in busy[:3]) \
                + (f" and {len(busy) - 3} more" if len(busy) > 3 else "")
        return (f"waiting {time.perf_counter() - self.t0:.0f}s in: captures {self.units_done}/{self.units_total}, "
                f"rows {self.rows}{state}")
