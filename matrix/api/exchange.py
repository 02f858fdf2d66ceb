"""Rows moving between a warehouse and the outside: warehouses merged into one, fixtures exported,
llama.cpp's --kl-divergence-base files exported and imported. Each returns a frozen record whose
`to_dict()` is what the verb prints with `--json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import extras
from common.output import log as stderr_log
from matrix.api.gates import resolve_cell


@dataclass(frozen=True)
class MergeSource:
    """One source warehouse of a merge: the cells copied, those the destination had, those left out."""

    source: str
    merged: tuple[str, ...]
    already_present: tuple[str, ...]
    left_out: dict  # cell id -> why (a damaged shard's says "damaged ...")
    files: int


@dataclass(frozen=True)
class MergeResult:
    into: str
    sources: tuple[MergeSource, ...]

    @property
    def damaged(self) -> dict[str, str]:
        """Cells left out because a shard failed its checks (the verb exits 1 on them)."""
        return {cid: why for s in self.sources for cid, why in s.left_out.items() if why.startswith("damaged")}

    @property
    def ok(self) -> bool:
        return not self.damaged

    def to_dict(self) -> dict[str, Any]:
        return {"into": self.into, "sources": [_listed(dataclasses.asdict(s)) for s in self.sources]}


def _listed(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


@dataclass(frozen=True)
class FileResult:
    """A file written or read (a fixture, a kld-base file): what the writer or reader reports of it."""

    report: dict

    def to_dict(self) -> dict[str, Any]:
        return dict(self.report)


def merge(sources: list[str], into: str, log: Callable[[str], None] | None = None) -> MergeResult:
    """Bring warehouses captured elsewhere into `into` (made when missing), every incoming row checked
    first; nothing is written there until every check passed."""
    from store.merge import merge as merged

    report = merged(sources, into, extras.side_tables, log or stderr_log)
    return MergeResult(
        report["into"],
        tuple(
            MergeSource(s["source"], tuple(s["merged"]), tuple(s["already_present"]), dict(s["left_out"]), s["files"])
            for s in report["sources"]
        ),
    )


def fixture_export(
    warehouse: str, cell: str, out: str, k: int = 64, log: Callable[[str], None] | None = None
) -> FileResult:
    """A standalone fixture of a cell: top-k ids and logits per row (out: FILE.json or FILE.parquet)."""
    from analysis.fixture_export import export_fixture

    cell_id = resolve_cell(warehouse, cell, "fixture export")
    return FileResult(export_fixture(warehouse, cell_id, out, k=k, log=log or stderr_log))


def kld_base_export(
    warehouse: str, cell: str, n_ctx: int, out: str, log: Callable[[str], None] | None = None
) -> FileResult:
    """A cell's rows as llama-perplexity's --kl-divergence-base file of chunks of n_ctx tokens."""
    from store.llamacpp_import import export_kld_base

    cell_id = resolve_cell(warehouse, cell, "kld-base export")
    return FileResult(export_kld_base(warehouse, cell_id, n_ctx, out, log=log or stderr_log))


def kld_base_import(warehouse: str, file: str, model: str, log: Callable[[str], None] | None = None) -> FileResult:
    """A --kl-divergence-base file as a cell of `model` (the file carries no hash of its model)."""
    from store.llamacpp_import import import_kld_base

    return FileResult(import_kld_base(warehouse, file, model, log=log or stderr_log))
