"""What went wrong with a cell, and whether trying again can help.

Ray wraps what an actor raised (RayTaskError, with the original as `.cause`) and reports the
infrastructure's own failures as its own exception types; the local executor does the same with
CallError and WorkerDied (below), so one policy judges both. An actor or node that died, or an
object that was lost, says nothing about the cell: try it again elsewhere. An exception the
engine raised on the cell's input will be raised again: record it. Ray's memory monitor
killing the worker (OutOfMemoryError) gets one more try: an OOM that repeats is the cell's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from common.errors import ANSI, UserError, first_line


@dataclass(frozen=True)
class Failure:
    error_class: str  # the original exception's class, not Ray's wrapper
    message: str  # its first line, without ANSI codes
    infrastructure: bool  # the actor / node / object went away: retry on any node that fits
    oom: bool = False
    bad_input: bool = False  # a UserError (e.g. a node's weights differ): the run ends with exit 2

    def line(self) -> str:
        return f"{self.error_class}: {self.message}" if self.message else self.error_class

    def retries_allowed(self, retries: int) -> int:
        if not self.infrastructure:
            return 0
        return min(retries, 1) if self.oom else retries


class CallError(Exception):
    """What a local worker's call raised (`.cause`), as Ray's RayTaskError carries an actor's."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class WorkerDied(Exception):
    """A local worker process ended (killed, crashed, out of memory) with calls still out."""


def _ray_exceptions():
    try:
        import ray.exceptions as rx
    except ImportError:  # the local executor on a machine without ray
        return None
    return rx


def _infrastructure_types() -> tuple[type, ...]:
    rx = _ray_exceptions()
    if rx is None:
        return (WorkerDied,)
    names = (
        "RayActorError",
        "ActorUnavailableError",
        "NodeDiedError",
        "ObjectLostError",
        "OwnerDiedError",
        "WorkerCrashedError",
        "ObjectFetchTimedOutError",
        "ReferenceCountingAssertionError",
        "LocalRayletDiedError",
        "RaySystemError",
        "OutOfMemoryError",
    )
    return (WorkerDied,) + tuple(getattr(rx, n) for n in names if hasattr(rx, n))


def classify(exc: BaseException) -> Failure:
    """The cell's failure, from what the executor's get() raised for one of its calls."""
    rx = _ray_exceptions()
    oom = rx is not None and isinstance(exc, getattr(rx, "OutOfMemoryError", ()))
    if isinstance(exc, _infrastructure_types()):
        return Failure(type(exc).__name__, _infra_message(exc), True, oom)
    wrappers = (CallError,) + ((rx.RayTaskError,) if rx is not None else ())
    cause = getattr(exc, "cause", None) if isinstance(exc, wrappers) else None
    err = cause if isinstance(cause, BaseException) else exc
    if isinstance(err, _infrastructure_types()):  # e.g. a depot call inside the capture lost its actor
        return Failure(type(err).__name__, _infra_message(err), True)
    return Failure(type(err).__name__, first_line(str(err)), False, bad_input=isinstance(err, UserError))


def _infra_message(exc: BaseException) -> str:
    """Ray's infrastructure messages start with boilerplate; keep the line that says what died."""
    text = ANSI.sub("", str(exc))
    for pattern in (
        r"The actor died because of an error raised in its creation task[^\n]*",
        r"The actor died unexpectedly before finishing this task[^\n]*",
        r"The actor is dead because[^\n]*",
        r"The node[^\n]*died[^\n]*",
        r"[^\n]*was killed[^\n]*",
    ):
        m = re.search(pattern, text)
        if m:
            return m.group(0).strip()[:500]
    return first_line(text)


# -- the warehouse's own storage failing ----------------------------------------------------
# A full disk or a failing one is no cell's fault: the run stops, and says where and how full.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


class StorageError(Exception):
    """Writing the warehouse failed (disk full, I/O error): the run stops with this line."""


def storage_error(exc: BaseException) -> OSError | None:
    """The OSError of a full or failing disk behind exc (also inside Ray's wrapper), else None."""
    for e in (exc, getattr(exc, "cause", None), exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
    return None


def storage_line(err: OSError, where: str) -> str:
    """`No space left on device writing PATH (0.0 MiB free of 20 MiB there)`."""
    path = err.filename or where
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        du, vfs = shutil.disk_usage(probe), os.statvfs(probe)
        inodes = "no free inodes, " if vfs.f_files and not vfs.f_favail else ""
        free = f" ({inodes}{du.free / 2**20:.1f} MiB free of {du.total / 2**20:.0f} MiB there)"
    except OSError:
        free = ""
    return f"{err.strerror or type(err).__name__} writing {path}{free}"


def _marker_dir(where: str) -> Path:
    from common.files import cache_root

    return cache_root() / "unrecorded-runs" / hashlib.sha256(where.encode()).hexdigest()[:16]


def leave_marker(where: str, run_id: str, status: str, error: str | None) -> Path:
    """When the run's own row cannot be written (the disk is full), its outcome goes here, on
    this machine's cache disk, for the next run on the warehouse to record."""
    d = _marker_dir(where)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{run_id}.json"
    path.write_text(json.dumps({"run_id": run_id, "status": status, "error": error}))
    return path


def read_markers(where: str) -> dict[str, dict]:
    d = _marker_dir(where)
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.is_dir() else {}


def drop_marker(where: str, run_id: str) -> None:
    (_marker_dir(where) / f"{run_id}.json").unlink(missing_ok=True)
