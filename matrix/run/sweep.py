"""The run loop: the cells in flight, the calls queued on their actors, and what to do next.

matrix/run/runner.py plans a run; matrix/run/execute.py prepares each cell's work (matrix/run/cellwork.py),
starts the cells here and calls Sweep.loop. Each cell is scheduled here, judged alone by
the retry policy (matrix/run/retry.py) when one of its calls raises, and its outcome recorded by
matrix/run/outcome.py, so one cell's failure never ends the others. The loop owns its progress:
the repeats still to capture start as the plan's and shrink as a retried cell's shards complete.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

from common.stack import Cell
from matrix.run import launch, placement, retry
from matrix.run.cellwork import CellWork
from matrix.run.failures import Failure
from matrix.run.launch import Call, Kind
from matrix.run.live import Host, Live
from matrix.run.outcome import Outcomes
from matrix.run.placement import Node
from matrix.run.plan import Plan
from store import Warehouse

HEARTBEAT_S = float(os.environ.get("LOGIT_MATRIX_HEARTBEAT_S", "60"))


class Sweep:
    """Scheduling: which cells are in flight, which wait for their reference, which calls are out."""

    def __init__(
        self,
        plan: Plan,
        wh: Warehouse,
        ex: launch.Executor,
        log: Callable[[str], None],
        out: Outcomes,
        nodes: list[Node],
    ):
        self.plan, self.wh, self.ex, self.log, self.out = plan, wh, ex, log, out
        self.nodes = nodes  # where the cells were prepared to run (CellWork.threads)
        self.todo = {cid: list(r) for cid, r in plan.todo.items()}  # cell id -> repeats still to capture
        self.attempts: dict[str, int] = {}  # cell id -> times started in this run
        self.live: dict[str, Live] = {}
        self.pending: dict = {}  # object ref -> launch.Call
        self.waiting: dict[str, list[CellWork]] = {}  # model -> cells started once its reference is done
        self.hosts: dict[str, Host] = {}  # host key -> a host shared by the cells of one loaded model
        # every host this run stopped: the run waits for each to be gone before it records its end,
        # since a killed host's open files keep their space (on a full disk, the end's own write)
        self.stopped: list[Live] = []

    def start_all(self, todo: list[CellWork]) -> None:
        """Every cell of the run started (or waiting for its reference), and how many that is said."""
        for cw in todo:
            self.start(cw)
        waiting = sum(len(v) for v in self.waiting.values())
        self.log(
            f"{len(todo)} cell(s) to run, {self.out.units_total} capture(s); {len(self.plan.complete)} already complete"
            + (f"; {waiting} start once their reference is done (reference_metrics: in_actor)" if waiting else "")
        )

    def start(self, cw: CellWork) -> None:
        """Start a cell; under `reference_metrics: in_actor` a model's other cells wait for its
        reference's shards (they measure their rows against them as they capture)."""
        cell, ref = cw.cell, self.plan.reference_cells.get(cw.cell.model)
        in_actor = self.plan.spec.reference_metrics == "in_actor" and ref is not None
        if in_actor and ref != cell.cell_id and ref in self.live:  # the reference first (cellwork.prepare)
            self.waiting.setdefault(cell.model, []).append(cw)
            self.out.units_total += len(self.todo[cell.cell_id])  # counted now: progress shows the whole run
            return
        self._start(cw, ref if in_actor and (ref == cell.cell_id or ref in self.out.finished) else None)

    def release(self, model: str) -> None:
        """The model's reference is done, failed or skipped: its waiting cells start now (measuring
        in the actor only against a reference that is done)."""
        ref = self.plan.reference_cells.get(model)
        waiting = self.waiting.pop(model, [])
        if waiting and ref not in self.out.finished:
            self.log(
                f"{model}: its reference {ref} is not done: {len(waiting)} cell(s) capture without measuring "
                "against it, and keep their rows' values for `matrix analyze`"
            )
        for cw in waiting:
            self.out.units_total -= len(self.todo[cw.cell.cell_id])  # _start counts them again
            self._start(cw, ref if ref in self.out.finished else None)

    def _load_ahead(self, model: str) -> None:
        """The reference is loaded: the first cell waiting for it may load now, beside its capture
        (Executor.load_ahead; the memory free now counts the reference's)."""
        cw = next(iter(self.waiting.get(model, ())), None)
        if cw is not None and cw.host_key is None:
            self.ex.load_ahead(cw.cell, cw.desc, cw.model, cw.threads, cw.work.delivery)

    def _start(self, cw: CellWork, metrics_ref: str | None) -> None:
        """A host of its own for the cell, or a place in the queue of the host that holds its weights."""
        if cw.host_key in self.hosts:  # that host's cell ends first; this one takes the loaded model over then
            self.hosts[cw.host_key].queue.append((cw, metrics_ref))
            self.out.units_total += len(self.todo[cw.cell.cell_id])
            return
        work = self._work(cw, metrics_ref)
        started = self.ex.start(cw.cell, cw.desc, cw.model, cw.threads, self.nodes, work)
        if cw.host_key is not None:
            self.hosts[cw.host_key] = Host(started)
        self._live(cw, started, work, "placing")
        self.out.units_total += len(work.repeats)

    def _work(self, cw: CellWork, metrics_ref: str | None) -> launch.Work:
        """The cell's work as prepared, with the repeats still missing and the reference it measures against."""
        # keep_rows: references drops the values of a cell's rows only where its host measures them
        values = self.plan.spec.keep_rows == "all" or metrics_ref in (None, cw.cell.cell_id)
        repeats = self.todo[cw.cell.cell_id]
        return dataclasses.replace(cw.work, repeats=repeats, metrics_ref=metrics_ref, values=values)

    def _hand_over(self, key: str) -> bool:
        """The next queued cell takes over the shared host `key` (whose cell has ended): its switch,
        parity and captures queued on it. False: nothing was queued (the host is gone)."""
        host = self.hosts[key]
        if not host.queue:
            del self.hosts[key]
            return False
        cw, metrics_ref = host.queue.pop(0)
        work = self._work(cw, metrics_ref)
        host.started = self.ex.reuse(host.started, cw.cell, cw.desc, work)
        self._live(cw, host.started, work, "loading")
        return True

    def _live(self, cw: CellWork, started: launch.Started, work: launch.Work, phase: str) -> None:
        """The cell in flight on `started` (a host of its own, or a shared one it took over), its calls out."""
        self.live[cw.cell.cell_id] = Live(cw, started, len(work.repeats), repeats=sorted(work.repeats), phase=phase)
        self.pending.update(started.calls)

    def _own_host(self, live: Live) -> Host | None:
        """The shared host the cell runs on now, if it runs on one."""
        host = self.hosts.get(live.host_key) if live.host_key else None
        return host if host is not None and host.started is live.started else None

    def _forget(self, cid: str) -> Live:
        """A cell's calls forgotten (those still queued on its host run and are not waited for)."""
        for fut in [f for f, call in self.pending.items() if call.cell_id == cid]:
            del self.pending[fut]
        return self.live.pop(cid)

    def drop(self, cid: str) -> None:
        """Stop a cell's actors and forget its calls."""
        self._stop(self._forget(cid))

    def _stop(self, live: Live) -> None:
        self.ex.stop(live.started)
        self.stopped.append(live)

    def end(
        self, cid: str, verdict: retry.Verdict, reason: str = "", failure: Failure | None = None, kind=None
    ) -> None:
        """The one way a cell in flight ends before it is done: skipped, started again, or failed.
        Its captures still out leave the total; its complete shards stay. A shared host goes on to
        its next cell only after a cell it could not load (a SkipCell from its load): after any
        other failure it may be unusable (a CUDA error), so it is stopped and the queued cells
        start on a fresh one."""
        live = self.live[cid]
        self.out.units_total -= live.left
        host = self._own_host(live)
        keep = host is not None and verdict is retry.Verdict.SKIP and live.loaded is None
        queued = []
        if keep:
            self._forget(cid)
        else:
            self.drop(cid)
            if host is not None:
                queued = self.hosts.pop(live.host_key).queue
        attempt = self.attempts.get(cid, 1)
        if verdict is retry.Verdict.RETRY:
            self._retry(live, failure, attempt)
        elif verdict is retry.Verdict.SKIP:
            self.out.skipped(live, reason)
        else:
            self.out.failed_cell(live, failure, attempt)
        if verdict is not retry.Verdict.RETRY:
            self._reference_over(live.cell)
        if keep and not self._hand_over(live.host_key):
            self._stop(live)
        for cw, metrics_ref in queued:  # a fresh host for them: the retried cell's, or the first's
            self.out.units_total -= len(self.todo[cw.cell.cell_id])
            self._start(cw, metrics_ref)

    def _retry(self, live: Live, failure: Failure, attempt: int) -> None:
        cid = live.cell.cell_id
        self.log(
            f"{cid}: {failure.line()} -- starting it again (attempt {attempt + 1} of at most "
            f"{failure.retries_allowed(self.plan.spec.retries) + 1})"
        )
        # shards the dead actor finished are kept, but for one without values (keep_rows: references):
        # what its actor measured died with it, and only a capture measures it again
        done = {r for r in self.wh.completed_repeats(cid) if self.wh.shard_keeps_values(cid, r)}
        self.todo[cid] = [r for r in self.todo[cid] if r not in done]
        self.attempts[cid] = attempt + 1
        self.start(live.prepared)

    def _finish(self, cid: str) -> None:
        live = self.live[cid]

        def close():
            if self._own_host(live) is not None:
                self._forget(cid)
                self._reference_over(live.cell)  # its waiting cells of the same weights queue on this host
                if self._hand_over(live.host_key):
                    return
                self.ex.close(live.started)
                self.ex.stop(live.started)
                return
            self.ex.close(live.started)  # its files are closed: the run need not wait for it to be gone
            self._forget(cid)
            self.ex.stop(live.started)  # its CPUs and GPUs are free: a reference's waiting cells start on them now
            self._reference_over(live.cell)

        self.out.done(live, self.attempts.get(cid, 1), close)

    def _reference_over(self, cell: Cell) -> None:
        if self.plan.reference_cells.get(cell.model) == cell.cell_id:
            self.release(cell.model)

    def on_error(self, call: Call, exc: Exception) -> None:
        """One of a cell's calls raised: the retry policy judges that cell, and only that cell."""
        j = retry.judge(exc, self.attempts.get(call.cell_id, 1), self.plan.spec.retries, self.wh.where)
        self.end(call.cell_id, j.verdict, j.reason, j.failure)

    def limit(self, live: Live) -> tuple[float, str] | None:
        return retry.limit(live.phase, self.plan.spec.load_timeout_s, live.prepared.capture_limit_s)

    def overdue(self) -> None:
        """Stop every cell whose engine ran past its time limit, and record it failed."""
        now = time.perf_counter()
        for cid, live in list(self.live.items()):
            lim = self.limit(live)
            if lim and now - live.since > lim[0]:
                self.end(cid, retry.Verdict.FAIL, failure=retry.timed_out(live.phase, lim))

    def next_deadline(self) -> float:
        """Seconds until the first time limit of a cell in flight runs out (inf: none)."""
        left = [live.since + lim[0] - time.perf_counter() for live in self.live.values() if (lim := self.limit(live))]
        return min(left, default=float("inf"))

    def record(self, call: Call, result: dict) -> None:
        """A call of rank 0 came back with its result."""
        live = self.live[call.cell_id]
        try:
            if call.kind is Kind.LOAD:
                self.out.loaded(live, call.cell_id, result)
                if call.cell_id == self.plan.reference_cells.get(live.cell.model):
                    self._load_ahead(live.cell.model)
            elif call.kind is Kind.PARITY:
                self.out.parity(live, call.cell_id, result)
            elif call.kind is Kind.CAPTURE:
                self.out.captured(live, call.cell_id, call.repeat, result)
            if call.kind is not Kind.READY and live.left == 0 and live.loaded is not None and live.parity is not None:
                self._finish(call.cell_id)
        finally:
            if call.cell_id in self.live:
                self.advance(live, call)

    def advance(self, live: Live, call: Call) -> None:
        """The next call in rank 0's queue starts now. (Two calls done by the same wait may come back
        in either order, so the phase follows what is back, not the order.)"""
        if call.kind is Kind.CAPTURE and call.repeat in live.repeats:
            live.repeats.remove(call.repeat)
        # any call of rank 0 that came back means its actor exists: never "placing" again
        phase = (
            "loading"
            if live.loaded is None
            else "tokenizer parity"
            if live.parity is None
            else f"capture r{live.repeats[0]}"
            if live.repeats
            else "closing"
        )
        if phase != live.phase:
            live.phase, live.since = phase, time.perf_counter()

    def loop(self) -> None:
        last_event = last_beat = time.perf_counter()
        while self.pending or self.waiting:
            if not self.pending:  # cannot happen (a reference's end releases its cells); never strand them
                for model in list(self.waiting):
                    self.release(model)
                continue
            quiet = time.perf_counter() - max(last_event, last_beat)
            wait = max(0.05, min(HEARTBEAT_S - quiet, self.next_deadline()))
            ready = self.ex.wait(list(self.pending), wait)
            if not ready:
                self.overdue()
                if time.perf_counter() - max(last_event, last_beat) >= HEARTBEAT_S:
                    # nothing finished for a while: say what is still waiting, and on what
                    self.log(self.heartbeat(self.ex.nodes()))
                    last_beat = time.perf_counter()
                continue
            last_event = time.perf_counter()
            call = self.pending.pop(ready[0])
            try:
                result = self.ex.get(ready[0])
            except Exception as e:  # the call's cell answers for it (on_error), never the sweep
                self.on_error(call, e)
                continue
            if call.kind is not Kind.RANK:  # another rank's load or forwards: rank 0 reports the cell
                self.record(call, result)

    def heartbeat(self, nodes: list) -> str:
        """One line while nothing finishes: which cells are not loaded yet, and where they can go now."""
        waiting = sorted(cid for cid, lv in self.live.items() if lv.loaded is None)
        where = [
            f"{cid} ({placement.where(live.cell.device, live.cell.tp, live.threads, nodes)})"
            for cid, live in ((c, self.live[c]) for c in waiting[:3])
        ]
        more = f" and {len(waiting) - 3} more" if len(waiting) > 3 else ""
        state = (f"; {len(waiting)} cell(s) not loaded yet: " + ", ".join(where) + more) if waiting else ""
        now = time.perf_counter()
        busy = sorted((cid, lv) for cid, lv in self.live.items() if lv.loaded is not None)
        if busy:  # what each loaded cell's engine is doing, and for how long (its time limit applies)
            state += (
                "; running: "
                + ", ".join(f"{cid} {lv.phase} for {now - lv.since:.0f}s" for cid, lv in busy[:3])
                + (f" and {len(busy) - 3} more" if len(busy) > 3 else "")
            )
        queued = sum(len(h.queue) for h in self.hosts.values())
        if queued:
            state += f"; {queued} cell(s) queued to take over a loaded model"
        out = self.out
        return (
            f"waiting {time.perf_counter() - out.t0:.0f}s in: captures {out.units_done}/{out.units_total}, "
            f"rows {out.rows}{state}"
        )
