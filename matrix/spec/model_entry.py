"""A spec's `models:` entries (matrix/spec/parse.py): where each model's reference weights come from.

An entry is a mapping with exactly one source (catalog, path, hub, gguf), an optional name and
revision, or a string the source is read from: a catalog name, a local directory, a GGUF file
or a hub id. Local paths are resolved against the spec's directory and must exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.spec.tables import MODEL
from matrix.spec.validate import as_list, field_error

MODEL_KEYS = {k.name for k in MODEL}
SOURCES = ("catalog", "path", "hub", "gguf")


@dataclass(frozen=True)
class ModelRef:
    """Where a model's reference weights come from."""

    name: str
    kind: str  # catalog | path | hub | gguf
    location: str  # catalog name, absolute path, or hub id
    revision: str | None = None

    @property
    def identity(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.kind}:{self.location}{rev}"


def parse_models(path: Path, data: dict) -> dict[str, ModelRef]:
    """The spec's models by name (names are unique)."""
    models: dict[str, ModelRef] = {}
    for i, m in enumerate(as_list(path, "models", data["models"])):
        ref = parse_model(path, i, m)
        if ref.name in models:
            raise field_error(path, f"models[{i}].name", "duplicate model name", ref.name)
        models[ref.name] = ref
    return models


def parse_model(path: Path, idx: int, entry: Any) -> ModelRef:
    from matrix.spec import models as catalog  # local: catalog imports nothing heavy either

    fld = f"models[{idx}]"
    if isinstance(entry, str):
        if entry in catalog.CATALOG:
            return ModelRef(entry, "catalog", entry)
        entry = _from_string(path, fld, entry, catalog.CATALOG)
    if not isinstance(entry, dict):
        raise field_error(path, fld, "must be a name or a mapping", entry)
    unknown = set(entry) - MODEL_KEYS
    if unknown:
        raise field_error(
            path, f"{fld}.{sorted(unknown)[0]}", f"unknown key; expected one of {', '.join(sorted(MODEL_KEYS))}"
        )
    sources = [k for k in SOURCES if k in entry]
    if len(sources) != 1:
        raise field_error(path, fld, "needs exactly one of catalog, path, hub, gguf", entry)
    kind = sources[0]
    loc = entry[kind]
    if not isinstance(loc, str) or not loc:
        raise field_error(path, f"{fld}.{kind}", "must be a non-empty string", loc)
    if kind == "catalog" and loc not in catalog.CATALOG:
        raise field_error(path, f"{fld}.catalog", f"unknown catalog model; known: {', '.join(catalog.CATALOG)}", loc)
    if kind in ("path", "gguf"):
        loc = _local(path, f"{fld}.{kind}", kind, loc)
    name = entry.get("name") or _default_name(kind, loc)
    if not isinstance(name, str) or not name or any(c in name for c in "/\\ \t"):
        raise field_error(path, f"{fld}.name", "must be a name without slashes or spaces", name)
    revision = entry.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise field_error(path, f"{fld}.revision", "must be a string", revision)
    return ModelRef(name, kind, loc, revision)


def _from_string(path: Path, fld: str, entry: str, catalog: dict) -> dict:
    """A string entry (not a catalog name) as the mapping it stands for: a GGUF file, a local
    directory (or anything written as a path), else a hub id (owner/name)."""
    p = path.parent / os.path.expanduser(entry)
    if entry.endswith(".gguf"):
        return {"gguf": entry}
    if p.is_dir() or entry.startswith((".", "/", "~")):
        return {"path": entry}
    if "/" in entry:
        return {"hub": entry}
    raise field_error(
        path,
        fld,
        f"not a catalog model, local directory, GGUF file or hub id (catalog: {', '.join(catalog)})",
        entry,
    )


def _local(path: Path, fld: str, kind: str, loc: str) -> str:
    """A path or gguf source resolved against the spec's directory: a Hugging Face model directory
    (with config.json), or a file."""
    p = (path.parent / os.path.expanduser(loc)).resolve()
    if not p.exists():
        raise field_error(path, fld, "does not exist", str(p))
    if kind == "path" and not p.is_dir():
        raise field_error(path, fld, "must be a directory with config.json", str(p))
    if kind == "path" and not (p / "config.json").exists():
        raise field_error(path, fld, "has no config.json (not a Hugging Face model directory)", str(p))
    if kind == "gguf" and not p.is_file():
        raise field_error(path, fld, "must be a file", str(p))
    return str(p)


def _default_name(kind: str, loc: str) -> str:
    """A model's name when its entry gives none: the catalog name, the file's stem, the
    directory's name, or the hub id's last part."""
    if kind == "catalog":
        return loc
    if kind == "gguf":
        return Path(loc).stem
    if kind == "path":
        return Path(loc).name
    return loc.split("/")[-1]
