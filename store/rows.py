"""The rows of the small tables, built here for every writer (the run loop and the KLD-base
import alike), so each column is named in one place besides the schema.

A builder refuses a key its table does not have: pyarrow would drop it without a word.
"""

from __future__ import annotations

import datetime as dt
import socket
from typing import Any

from store.schema import TABLES


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _checked(table: str, row: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(row) - set(TABLES[table].names))
    if unknown:
        raise KeyError(f"table {table} has no column {unknown[0]!r}")
    return row


def model_fields(model) -> dict[str, Any]:
    """Where a cell's reference weights came from (model: matrix.spec.models.ResolvedModel)."""
    return {
        "model_identity": model.identity,
        "model_source": model.source,
        "source_sha256": model.source_sha256,
        "weights_sha256": model.weights_sha256,
        "model_license": getattr(model, "license", None),
    }


def run_row(run_id: str, status: str, **fields: Any) -> dict[str, Any]:
    """A `runs` row: a sweep's or an import's. Unset columns are null."""
    return _checked("runs", {"run_id": run_id, "status": status, "host": socket.gethostname(), **fields})


def run_finished(run: dict[str, Any], status: str, **fields: Any) -> dict[str, Any]:
    return _checked("runs", {**run, "status": status, "finished_at": now(), **fields})


def cell_row(cell_id: str, run_id: str, status: str, **fields: Any) -> dict[str, Any]:
    """A `cells` row: done (captured or imported) or skipped (with skip_reason). host: the node
    that ran the cell; this machine's when not given."""
    return _checked(
        "cells",
        {
            "cell_id": cell_id,
            "run_id": run_id,
            "status": status,
            "host": socket.gethostname(),
            **fields,
            "finished_at": now(),
        },
    )


def prompt_row(**fields: Any) -> dict[str, Any]:
    return _checked("prompts", fields)


def parity_rows(cell_id: str, run_id: str, engine: str, rows: list[dict]) -> list[dict[str, Any]]:
    return [_checked("tokenizer_parity", {**r, "cell_id": cell_id, "run_id": run_id, "engine": engine}) for r in rows]
