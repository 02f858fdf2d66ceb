"""The generated reference pages (docs/cli.md, docs/warehouse.md) are what the code generates now,
and the check notices a new option, column or view that was not regenerated."""

from __future__ import annotations

import json
import shutil

from matrix.cli.main import build_parser
from tests.conftest import REPO, run_process


def test_the_committed_reference_pages_are_what_the_code_generates():
    r = run_process("docs", "--check", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"stale": []}, (
        f"{r.stdout}{r.stderr[-2000:]}\nrun `matrix docs` and commit docs/"
    )


def test_a_change_in_the_code_without_regenerating_is_caught(tmp_path, monkeypatch):
    from matrix.cli import docs

    out = tmp_path / "docs"
    shutil.copytree(REPO / "docs", out)
    assert docs.cmd_docs(_args(out, check=True)) == 0
    import pyarrow as pa

    import store.schema as schema

    grown = schema.RUNS.append(pa.field("new_column", pa.string()))
    monkeypatch.setitem(schema.CORE_TABLES, "runs", grown)
    assert docs.cmd_docs(_args(out, check=True)) == 1  # a new column
    assert (
        docs.cmd_docs(_args(out, check=False)) == 0
        and "| `new_column` | string |" in (out / "warehouse.md").read_text()
    )
    assert docs.cmd_docs(_args(out, check=True)) == 0  # regenerated: current again

    def more():
        p = build_parser()
        next(a for a in p._actions if a.dest == "command").choices["stacks"].add_argument("--by-engine", help="new")
        return p

    assert docs.cmd_docs(_args(out, check=True, build=more)) == 1  # a new option
    from matrix.spec import schema as spec_schema

    grown_top = spec_schema.top
    monkeypatch.setattr(spec_schema, "top", lambda: (*grown_top(), spec_schema.Key("seed", spec_schema.POS_INT, "new")))
    assert docs.cmd_docs(_args(out, check=True)) == 1  # a new spec key
    monkeypatch.setattr(spec_schema, "top", grown_top)
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


def test_the_scoreboard_shows_each_recorded_run_newest_first(tmp_path):
    """Newest first by the time each result was recorded (its file's name, as save_result writes it):
    two runs of one day come in the order they ran, whichever commit hash sorts first."""
    import json

    from matrix.api.pages import benchmarks_page

    runs = tmp_path / "vs_llama_perplexity"
    runs.mkdir()
    recorded = (
        ("20261130T090000Z", "aaaa", 2.34, "wall <= 1.15x"),
        ("20261203T090000Z", "ffff+", 1.54, "wall <= 1.15x"),
        ("20261203T150000Z", "bbbb", 0.97, "wall <= 1.0x"),
    )
    for stamp, commit, ratio, target in recorded:
        (runs / f"{stamp}-{commit.rstrip('+')}.json").write_text(
            json.dumps(
                {
                    "benchmark": "vs_llama_perplexity",
                    "date": f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}",
                    "commit": commit,
                    "cpu": "Xeon (AMX), 2 cores",
                    "gpu": None,
                    "command": "python benchmarks/vs_llama_perplexity.py",
                    "target": target,
                    "met": ratio <= 1.0,
                    "rows": [
                        {
                            "model": "smollm2-135m",
                            "wall_ratio": ratio,
                            "forwards_alone_ratio": 0.95,
                            "kld_se_apart": 0.16,
                        }
                    ],
                }
            )
        )
    page = benchmarks_page(tmp_path)
    assert "target: wall <= 1.0x" in page  # the newest run's
    rows = [line for line in page.splitlines() if line.startswith("| 2026")]
    assert rows == [
        "| 2026-12-03 | bbbb | Xeon (AMX), 2 cores | none | smollm2-135m | 0.97 | 0.95 | 0.16 | yes | "
        "`python benchmarks/vs_llama_perplexity.py` |",
        "| 2026-12-03 | ffff+ | Xeon (AMX), 2 cores | none | smollm2-135m | 1.54 | 0.95 | 0.16 | no | "
        "`python benchmarks/vs_llama_perplexity.py` |",
        "| 2026-11-30 | aaaa | Xeon (AMX), 2 cores | none | smollm2-135m | 2.34 | 0.95 | 0.16 | no | "
        "`python benchmarks/vs_llama_perplexity.py` |",
    ]
