"""Every id the project mints, made here and nowhere else.

A stack id is a stack's readable coordinates plus a hash of everything in the spec that changes
its rows, so one spec gives the same ids on every machine. A cell id is a stack captured by one
engine build: `stack@build`. They are distinct types (a plan's cells carry both); a cell made from
a file has a cell id of its own. Run ids sort by start time.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import secrets
import uuid
from typing import Any, NewType

StackId = NewType("StackId", str)  # what the spec names: model.engine.dtype.attention.tpN.device-<hash>
CellId = NewType("CellId", str)  # what the warehouse holds: a stack id @ the engine build that ran it


def stack_id(coords: dict[str, Any], key: dict[str, Any], replica: int = 0) -> StackId:
    """A stack as the spec names it. coords: model, engine, dtype, attention, tp, device; key:
    everything in the spec that changes the rows; replica i > 0 (another node) gets `.r<i>`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return StackId(
        f"{coords['model']}.{coords['engine']}.{coords['dtype']}.{coords['attention']}"
        f".tp{coords['tp']}.{coords['device']}-{digest}" + (f".r{replica}" if replica else "")
    )


def cell_id(stack: StackId, build: str) -> CellId:
    """A captured cell: the stack and the engine build that ran it (common/builds.py)."""
    return CellId(f"{stack}@{build[:8]}")


def base_stack(stack: StackId) -> StackId:
    """The stack a replica (`.r<i>`) copies: itself for replica 0."""
    return split_cell_id(stack)[0]


def split_cell_id(cell_id: str) -> tuple[StackId, int, str | None]:
    """(stack id, replica, build) of a cell id; a cell captured before builds were recorded
    (warehouse v4) has no build."""
    spec_id, _, build = cell_id.partition("@")
    m = re.fullmatch(r"(.*-[0-9a-f]{10})\.r([0-9]+)", spec_id)
    return (StackId(m.group(1)), int(m.group(2)), build or None) if m else (StackId(spec_id), 0, build or None)


def imported_cell_id(model: str, engine: str, file_sha256: str) -> CellId:
    """A cell made from a file (a llama.cpp KLD base): the file's hash names it."""
    return CellId(f"{model}.{engine}.{file_sha256[:12]}")


def check_cell_id(engine: str, dtype: str, attention: str) -> str:
    """The stack `matrix fixture check` runs in-process (never written to a warehouse)."""
    return f"fixture-check.{engine}.{dtype}.{attention}"


def run_id(kind: str = "run") -> str:
    """A `matrix run`: UTC start time + random suffix; an import: import-<random>."""
    if kind == "import":
        return "import-" + uuid.uuid4().hex[:10]
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def aside_dir() -> str:
    """Where a run moves the damaged shards it captures again: damaged/<UTC time>-<random>/."""
    return "damaged/" + run_id()


def prompt_id(name: str, ids_sha256: str) -> str:
    """A tokenised prompt: its corpus entry's name and the hash of its token ids."""
    return f"{name}-{ids_sha256[:12]}"


def probe_nonce() -> str:
    """What a run writes into its warehouse so a node can tell whether it sees that directory."""
    return secrets.token_hex(16)


def hub_artifact(repo: str, revision: str | None) -> str:
    """A hub checkpoint named as a candidate's artifact: 'hub:org/name@rev'."""
    return f"hub:{repo}@{revision or 'main'}"


def split_hub_artifact(artifact: str) -> tuple[str, str]:
    """'hub:org/name@rev' -> (org/name, rev)."""
    repo, _, rev = artifact.removeprefix("hub:").rpartition("@")
    return repo, rev
