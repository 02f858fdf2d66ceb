"""What a warehouse holds, as the verbs `stacks`, `status`, `verify`, `card` and `report` give it:
each returns a frozen record whose `to_dict()` is what the verb prints with `--json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import extras
from common.output import log as stderr_log


@dataclass(frozen=True)
class StacksResult:
    """Each stack's readable name (what card, admit, fixture and layers take), status, cell count
    and latest cell (analysis/stack_names.py listing)."""

    stacks: tuple[dict, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"stacks": list(self.stacks)}


@dataclass(frozen=True)
class StatusResult:
    """Every cells row's state (why: its error or skip reason) and every run's."""

    cells: tuple[dict, ...]
    runs: tuple[dict, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"cells": list(self.cells), "runs": list(self.runs)}


@dataclass(frozen=True)
class VerifyResult:
    """Every shard and table file read back against its checksums and row hashes (store/verify.py)."""

    report: dict

    @property
    def ok(self) -> bool:
        return not self.report["damage"]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.report)


@dataclass(frozen=True)
class CardResult:
    """A cell's model-card KLD block (analysis/card.py): its numbers, ranges and disclosure."""

    card: dict

    def markdown(self) -> str:
        from analysis.card import markdown

        return markdown(self.card, extras.registered())

    def model_index(self) -> dict[str, Any]:
        """The card's figures as a Hugging Face model card's `model-index` (analysis/model_index.py)."""
        from analysis.model_index import model_index
        from matrix import __version__

        return model_index(self.card, f"logit-matrix {__version__}")

    def model_index_yaml(self) -> str:
        """model_index() as the YAML of a model card's front matter (paste it between its `---` lines)."""
        import yaml

        return yaml.safe_dump(self.model_index(), sort_keys=False, allow_unicode=True)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.card)


@dataclass(frozen=True)
class ReportResult:
    """The HTML report written (html: its file) and the figures it shows (analysis/report.py gather)."""

    html: str
    data: dict

    def terminal(self) -> str:
        """The report's tables for a terminal."""
        from analysis.report import terminal_table

        return terminal_table(self.data)

    def to_dict(self) -> dict[str, Any]:
        return {"html": self.html, **self.data}


STATUS_CELLS = ("cell_id", "status", "repeats", "rows_per_repeat", "bit_reproducible", "is_reference", "why")
STATUS_RUNS = ("run_id", "status", "started_at", "cells_done", "cells_total", "rows_written")


def stacks(warehouse: str) -> StacksResult:
    from analysis.stack_names import listing
    from store import Warehouse

    return StacksResult(tuple(listing(Warehouse(warehouse).require().read_all("cells"))))


def status(warehouse: str) -> StatusResult:
    from analysis.sql import query

    _, cells = query(
        warehouse,
        """
        select c.cell_id, c.status, c.repeats, c.rows_per_repeat, c.bit_reproducible, c.is_reference,
               coalesce(c.error_class || ': ' || c.error, c.skip_reason) as why
        from cells c order by c.cell_id""",
    )
    _, runs = query(
        warehouse,
        "select run_id, status, started_at, cells_done, cells_total, rows_written from runs order by started_at",
    )
    return StatusResult(
        tuple(dict(zip(STATUS_CELLS, r)) for r in cells), tuple(dict(zip(STATUS_RUNS, r)) for r in runs)
    )


def verify(warehouse: str, cells: list[str] | None = None, log: Callable[[str], None] | None = None) -> VerifyResult:
    """cells: only these cell ids (None: every one)."""
    from store import Warehouse
    from store.verify import verify as read_back

    wh = Warehouse(warehouse).require()
    return VerifyResult(read_back(wh, cells, log=log or stderr_log, side_tables=extras.side_tables))


def card(warehouse: str, cell: str, allow_undisclosed: bool = False) -> CardResult:
    """cell: a cell id, or any part of a stack's readable name (analysis/stack_names.py resolve)."""
    import backends
    from analysis.card import build_card
    from analysis.stack_names import resolve
    from store import Warehouse

    cell_id = resolve(Warehouse(warehouse).require().read_all("cells"), cell, f"card: warehouse {warehouse}")
    built = build_card(
        warehouse, cell_id, allow_undisclosed=allow_undisclosed, extras=extras.registered(), as_is=backends.as_is()
    )
    return CardResult(built)


def report(warehouse: str, out: str | None = None) -> ReportResult:
    """A self-contained HTML report of an analysed warehouse, in out (default: WAREHOUSE/report, or
    ./report for an object-store warehouse)."""
    from pathlib import Path

    from analysis.report import gather, write_html
    from common.errors import UserError
    from store import Warehouse

    wh = Warehouse(warehouse).require()
    if not wh.table_files("metrics"):
        raise UserError(f"{wh.where}: no metrics yet; run `matrix analyze --warehouse {wh.where}` first")
    data = gather(warehouse)
    where = Path(out) if out else Path("report") if wh.remote else Path(wh.where) / "report"
    sections = [x.report(data) for x in extras.registered()]
    return ReportResult(str(write_html(data, where, warehouse, sections, extras.model_reports)), data)
