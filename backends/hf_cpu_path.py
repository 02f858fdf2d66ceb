"""The HF engine's CPU code paths (`options: {cpu_path: ...}`, common/cpu_paths.py): the switches
set in the host's environment before torch loads (HFBackend.runtime_env), and what ran read back
in that process. torch reads ATEN_CPU_CAPABILITY and oneDNN its ONEDNN_MAX_CPU_ISA once, at their
first use, and a value either does not take runs its default without a word, so a cell whose
kernels are not the ones it named fails before any row is kept."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import tempfile
from typing import Any

from common import cpu_paths


def env(value: str | None) -> dict[str, str]:
    """The host's environment entries for path `value` (none for native or no path)."""
    path = cpu_paths.PATHS.get(value or cpu_paths.NATIVE)
    return path.env() if path else {}


def switches() -> dict[str, str] | None:
    """The CPU code path switches set in this process's environment (None: none)."""
    return {k: v for k in cpu_paths.ENV_KEYS if (v := os.environ.get(k))} or None


@functools.cache
def onednn_isa(torch) -> str | None:
    """The ISA oneDNN runs a bf16 linear at in this process, as its verbose mode names it (None:
    no oneDNN primitive ran it; torch's own kernel did). oneDNN prints to this process's stdout,
    read back through a temporary file for the one call; it names the ISA once, with the process's
    first primitive, hence once a process (before any forward: the host asks right after its load).
    A 16 x 64 by 64 x 64 linear is one torch hands to oneDNN (a 4 x 64 one it keeps for itself)."""
    x, w = torch.ones(16, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16)
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(out.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.nn.functional.linear(x, w)
        finally:
            sys.stdout.flush()
            ctypes.CDLL(None).fflush(None)  # C's stdout buffer too: oneDNN's line is written there
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        lines = out.read().splitlines()
    return next((line.split("isa:", 1)[1].strip() for line in lines if ",isa:" in line), None)


def ran(torch, value: str) -> dict[str, Any]:
    """What this process runs for a cell of path `value`: torch's kernels, oneDNN's ISA and the
    switches as set; raises where it is not the path asked for (a silent fallback)."""
    got = {
        "cpu_path": value,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa(torch),
        "cpu_path_env": {k: os.environ.get(k) for k in cpu_paths.ENV_KEYS},
    }
    missing = {k: v for k, v in env(value).items() if os.environ.get(k) != v}
    why = (
        f"the host's environment lacks {', '.join(f'{k}={v}' for k, v in missing.items())}"
        if missing
        else cpu_paths.mismatch(value, got["cpu_capability"], got["onednn_isa"])
    )
    if why:
        raise RuntimeError(f"cpu_path {value}: {why}; this CPU cannot run that path here")
    return got
