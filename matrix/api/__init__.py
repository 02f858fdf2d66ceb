"""The Python API under the `matrix` command: each verb of the CLI parses its arguments, calls one of
these, and prints what it returns.

    from matrix import api

    result = api.run("configs/smoke.yaml", "warehouse", executor="local")   # -> RunResult
    api.analyze("warehouse")                                                 # -> AnalyzeResult
    con = api.connect("warehouse")                                           # DuckDB with the views
    con.sql("SELECT cell_id, kld_mean, top1_agreement FROM summary").df()
    api.sql("warehouse", "SELECT count(*) AS n FROM cells").to_dict()       # -> QueryResult
    job = api.kld("ref.gguf", ["q4_k_m.gguf"], "wiki.test.raw", "kld-wh")    # -> KldResult
    api.attribute("ref.gguf", "q4_k_m", "wiki.test.raw", "attr-wh")         # -> AttributeResult
    api.stacks("warehouse"), api.status("warehouse")                         # -> StacksResult, StatusResult
    api.verify("warehouse"), api.card("warehouse", "llamacpp/q4_k_m")        # -> VerifyResult, CardResult
    api.admit("warehouse", "llamacpp/q4_k_m").ok                              # -> AdmitResult

Every verb of the command has its call here (docs/python-api.md lists them); what a verb prints with
--json is its call's to_dict().

Bad input raises common.errors.UserError with one line naming the file, field and value; a cell's
failure is the cell's own and is reported in the result. Progress goes to `log` (default: stderr).
docs/python-api.md has a notebook example.
"""

from matrix.api.analysis import ViewsScript, analyze, connect, export_views, sql
from matrix.api.attribute import attribute
from matrix.api.catalog import (
    CacheResult,
    CatalogResult,
    CutResult,
    PruneResult,
    cache,
    cut_model,
    fetch_model,
    models,
    prune_cache,
)
from matrix.api.cells import CellsResult, cells
from matrix.api.exchange import (
    FileResult,
    MergeResult,
    MergeSource,
    fixture_export,
    kld_base_export,
    kld_base_import,
    merge,
)
from matrix.api.gates import AdmitResult, FixtureCheckResult, LayersResult, admit, fixture_check, layers
from matrix.api.kld import kld
from matrix.api.pages import DocsResult, SpecResult, docs, spec
from matrix.api.results import AnalyzeResult, AttributeResult, CandidateResult, KldResult, QueryResult, RunResult
from matrix.api.sweep import run
from matrix.api.warehouse import (
    CardResult,
    ReportResult,
    StacksResult,
    StatusResult,
    VerifyResult,
    card,
    report,
    stacks,
    status,
    verify,
)

__all__ = [
    # each verb of the command: its function and the frozen result whose to_dict() it prints with --json
    "run", "RunResult",  # matrix run
    "cells", "CellsResult",  # matrix cells
    "analyze", "AnalyzeResult",  # matrix analyze
    "sql", "QueryResult", "connect", "export_views", "ViewsScript",  # matrix sql
    "report", "ReportResult",  # matrix report
    "verify", "VerifyResult",  # matrix verify
    "merge", "MergeResult", "MergeSource",  # matrix merge
    "status", "StatusResult",  # matrix status
    "stacks", "StacksResult",  # matrix stacks
    "card", "CardResult",  # matrix card
    "admit", "AdmitResult",  # matrix admit
    "layers", "LayersResult",  # matrix layers
    "fixture_export", "fixture_check", "FixtureCheckResult",  # matrix fixture export|check
    "kld_base_export", "kld_base_import", "FileResult",  # matrix kld-base export|import (and fixture export)
    "kld", "KldResult", "CandidateResult",  # matrix kld
    "attribute", "AttributeResult",  # matrix attribute
    "models", "CatalogResult", "fetch_model", "cut_model", "CutResult",  # matrix models list|fetch|cut
    "cache", "CacheResult", "prune_cache", "PruneResult",  # matrix cache list|prune
    "spec", "SpecResult",  # matrix spec
    "docs", "DocsResult",  # matrix docs
]  # fmt: skip
