"""A cells-table row as analysis reads it: the columns every cell has, typed and named, and the
others (settings, options, the plug-ins' columns such as `layers` or `batch_of`) by name through
`get`, as the row holds them. Frozen: analysis passes the same rows to every part of a pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class CellRow:
    cell_id: str
    stack_id: str  # a cell captured before stacks had ids: its cell id
    model: str
    engine: str
    dtype: str
    attention: str
    status: str
    repeats: int
    is_reference: bool
    reference_cell_id: str | None
    replica: int  # 0: the stack itself; i: the spec's i-th copy of it on another node
    build: str | None
    centroid_group: str | None
    # every column of the row (a dict of its own, never written); a row is hashed and compared by its named fields
    columns: Mapping[str, Any] = field(hash=False, compare=False)

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> CellRow:
        return cls(
            cell_id=row["cell_id"],
            stack_id=row.get("stack_id") or row["cell_id"],
            model=row["model"],
            engine=row["engine"],
            dtype=row["dtype"],
            attention=row["attention"],
            status=row["status"],
            repeats=row.get("repeats") or 0,
            is_reference=bool(row.get("is_reference")),
            reference_cell_id=row.get("reference_cell_id"),
            replica=row.get("replica") or 0,
            build=row.get("build"),
            centroid_group=row.get("centroid_group"),
            columns=dict(row),
        )

    def get(self, column: str, default: Any = None) -> Any:
        """Any column by name (None where the row's file predates it)."""
        value = self.columns.get(column)
        return default if value is None else value
