"""The `batch:` axis as the spec expands it: each combination's batch sizes (an include entry's
value, else the spec's), and the engine's limit on sequences per batch, a spec error when passed."""

from __future__ import annotations

from common.batching import Batch
from matrix.spec.parse import Spec, field_error


def batches(spec: Spec, combo: dict) -> list[Batch | None]:
    """One Batch per size the combination sweeps; [None]: batch-free (each prompt alone)."""
    axis = combo["batch"] if "batch" in combo else spec.batch
    return axis.cells() if axis is not None else [None]


def check_limit(spec: Spec, combo: dict, cell) -> None:
    """A batch larger than the engine takes on the cell's device is the spec's error (exit 2), with the limit."""
    from backends import backend_class

    cls = backend_class(cell.engine)
    limit = cls.max_batch(cell.device) if cls is not None and cell.batch is not None else None
    if limit is not None and cell.batch.size > limit[0]:
        fld = "batch"  # the spec's, or the first include entry that gave the combination this value
        if "batch" in combo:
            fld = next((f"include[{i}].batch" for i, e in enumerate(spec.include) if e.get("batch") == combo["batch"]))
        raise field_error(
            spec.path,
            fld,
            f"engine {cell.engine} takes at most {limit[0]} sequences in one batch on {cell.device} ({limit[1]})",
            cell.batch.size,
        )
