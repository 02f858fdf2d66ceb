"""The generated reference pages (docs/cli.md, docs/warehouse.md) are what the code generates now,
and the check notices a new option, column or view that was not regenerated."""

from __future__ import annotations

import json
import shutil

from matrix.cli.main import build_parser
from tests.conftest import REPO, run_cli


def test_the_committed_reference_pages_are_what_the_code_generates():
    r = run_cli("docs", "--check", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"stale": []}, \
        f"{r.stdout}{r.stderr[-2000:]}\nrun `matrix docs` and commit docs/"


def test_a_change_in_the_code_without_regenerating_is_caught(tmp_path, monkeypatch):
    from matrix.cli import docs

    out = tmp_path / "docs"
    shutil.copytree(REPO / "docs", out)
    assert docs.cmd_docs(_args(out, check=True)) == 0
    import store.schema as schema
    import pyarrow as pa

    grown = schema.RUNS.append(pa.field("new_column", pa.string()))
    monkeypatch.setitem(schema.TABLES, "runs", grown)
    assert docs.cmd_docs(_args(out, check=True)) == 1  # a new column
    assert docs.cmd_docs(_args(out, check=False)) == 0 and "| `new_column` | string |" in (out / "warehouse.md").read_text()
    assert docs.cmd_docs(_args(out, check=True)) == 0  # regenerated: current again

    def more():
        p = build_parser()
        next(a for a in p._actions if a.dest == "command").choices["stacks"].add_argument("--by-engine", help="new")
        return p

    assert docs.cmd_docs(_args(out, check=True, build=more)) == 1  # a new option
    (out / "cli.md").unlink()
    assert docs.cmd_docs(_args(out, check=True)) == 1  # a page missing


def test_every_table_column_and_view_is_in_the_warehouse_page():
    from analysis.sql import VIEWS, view_columns
    from store.schema import TABLES

    page = (REPO / "docs" / "warehouse.md").read_text()
    for table, schema in TABLES.items():
        section = page.split(f"### `{table}`\n", 1)[1].split("\n### ", 1)[0]
        assert all(f"| `{f.name}` |" in section for f in schema), table
    cols = view_columns()
    for view in VIEWS:
        section = page.split(f"### `{view}`\n", 1)[1].split("\n### ", 1)[0]
        assert all(f"| `{c}` |" in section for c, _ in cols[view]), view
    assert [c for c, _ in cols["summary_by_range"]][:4] == ["cell_id", "range", "lo", "category"]


def _args(out, check: bool, build=None):
    import argparse

    return argparse.Namespace(out=str(out), check=check, json=False, build_parser=build or build_parser)
