"""Engine weights built from the reference checkpoint, cached by what they were built from.

An artifact lives under ``<cache>/artifacts/<kind>/<key>/`` where key hashes the
source weights' sha256, the tool and its version, and the settings. Building
happens under a file lock (two actors may want the same file) into a temp
name, then an atomic rename; ``recipe.json`` beside it says how it was made.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from common.files import cache_root, sha256_file


def artifact_dir(kind: str, recipe: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "artifacts" / kind / key


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


def ensure(kind: str, name: str, recipe: dict[str, Any], build: Callable[[Path], None]) -> dict[str, Any]:
    """Return {path, sha256, recipe} for the artifact, building it once if needed.

    build(tmp_path) must write the artifact (file or directory) at tmp_path.
    """
    d = artifact_dir(kind, recipe)
    final = d / name
    meta = d / "recipe.json"
    with locked(d):
        if not meta.is_file():
            tmp = d / f".tmp-{os.getpid()}-{name}"
            build(tmp)
            digest = _digest(tmp)
            os.replace(tmp, final)
            meta.write_text(json.dumps({**recipe, "sha256": digest, "file": name}, indent=1, sort_keys=True))
    data = json.loads(meta.read_text())
    return {"path": str(final), "sha256": data["sha256"], "recipe": recipe}


def _digest(p: Path) -> str:
    """sha256 of a file, or of a directory's files (name + content) in name order."""
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(p)).encode() + b"\0" + bytes.fromhex(sha256_file(f)))
    return h.hexdigest()
