"""A cell's reference weights on the node that runs it.

The driver resolved the model and recorded its weights' sha256. A node uses the directory at
the driver's path only when it holds exactly those weights: a copy that differs (another
dequantisation, another revision) is refused, naming the node and both hashes. A node without
the directory gets the driver's files through the depot (actors/depot.py), checked file by file
and as a whole, and keeps them in its cache under the weights' hash for the next cell.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from backends.artifacts import locked  # two cells on one node may want the same model
from common.errors import UserError
from common.files import cache_root, file_sha256, weights_digest_cached
from common.stack import ModelCopy


def _receive(depot, path: str, dest: Path) -> None:
    """Every file of the driver's `path` (a directory or one file) into dest, atomically."""
    import ray

    from actors.depot import fetch_file

    manifest = ray.get(depot.manifest.remote(path))
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        for rel, (size, sha) in manifest.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            fetch_file(depot, path, rel, size, sha, tmp / rel)
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(new: Path, dest: Path) -> None:
    """new becomes dest; a dest already there (a stale copy) is moved aside first and removed after."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=".old-", dir=dest.parent))
        os.replace(dest, old / "copy")
    os.replace(new, dest)
    if old is not None:
        shutil.rmtree(old)


def stale(manifest: dict[str, list], dest: Path) -> bool:
    """Whether a copy shipped earlier lacks a file of the driver's directory, or holds one of
    another size (the directory gained a file since, such as a GGUF's own vocabulary beside its
    dequantised weights, backends/gguf_vocab.py); the weights themselves are checked by digest."""
    return any(not (dest / rel).is_file() or (dest / rel).stat().st_size != size for rel, (size, _) in manifest.items())


def _stale_copy(depot, path: str, dest: Path) -> bool:
    import ray

    return stale(ray.get(depot.manifest.remote(path)), dest)


def model_dir(model: ModelCopy, depot, node: str) -> tuple[str, str]:
    """(a local directory holding the reference weights, how they got here: local | shipped | hub).
    node: this node, as error messages name it."""
    want = model.weights_sha256
    if model.hf_dir is None:  # a GGUF-sourced model taken as its file: the cells run that file
        return None, "gguf"
    if want is None:  # a hub id: the node loads it from the hub (or its own hub cache) itself
        return model.hf_dir, "hub"
    own = Path(model.hf_dir)
    if own.is_dir() and any(own.glob("*.safetensors")):
        got = weights_digest_cached(own)
        if got != want:
            raise UserError(
                f"node {node}: {own} holds weights sha256 {got}, but the driver recorded {want} "
                f"for model {model.name}; remove that copy or make it the same"
            )
        return str(own), "local"
    dest = cache_root() / "shipped" / want
    with locked(dest.parent):
        if not dest.is_dir() or _stale_copy(depot, model.hf_dir, dest):
            _receive(depot, model.hf_dir, dest)
    got = weights_digest_cached(dest)  # hashed once after it arrives, not at every cell's load
    if got != want:
        raise UserError(
            f"node {node}: the weights received for model {model.name} have sha256 {got}, the driver recorded {want}"
        )
    return str(dest), "shipped"


def _shipped_file(path: str, dest_name: str, depot) -> str:
    """One driver file or directory, received once through the depot into this node's cache
    (dest_name carries its hash), for every later cell. A file lands as dest/<its name> (the
    depot's manifest keys it by name), a directory's files land in dest itself."""
    dest = cache_root() / "shipped" / dest_name
    with locked(dest.parent):
        if not dest.is_dir():
            _receive(depot, path, dest)
    own = dest / Path(path).name
    return str(own) if own.is_file() else str(dest)


def source_gguf(model: ModelCopy, depot) -> str | None:
    """The GGUF the weights came from (a llama.cpp cell of its quant type runs it as it is)."""
    if not model.source_gguf:
        return None
    own = Path(model.source_gguf)
    if own.is_file() and file_sha256(own) == model.source_sha256:
        return str(own)
    return _shipped_file(model.source_gguf, f"gguf-{model.source_sha256}", depot)


def artifact_file(path: str | None, sha256: str | None, depot) -> str | None:
    """A candidate's published file on this node: the driver's path when this node has it (the
    backend checks its hash where it reads it), else a copy sent through the depot, kept by hash."""
    if not path or path.startswith("hub:"):  # a hub id: the node loads it from the hub itself
        return path
    if Path(path).is_file() or Path(path).is_dir():
        return path
    return _shipped_file(path, f"artifact-{sha256}", depot)
