"""A bound plan executed by one Scheduler: the run's own row, every unfinished cell prepared and
started on the executor (matrix/run/launch.py: Ray's or this machine's), its outcomes collected,
and the run's end recorded whatever happens.

With Ray the caller (matrix.api) owns the connection: this module expects `ray` to be initialised
and never shuts it down. The run's own rows are built by matrix/run/record.py.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable

from common import ids
from matrix.run import cellwork, launch, record
from matrix.run.outcome import Outcomes
from matrix.run.plan import Plan
from matrix.run.sweep import Sweep
from store import Warehouse

# How long the end of a run waits for its killed hosts to be gone: a bound for a host that never
# goes, not a measure of how long one takes (on a loaded machine a kill takes seconds to arrive).
GONE_S = 120.0


class Scheduler:
    """One run on a warehouse and an executor, its steps in the order they happen (run())."""

    def __init__(self, wh: Warehouse, ex: launch.Executor, log: Callable[[str], None]):
        self.wh, self.ex, self.log = wh, ex, log

    def run(self, plan: Plan, argv: list[str], address: str | None, nonce: str) -> dict:
        """Record the run's start, prepare each cell's work, start the cells, collect their outcomes
        (the run loop retries a cell as the retry policy says), then stop every host and record the
        run's end whatever happened; returns the run's summary."""
        wh, ex, log = self.wh, self.ex, self.log
        run = record.begin(plan, wh, argv, address, ex.name, log, nonce)
        out, sweep, status = Outcomes(plan, wh, run, log), None, "failed"
        try:  # from here on, the run's end is recorded whatever happens
            delivery, nodes = ex.open(wh.where, nonce), ex.nodes()
            todo = cellwork.prepare(plan, nodes, run["run_id"], delivery)
            sweep = Sweep(plan, wh, ex, log, out, nodes)
            sweep.start_all(todo)
            sweep.loop()
            status = "done"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except Exception as e:
            storage = record.error(e, wh, run)
            if storage is not None:
                raise storage from None
            raise
        finally:
            self._stop(sweep)
            unrecorded = record.end(wh, run, status, out, log)
        if unrecorded is not None:
            raise unrecorded
        return record.summary(plan, out, run, len(todo))

    def _stop(self, sweep: Sweep | None) -> None:
        """Every host of the run stopped, and what the stopped ones were writing removed: the hosts
        stopped at the end and those a failure stopped earlier (sweep.stopped), each waited for until
        it is gone, so no file one of them still holds open keeps its space when the run's end is written."""
        self.ex.shutdown()  # first: no host still waiting for its turn starts while the others stop
        if sweep is None:  # the cells' work could not be prepared: none started
            return
        for cid in list(sweep.live):
            sweep.drop(cid)
        if sweep.stopped:  # a stopped run leaves no temp file: its killed actors' partial shards go too
            self.ex.wait_gone([a for lv in sweep.stopped for a in lv.started.actors], timeout_s=GONE_S)
            node = platform.node()
            wait_exited(
                [lv.loaded["pid"] for lv in sweep.stopped if lv.loaded and lv.loaded.get("host") == node], GONE_S
            )
            for p in self.wh.sweep_tmp():
                self.log(f"removed the partial file of a stopped capture: {p}")


def execute(
    plan: Plan,
    wh: Warehouse,
    argv: list[str],
    address: str | None,
    log: Callable[[str], None],
    ex: launch.Executor,
    nonce: str | None = None,
) -> dict:
    """Run every unfinished cell of a bound plan (bind()) on the executor ex (launch.Executor);
    returns a summary. nonce: this run's, when a host was started with it ahead of the run."""
    return Scheduler(wh, ex, log).run(plan, argv, address, nonce or ids.probe_nonce())


def wait_exited(pids: list[int], timeout_s: float = GONE_S) -> list[int]:
    """Until these processes of this machine have exited; returns those still running at the bound.
    A killed Ray actor is reported dead before its process is gone, and until then a file it holds
    open (a partial shard it was writing, already unlinked) keeps its space: on a full disk the
    run's end could not be written."""
    end = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < end and _running(pid):
            time.sleep(0.05)
    return [pid for pid in pids if _running(pid)]


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
