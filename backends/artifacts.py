"""Engine weights built from the reference checkpoint, cached by what they were built from.

An artifact lives under ``<cache>/artifacts/<kind>/<key>/``. The key hashes the recipe (the tool,
its version, the settings) and the content of the source, never its path: config, tokenizer
files and weights hashes (content_key), so the same model in another directory converts once.
``recipe.json`` beside the artifact says how it was made, ``.last-used`` when a stack last loaded it.

Locks are flocks on the artifact's directory. Building takes it exclusively (two hosts may want
the same file; the second waits, then reuses the file). A process that uses an artifact holds it
shared for as long as it lives (ensure() returns with the hold taken), and `matrix cache prune`
removes a directory only when it gets the lock exclusively without waiting: an artifact a running
sweep has loaded is never removed under it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common.files import cache_root, locked, remember_sha256, sha256_file  # noqa: F401 (locked: re-exported)

PATH_FIELDS = ("source",)  # recipe fields that say where the source was, not what it was
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
_HELD: dict[str, int] = {}  # artifact directory -> the fd holding its shared lock in this process


def root() -> Path:
    return cache_root() / "artifacts"


def content_key(hf_dir: str, weights_sha256: str | None) -> str:
    """What a checkpoint directory holds, whatever its path: the hashes of its config and
    tokenizer files and of its weights."""
    from common.files import weights_digest_cached

    d = Path(hf_dir)
    files = {name: sha256_file(d / name) for name in SOURCE_FILES if (d / name).is_file()}
    weights = weights_sha256 or (weights_digest_cached(d) if d.is_dir() else hf_dir)
    return hashlib.sha256(json.dumps({"files": files, "weights": weights}, sort_keys=True).encode()).hexdigest()


def artifact_dir(kind: str, recipe: dict[str, Any], content: str | None = None) -> Path:
    keyed = {k: v for k, v in recipe.items() if k not in PATH_FIELDS}
    if content is not None:
        keyed["source_content"] = content
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    return root() / kind / key


def _hold(d: Path) -> bool:
    """Take (or keep) this process's shared hold on d; False when d is gone or not built."""
    if str(d) in _HELD:
        return (d / "recipe.json").is_file()
    try:
        fd = os.open(d, os.O_RDONLY)
    except FileNotFoundError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a builder or a prune has it
    if not (d / "recipe.json").is_file():  # not built yet, or pruned before we got it
        os.close(fd)
        return False
    _HELD[str(d)] = fd
    return True


def ensure(
    kind: str, name: str, recipe: dict[str, Any], build: Callable[[Path], None], content: str | None = None
) -> dict[str, Any]:
    """Return {path, sha256, recipe} for the artifact, building it once if needed, and hold it
    (shared) for the rest of this process. content: content_key of the source, when the recipe
    names it by path.

    build(tmp_path) must write the artifact (file or directory) at tmp_path.
    """
    d = artifact_dir(kind, recipe, content)
    while not _hold(d):
        with locked(d):
            meta = d / "recipe.json"
            if not meta.is_file():
                tmp = d / f".tmp-{os.getpid()}-{name}"
                build(tmp)
                digest = _digest(tmp)
                os.replace(tmp, d / name)
                if (d / name).is_file():  # a job that names the file next need not read it again
                    remember_sha256(d / name, digest)
                meta.write_text(
                    json.dumps({**recipe, "kind": kind, "sha256": digest, "file": name}, indent=1, sort_keys=True)
                )
    (d / ".last-used").write_text(f"{time.time():.0f}\n")
    data = json.loads((d / "recipe.json").read_text())
    return {"path": str(d / name), "sha256": data["sha256"], "recipe": recipe}


def recipe_of(path: str | Path) -> dict | None:
    """The recipe of a file this cache built, read from the recipe.json beside it where that names
    this file and its hash still matches (a file copied out and changed is not the artifact)."""
    from common.files import file_sha256

    p = Path(path).resolve()
    meta = p.parent / "recipe.json"
    if not p.is_relative_to(root().resolve()) or not meta.is_file():  # only this cache's own files
        return None
    try:
        data = json.loads(meta.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # not a recipe this cache wrote: the file is no artifact of it
    if not isinstance(data, dict) or data.get("file") != p.name or data.get("sha256") != file_sha256(p):
        return None
    return data


def _digest(p: Path) -> str:
    """sha256 of a file, or of a directory's files (name + content) in name order."""
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(p)).encode() + b"\0" + bytes.fromhex(sha256_file(f)))
    return h.hexdigest()


@dataclass(frozen=True)
class Artifact:
    kind: str
    dir: Path
    file: str
    sha256: str
    recipe: dict
    bytes: int
    last_used: float  # seconds since the epoch: its last load, else when it was built

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "dir": str(self.dir),
            "file": self.file,
            "sha256": self.sha256,
            "bytes": self.bytes,
            "last_used": self.last_used,
            "tool": self.recipe.get("tool"),
            "recipe": self.recipe,
        }


def listing() -> list[Artifact]:
    """Every built artifact of this machine's cache, least recently used first."""
    out = []
    for meta in sorted(root().glob("*/*/recipe.json")):
        d = meta.parent
        recipe = json.loads(meta.read_text())
        used = d / ".last-used"
        out.append(
            Artifact(
                d.parent.name,
                d,
                recipe.get("file", ""),
                recipe.get("sha256", ""),
                recipe,
                sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
                float(used.read_text()) if used.is_file() else meta.stat().st_mtime,
            )
        )
    return sorted(out, key=lambda a: (a.last_used, str(a.dir)))


def prune(older_than_s: float, keep_sha256: set[str]) -> tuple[list[Artifact], list[Artifact]]:
    """Remove artifacts unused for older_than_s whose sha256 is not in keep_sha256.
    Returns (removed, kept because a process holds them)."""
    removed, busy = [], []
    now = time.time()
    for a in listing():
        # 0: every one (.last-used holds whole seconds, so a use this second may read as just ahead)
        if (older_than_s > 0 and now - a.last_used < older_than_s) or a.sha256 in keep_sha256:
            continue
        fd = os.open(a.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a running cell holds it (or a build is under way)
            busy.append(a)
            os.close(fd)
            continue
        try:  # the recipe goes first: a waiting holder sees an unbuilt directory and builds again
            (a.dir / "recipe.json").unlink()
            shutil.rmtree(a.dir)
        finally:
            os.close(fd)
        removed.append(a)
    return removed, busy
