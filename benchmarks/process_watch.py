"""A command's wall time and peak memory, as the benchmarks that race another tool measure them:
the process's own (wait4), and the largest cell host's while it runs (ActorPeak)."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path


def timed(cmd: list[str], env: dict, log_to: Path) -> tuple[float, float, str]:
    """-> (wall seconds, peak RSS in GB of the process and its waited-for children, its output)."""
    with open(log_to, "w") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)  # the child's own rusage, not every child's so far
        wall = time.perf_counter() - t0
    code, text = os.waitstatus_to_exitcode(status), Path(log_to).read_text()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {code}):\n{text[-3000:]}")
    return wall, usage.ru_maxrss / 1e6, text  # ru_maxrss: KiB on Linux


class ActorPeak:
    """The largest peak RSS (VmHWM) of any cell host while the run goes: a Ray actor is raylet's
    child, a local worker runs in its own session, so wait4 on the driver sees neither."""

    def __init__(self, every: float = 0.25):
        self.every, self.peak_kb, self.stop = every, 0, threading.Event()

    def _poll(self) -> None:
        while not self.stop.wait(self.every):
            for proc in Path("/proc").iterdir():
                try:
                    cmdline = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
                    if b"StackActor" in cmdline or b"local_host.py" in cmdline:
                        hwm = re.search(r"VmHWM:\s+(\d+) kB", (proc / "status").read_text())
                        self.peak_kb = max(self.peak_kb, int(hwm.group(1)) if hwm else 0)
                except OSError:  # the process ended between listing and reading
                    continue

    def __enter__(self):
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
