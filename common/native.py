"""Small C kernels of this project (analysis/metrics_kernel.c, store/floors_kernel.c) built for
this machine on first use and loaded through ctypes, which drops the GIL for each call.

A build takes well under a second and is cached per source, compiler, flags, C library and CPU
under the cache root (kernels/). No compiler, or no variant that builds and loads: load() returns
None, says why once on stderr, and the caller runs the same arithmetic in numpy.
LOGIT_MATRIX_COMPILE=0 forces that everywhere.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

from common.files import cache_root

# -ffp-contract=off: no fused multiply-adds, so each kernel computes the expressions its numpy
# twin does, rounding for rounding; -fno-math-errno (not -ffast-math) keeps IEEE inf and NaN.
BASE = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
# x86 compilers vectorise at 256 bits even where the CPU has AVX-512; at 512 the kernels call
# libmvec's 8-wide exp and log and 16-wide expf, faster on AVX-512 (docs/benchmark-notes.md).
# Without AVX-512: no effect.
WIDE = ["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else []
# Tried in order: glibc's vector exp/log (libmvec); scalar exp/log where there is no libmvec
# (macOS, musl); and without -march=native for a compiler that refuses it (clang before 15).
VARIANTS = (
    ["-march=native", *WIDE, *BASE, "-lmvec", "-lm"],
    ["-march=native", *WIDE, *BASE, "-DNO_LIBMVEC", "-lm"],
    [*BASE, "-DNO_LIBMVEC", "-lm"],
)

_build_lock = threading.Lock()
_pool_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_failed: dict[str, str] = {}
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has the pool object but none of its threads


os.register_at_fork(after_in_child=_forget_pool)


def threads() -> int:
    """Threads a kernel call spreads its rows over: the CPUs this process may use, capped by
    LOGIT_MATRIX_KERNEL_THREADS or else OMP_NUM_THREADS (what a Ray task or a benchmark sets)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cap = os.environ.get("LOGIT_MATRIX_KERNEL_THREADS") or os.environ.get("OMP_NUM_THREADS") or ""
    return max(1, min(n, int(cap))) if cap.isdigit() else n


def _machine_key() -> str:
    """What a build depends on beyond its source and flags: the C library, and the CPU that
    -march=native builds for (x86's model and flags, ARM's implementer, part and features)."""
    try:
        keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
        lines = sorted({ln.strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(keep)})
    except OSError:
        lines = []
    return "\n".join([platform.machine(), platform.processor(), " ".join(platform.libc_ver()), *lines])


def _build(source: Path) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC)")
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    base = [source.read_text(), ver, _machine_key()]
    built = [
        cache_root()
        / "kernels"
        / f"{source.stem}-{hashlib.sha256(chr(10).join(base + v).encode()).hexdigest()[:16]}.so"
        for v in VARIANTS
    ]
    errors = []
    for so in filter(Path.exists, built):  # a variant built before: no compile in every new process
        try:
            return ctypes.CDLL(str(so))
        except OSError as e:
            errors.append(f"{so.name}: {e}")
    for flags, so in zip(VARIANTS, built):
        if so.exists():
            continue  # it did not load, above
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            res = subprocess.run([cc, str(source), "-o", tmp, *flags], capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                errors.append((res.stderr.strip().splitlines() or ["no output"])[-1][:200])
                continue
            lib = ctypes.CDLL(tmp)  # a symbol the C library lacks fails here: the next variant then
            os.replace(tmp, so)  # whole or not at all: another process may be building the same key
            return lib
        except OSError as e:
            errors.append(str(e)[:200])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError(f"{cc}: {'; '.join(errors)}")


def load(source: Path, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The kernel built from source with its functions' signatures declared, or None (why: failure())."""
    name = str(source)
    if name in _loaded:
        return _loaded[name]
    with _build_lock:
        if name not in _loaded:
            lib = None
            if os.environ.get("LOGIT_MATRIX_COMPILE", "1") == "0":
                _failed[name] = "LOGIT_MATRIX_COMPILE=0"
            else:
                try:
                    lib = _build(source)
                    declare(lib)
                except (OSError, subprocess.SubprocessError, AttributeError) as e:
                    lib, _failed[name] = None, f"{type(e).__name__}: {str(e).strip()[:300]}"
                    print(
                        f"logit-matrix: {source.name} could not be built ({_failed[name]}); the same arithmetic "
                        "runs in numpy (~10x slower)",
                        file=sys.stderr,
                    )
            _loaded[name] = lib
    return _loaded[name]


def failure(source: Path) -> str | None:
    return _failed.get(str(source))


def _pool_of(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != n:
            if _pool is not None:
                _pool[1].shutdown(wait=False)  # tasks in flight finish; its threads then end
            _pool = (n, ThreadPoolExecutor(n, thread_name_prefix="native-kernel"))
        return _pool[1]


def spread(fn: Callable[[int, int], None], rows: int, per_task: int) -> None:
    """fn(first, last) over [0, rows) in tasks of per_task rows, on threads() threads. Returns
    only when every task has ended, whatever happened: the C writes into its caller's arrays."""
    n = threads()
    if n == 1 or rows <= per_task:
        for s in range(0, rows, per_task):
            fn(s, min(s + per_task, rows))
        return
    pool = _pool_of(n)
    tasks = [pool.submit(fn, s, min(s + per_task, rows)) for s in range(0, rows, per_task)]
    try:
        for t in tasks:
            t.result()
    finally:
        wait(tasks)  # an interrupt here must not free arrays the C is still writing
