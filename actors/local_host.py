"""A worker process of the local executor (matrix/run/local.py): one StackHost, its calls in order.

Started as `python .../actors/local_host.py FD LOG` (by path, so the driver's working directory
never lands on sys.path: a `ray/` session directory there would shadow a package): FD is this end of a socket pair the driver made
(no address, nothing another process could reach), LOG the file that takes this process's
stdout and stderr (engines print there; the driver's terminal stays one line per event). A
reader thread takes every queued call off the socket at once, so the driver never blocks
sending while a forward runs; the main thread runs them in order, as a Ray actor would.
Messages: ("init", args) then (seq, method, args); each answered (seq, ok, value | exception).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this file's own directory: its modules are imported as actors.*, never bare

import pickle
import queue
import signal
import threading
import traceback
from multiprocessing.connection import Connection

INIT = 0  # the seq of the constructor's answer (the host is ready)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the driver dies, even in the middle of a forward."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _answer(conn: Connection, seq: int, fn, args: tuple) -> None:
    try:
        value, ok = fn(*args), True
    except BaseException as e:  # sent back whole: the driver's retry policy judges it
        value, ok = _portable(e), False
    try:
        conn.send((seq, ok, value))
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a result that cannot travel
        conn.send((seq, False, RuntimeError(f"{type(e).__name__}: {e}")))


def _portable(e: BaseException) -> BaseException:
    """The exception itself when it pickles (SkipCell, UserError, OSError keep their type), else
    a RuntimeError with its class and first line; its traceback rides along for --debug."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        out = e
    except Exception:
        out = RuntimeError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    out.__notes__ = [tb]  # Python 3.11+: kept by pickle with the exception's __dict__
    return out


def main(fd: int, log_path: str) -> None:
    _die_with_parent()
    _redirect(log_path)
    conn = Connection(fd)
    calls: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            while True:
                calls.put(conn.recv())
        except (EOFError, OSError):
            calls.put(None)  # the driver closed its end: finish

    kind, args = conn.recv()
    assert kind == "init", kind
    from actors.stack_actor import StackHost

    host: list = []  # the StackHost, or the exception its constructor raised

    def make(*a):
        try:
            host.append(StackHost(*a))
        except BaseException as e:
            host.append(e)
            raise

    _answer(conn, INIT, make, args)
    threading.Thread(target=read, daemon=True).start()
    while (msg := calls.get()) is not None:
        seq, method, margs = msg
        if isinstance(host[0], BaseException):  # as on Ray: every call of a host that was never made fails
            _answer(conn, seq, _reraise, (host[0],))
            continue
        _answer(conn, seq, getattr(host[0], method), margs)


def _reraise(e: BaseException):
    raise e


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
