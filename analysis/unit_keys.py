"""What an analysis output was computed from: each unit's content key (the metric kernel's
version and its inputs' digests), kept in the output's Parquet metadata (analysis/analyze.py)."""

from __future__ import annotations

import hashlib
import json
from typing import Callable

from analysis import metrics as M
from common.errors import UserError
from store import Warehouse


def unit_key(kernel: int | None = None, **parts) -> str:
    """kernel: the metric kernel's version the key is for (default: this one's)."""
    payload = {"kernel": M.KERNEL_VERSION if kernel is None else kernel, **parts}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cell_key(ref_id: str, ref_digest: str, floor: float, shards: dict[int, str], kernel: int | None = None) -> str:
    """A cell unit's content key: what its metrics file was computed from."""
    return unit_key(kernel, ref=ref_id, ref_digest=ref_digest, floor=floor, shards=shards)


def as_measured(
    wh: Warehouse, cell_id: str, parts: tuple, meta: dict | None, log: Callable[[str], None]
) -> dict | None:
    """A cell whose shards keep no values (keep_rows: references) cannot be measured again: its
    metrics stay as its actor measured them, under their own kernel version, where they were
    measured from these very rows and this reference (parts: cell_key's inputs now; meta: its
    metrics file's metadata). None for a cell that keeps its values: it is measured as usual."""
    if all(wh.shard_keeps_values(cell_id, r) for r in parts[3]):  # the repeats read cleanly
        return None
    path = wh.shard_path(cell_id, 0)
    if meta is None:
        raise UserError(
            f"{path}: no metrics, and its rows' values were not kept (keep_rows: references); "
            "`matrix run` of its spec captures it again"
        )
    if meta.get("key") != cell_key(*parts, kernel=meta.get("kernel_version")):
        raise UserError(
            f"{path}: its metrics were measured against another reference or other rows of it, "
            f"and its rows' values were not kept (keep_rows: references); analyze with the "
            "reference it was measured against, or capture it again"
        )
    log(
        f"cell {cell_id}: its metrics stay as measured where it was captured (kernel "
        f"{meta.get('kernel_version')}): its rows' values were not kept (keep_rows: references)"
    )
    return meta
