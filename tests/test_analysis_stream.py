"""Streaming, incremental analysis against a whole-in-memory oracle (tests/oracle_analyze.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis import analyze as A
from analysis import units
from store import Warehouse
from tests import oracle_analyze
from tests.conftest import REPO, run_cli, sql

pytestmark = pytest.mark.slow  # the session's `swept` sweep runs on a Ray cluster

TABLES = ("metrics", "centroid_metrics", "pairwise")


class _OracleWarehouse(Warehouse):
    """The oracle predates kernel_version: its files get a null one."""

    def write_table(self, table, name, data, meta=None):
        if "kernel_version" not in data.column_names and table in TABLES:
            data = data.append_column("kernel_version", pa.nulls(len(data), pa.string()))
        return super().write_table(table, name, data, meta)


def _copy(src: Path, dst: Path) -> None:
    """The swept warehouse without the analysis outputs other tests left in it."""
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if Path(d) == src and n in TABLES])


def _rows(wh: Path, table: str) -> dict[tuple, dict]:
    keys = {
        "metrics": ("cell_id", "repeat", "prompt_id", "position"),
        "centroid_metrics": ("centroid_group", "cell_id", "prompt_id", "position"),
        "pairwise": ("cell_a", "cell_b"),
    }[table]
    out = {}
    for f in sorted((wh / table).glob("*.parquet")):
        for r in pq.read_table(f).to_pylist():
            r.pop("kernel_version", None)
            if table == "metrics" and r["cell_id"] == r["reference_cell_id"] and r["repeat"] == 0:
                continue  # the oracle measures the reference against itself; analyze does not
            out[tuple(r[k] for k in keys)] = r
    return out


def _same(a, b) -> bool:
    """Floats to 1e-12 relative, or 1e-14 absolute: a KL or JS is exact to ~1e-15 absolute
    (docs/analysis.md), and the oracle sums stored bf16 rows widened, in another order."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= max(1e-12 * max(abs(a), abs(b)), 1e-14)
    return a == b


def test_streaming_analysis_equals_the_oracle_then_redoes_only_what_changed(swept, tmp_path, monkeypatch):
    _, src, _, _ = swept
    old, new = tmp_path / "old", tmp_path / "new"
    _copy(src, old)
    _copy(src, new)
    monkeypatch.setattr(oracle_analyze, "Warehouse", _OracleWarehouse)
    oracle_analyze.analyze(str(old), log=lambda m: None)
    monkeypatch.setattr(units, "PIECE_ROWS", 1)  # every prompt its own piece: the merge is what is tested
    logs = []
    first = A.analyze(str(new), log=logs.append, side=())
    for table in TABLES:
        want, got = _rows(old, table), _rows(new, table)
        assert want.keys() == got.keys() and want, table
        for k, row in want.items():
            bad = [c for c in row if not _same(row[c], got[k][c])]
            assert not bad, (table, k, {c: (row[c], got[k][c]) for c in bad})
    assert {r["kernel_version"] for r in sql(new, "select distinct kernel_version from metrics")} == {
        A.M.KERNEL_VERSION
    }
    pieces = int(next(m for m in logs if "piece(s)" in m).split(" in ")[1].split()[0])
    assert pieces > 5, logs  # 4 cells and a group, cut by prompt
    cells = first["computed"]["cells"]
    assert cells == 4 and first["computed"]["groups"] == 1 and first["reused"] == {"cells": 0, "groups": 0}

    # nothing changed: no unit is computed, and the files are not rewritten
    stamps = {p: p.stat().st_mtime_ns for t in TABLES for p in (new / t).glob("*.parquet")}
    again = A.analyze(str(new), log=lambda m: None, side=())
    assert again["computed"] == {"cells": 0, "groups": 0} and again["reused"] == {"cells": 4, "groups": 1}
    assert again["metric_rows"] == first["metric_rows"]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # one cell's shard changes (as a recapture would change it): that cell and its group, nothing else
    cell = sql(new, "select cell_id from cells where dtype = 'bf16' and attention = 'sdpa'")[0]["cell_id"]
    shard = new / "logits" / cell / "r1.parquet"
    t = pq.read_table(shard)
    pq.write_table(t.slice(0, t.num_rows - 1), shard)  # one row fewer: another content
    third = A.analyze(str(new), log=lambda m: None, side=())
    assert third["computed"] == {"cells": 1, "groups": 0}  # r1 is not in the centroid (repeat 0 is)
    r0 = new / "logits" / cell / "r0.parquet"
    t = pq.read_table(r0)
    pq.write_table(t.slice(0, t.num_rows - 1), r0)
    logs = []
    fourth = A.analyze(str(new), log=logs.append, side=())
    assert fourth["computed"] == {"cells": 1, "groups": 1}
    assert any("6 pair(s) (3 kept: neither shard changed)" in m for m in logs), logs  # 3 pairs have the cell
    pairs = _rows(new, "pairwise")
    forced = A.analyze(str(new), log=lambda m: None, force=True, side=())
    assert forced["computed"] == {"cells": 4, "groups": 1}
    assert _rows(new, "pairwise") == pairs  # the kept pairs are what a full recompute gives


def test_two_ray_workers_give_the_same_files(swept, tmp_path):
    _, src, _, _ = swept
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(src, one)
    shutil.copytree(src, two)
    for wh, extra in ((one, []), (two, ["--workers", "2"])):
        r = run_cli("analyze", "--warehouse", str(wh), "--json", "--force", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
    assert "analyze on Ray: 5 piece(s), 2 at a time" in r.stderr
    for table in TABLES:
        assert _rows(one, table) == _rows(two, table)


def test_a_killed_analyze_leaves_no_partial_file_and_the_next_one_finishes_the_rest(swept, tmp_path):
    _, src, _, _ = swept
    wh = tmp_path / "wh"
    shutil.copytree(src, wh)
    for t in TABLES:
        shutil.rmtree(wh / t, ignore_errors=True)
        (wh / t).mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGIT_MATRIX_COMPILE": "0"}
    # one piece at a time in the process (the cells, then the centroid group): as Ray tasks on the
    # cluster the sweep ran on, the group could finish before the kill
    p = subprocess.Popen(
        [sys.executable, "-m", "matrix", "analyze", "--warehouse", str(wh), "--workers", "1"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600
    while not list((wh / "metrics").glob("*.parquet")):  # the first unit has finished
        assert p.poll() is None and time.time() < deadline, p.stderr.read()[-2000:] if p.poll() is not None else "slow"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    written = sorted(x.name for x in (wh / "metrics").iterdir())
    assert written and all(n.endswith(".parquet") and not n.startswith(".") for n in written), written
    for f in (wh / "metrics").glob("*.parquet"):
        pq.read_table(f)  # every visible file is whole
    r = run_cli("analyze", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["reused"]["cells"] == len(written) and out["computed"]["cells"] == 4 - len(written)
    assert out["computed"]["groups"] == 1
    assert sql(wh, "select count(*) as n from metrics")[0]["n"] == out["metric_rows"]


def test_bad_input_is_one_line(swept, tmp_path):
    _, src, _, _ = swept
    wh = tmp_path / "wh"
    shutil.copytree(src, wh)
    A.analyze(str(wh), log=lambda m: None, side=())  # then the shard changes under its stored metrics
    cell = sql(wh, "select cell_id from cells where dtype = 'fp32' and attention = 'eager'")[0]["cell_id"]
    shard = wh / "logits" / cell / "r0.parquet"
    t = pq.read_table(shard)
    rows = [r[:-1] for r in t["logits"].to_pylist()]  # one logit fewer: another vocabulary
    pq.write_table(
        t.set_column(t.schema.get_field_index("logits"), "logits", pa.array(rows, t.schema.field("logits").type)), shard
    )
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    # in this process the cell's own check speaks first ("vocabulary"); as Ray tasks on the cluster the
    # sweep ran on (analyze's default), whichever piece fails first: possibly its centroid group's
    # ("its stacks have vocabularies [...]")
    assert last.startswith("matrix: error: ") and "vocabular" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_analyze_follows_the_last_runs_cluster_only_while_it_is_there(swept, tmp_path):
    """A run on a cluster makes analyze run there by default; a cluster that is gone leaves it here.
    (as_given: the verb's own default, which run_cli otherwise replaces with --workers 1)"""
    from store import rows as R

    _, src, _, _ = swept
    wh = tmp_path / "wh"
    shutil.copytree(src, wh)
    r = run_cli("analyze", "--warehouse", str(wh), "--force", as_given=True)  # `swept` ran on this worker's cluster
    assert r.returncode == 0, r.stderr[-2000:]
    assert "analyze on Ray: 5 piece(s), " in r.stderr and "(a local warehouse: on this node only)" in r.stderr, r.stderr
    Warehouse(wh).write_rows(
        "runs", "zz-cluster-run", [R.run_row("zz-cluster-run", "done", started_at=R.now(), ray_address="127.0.0.1:9")]
    )
    r = run_cli("analyze", "--warehouse", str(wh), "--force", as_given=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the last run's cluster is not reachable (--address 127.0.0.1:9: cannot reach" in r.stderr, r.stderr[-2000:]
    assert "analyze on Ray" not in r.stderr


def test_the_views_open_in_any_duckdb_client_and_a_damaged_file_is_left_out(swept, tmp_path):
    """`matrix sql --export-views` gives a plain DuckDB (no Python functions, no logit-matrix) the
    same views; analysis.sql.connect() is the notebook's entry point with the row functions too."""
    import duckdb

    from analysis.sql import connect

    _, src, _, _ = swept
    wh = tmp_path / "wh"
    shutil.copytree(src, wh)
    A.analyze(str(wh), log=lambda m: None, side=())
    q = "select cell_id, rows, kld_mean, top1_agreement from summary order by cell_id"
    want = connect(str(wh)).execute(q).fetchall()
    assert len(want) == 4
    views = tmp_path / "views.sql"
    r = run_cli("sql", "--warehouse", str(wh), "--export-views", str(views))
    assert r.returncode == 0 and "duckdb -init" in r.stderr, r.stderr[-2000:]
    con = duckdb.connect()
    con.execute(views.read_text())
    assert con.execute(q).fetchall() == want
    n = con.execute("select count(*) from logits").fetchone()[0]
    assert n == sql(wh, "select count(*) as n from logits")[0]["n"] > 0
    # a truncated runs file: named, left out of its view, every other view still answers
    run_file = next((wh / "runs").glob("*.parquet"))
    run_file.write_bytes(run_file.read_bytes()[:100])
    r = run_cli("sql", "--warehouse", str(wh), "--export-views", str(views))
    assert r.returncode == 0 and f"{run_file}: damaged" in r.stderr, r.stderr[-2000:]
    con = duckdb.connect()
    con.execute(views.read_text())
    assert con.execute(q).fetchall() == want and con.execute("select count(*) from runs").fetchone()[0] == 0
    assert f"-- runs: left out (damaged): {run_file}" in views.read_text()


def test_progress_line_and_heartbeat_while_nothing_finishes():
    p = A.Progress(total=1000)
    p.t0 -= 10  # ten seconds in
    p.done = 250
    assert p.line() == "250/1000 rows | 25 rows/s | ETA 30s"
    logs = []
    with A._heartbeat(p, lambda: "1/4 unit(s)", logs.append, every=0.2):
        time.sleep(0.5)
    assert logs and logs[0].startswith("heartbeat: 1/4 unit(s) done, nothing finished for 0s | 250/1000 rows"), logs
