"""This machine's models and engine artifacts: the catalog, a model fetched or cut to its first
layers, the artifacts cache listed or pruned. Each returns a frozen record whose `to_dict()` is
what the verb prints with `--json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common.errors import UserError
from common.output import log as stderr_log


@dataclass(frozen=True)
class CatalogResult:
    """One row per catalog model: name, source, license, layers, what it is for."""

    models: tuple[dict, ...]

    def to_dict(self) -> list[dict[str, Any]]:
        return list(self.models)


@dataclass(frozen=True)
class CutResult:
    """A model cut to its first `layers` layers: an HF checkpoint directory, or a GGUF file."""

    name: str
    layers: int
    bf16: bool
    gguf: bool
    path: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CacheResult:
    """Every artifact of this machine's cache, least recently used first; with warehouses given, the
    cells there that ran each one."""

    root: str
    artifacts: tuple[dict, ...]

    @property
    def bytes(self) -> int:
        return sum(a["bytes"] for a in self.artifacts)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "artifacts": list(self.artifacts), "bytes": self.bytes}


@dataclass(frozen=True)
class PruneResult:
    removed: tuple  # backends.artifacts.Artifact
    in_use: tuple  # the ones a running cell holds: never removed

    def to_dict(self) -> dict[str, Any]:
        return {"removed": [a.to_dict() for a in self.removed], "in_use": [a.to_dict() for a in self.in_use]}


def models() -> CatalogResult:
    from matrix.spec import models as catalog

    return CatalogResult(tuple(catalog.catalog_row(m) for m in catalog.CATALOG.values()))


def fetch_model(name: str, log: Callable[[str], None] | None = None):
    """A catalog model downloaded (and dequantised, for a GGUF source) into the cache; returns its
    matrix.spec.models.ResolvedModel (hf_dir, source and weights sha256, license, notices)."""
    from matrix.spec import models as catalog
    from matrix.spec.parse import ModelRef

    if name not in catalog.CATALOG:
        raise UserError(f"models fetch: unknown catalog model {name!r} (known: {', '.join(catalog.CATALOG)})")
    return catalog.fetch(ModelRef(name, "catalog", name), log=log or stderr_log)


def cut_model(
    name: str, layers: int, out: str, bf16: bool = False, gguf: bool = False, log: Callable[[str], None] | None = None
) -> CutResult:
    """The catalog model with only its first `layers` layers, as an HF checkpoint (bf16: its weights
    in bf16) or, gguf, a GGUF holding the source GGUF's own quantised tensors of those layers."""
    from matrix.spec import models as catalog

    if layers < 1:
        raise UserError(f"models cut: --layers must be at least 1, got {layers}")
    where = Path(out)
    if where.is_file() or (where.is_dir() and any(where.iterdir())):
        raise UserError(f"models cut: {where} exists{'' if where.is_file() else ' and is not empty'}")
    if gguf and bf16:
        raise UserError("models cut: --gguf keeps the source's own quantisation; --bf16 does not apply")
    resolved = fetch_model(name, log)
    if gguf:
        from store.gguf_cut import cut_gguf

        if not resolved.gguf_path:
            raise UserError(f"models cut: {name} has no source GGUF to cut")
        cut_gguf(Path(resolved.gguf_path), where, layers)
        size = where.stat().st_size
    else:
        catalog.cut_layers(Path(resolved.hf_dir), where, layers, bf16=bf16)
        size = sum(f.stat().st_size for f in where.iterdir())
    return CutResult(name, layers, bf16, gguf, str(where), size)


def _users(warehouses: list[str]) -> dict[str, list[str]]:
    """artifact sha256 -> the cells of these warehouses that ran it."""
    from store import Warehouse

    out: dict[str, list[str]] = {}
    for where in warehouses:
        for c in Warehouse(where).require().read_all("cells"):
            if c.get("artifact_sha256"):
                out.setdefault(c["artifact_sha256"], []).append(c["cell_id"])
    return out


def cache(warehouses: list[str] | None = None) -> CacheResult:
    from backends import artifacts

    users = _users(warehouses or [])
    items = tuple({**a.to_dict(), "cells": users.get(a.sha256, [])} for a in artifacts.listing())
    return CacheResult(str(artifacts.root()), items)


def prune_cache(older_than_s: float = 0, keep_used_by: list[str] | None = None) -> PruneResult:
    """Remove the artifacts unused for older_than_s seconds, except those a cell of a keep_used_by
    warehouse ran and those a running cell holds."""
    from backends import artifacts

    removed, busy = artifacts.prune(older_than_s, set(_users(keep_used_by or [])))
    return PruneResult(tuple(removed), tuple(busy))
