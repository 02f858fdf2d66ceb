"""`matrix merge` on real warehouses captured apart: a clean merge, a second that adds nothing, and
each refusal (another schema version, one cell id with other rows, one model name with other
weights), a damaged shard that leaves only its own cell out; the destination untouched by a refusal."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import SCHEMA_VERSION
from tests.conftest import run_cli, run_process, sql

pytestmark = pytest.mark.slow  # captures three warehouses with `matrix run`


def snapshot(wh: Path) -> dict[str, str]:
    """Every file of a warehouse and its sha256 (the lock file aside: taking it rewrites it)."""
    return {
        str(p.relative_to(wh)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(wh.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def rows(wh: Path) -> list[dict]:
    return sql(wh, "select cell_id, repeat, prompt_id, position, row_hash from logits order by all")


def one_cell(wh: Path) -> str:
    (c,) = sql(wh, "select cell_id from cells")
    return c["cell_id"]


def rewrite(path: Path, column: str, value) -> None:
    """Set one column of a Parquet file's first row (the file stays valid Parquet)."""
    t = pq.read_table(path)
    col = t.column(column).to_pylist()
    col[0] = value
    pq.write_table(
        t.set_column(t.schema.get_field_index(column), column, pa.array(col, t.schema.field(column).type)), path
    )


def test_merge_then_again_then_each_refusal(merge_sources, tmp_path):
    a, b, c = merge_sources
    dest = tmp_path / "merged"
    r = run_cli("merge", str(a), str(b), "--into", str(dest), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert [len(s["merged"]) for s in report["sources"]] == [1, 1]
    assert rows(dest) == sorted(
        rows(a) + rows(b), key=lambda x: (x["cell_id"], x["repeat"], x["prompt_id"], x["position"])
    )
    assert len(rows(dest)) == len(rows(a)) + len(rows(b)) > 0
    v = run_cli("verify", "--warehouse", str(dest), "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["shards"] == 4, v.stderr[-2000:]
    an = run_cli("analyze", "--warehouse", str(dest))
    assert an.returncode == 0, an.stderr[-2000:]
    summary = {s["cell_id"]: s for s in sql(dest, "select cell_id, is_reference, kld_mean from summary")}
    assert summary[one_cell(a)]["is_reference"] and summary[one_cell(b)]["kld_mean"] > 0
    before = snapshot(dest)

    again = run_cli("merge", str(a), str(b), "--into", str(dest), "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert [(len(s["merged"]), len(s["already_present"])) for s in json.loads(again.stdout)["sources"]] == [
        (0, 1),
        (0, 1),
    ]
    assert snapshot(dest) == before

    old = tmp_path / "old"
    shutil.copytree(a, old)
    marker = json.loads((old / "WAREHOUSE.json").read_text())
    (old / "WAREHOUSE.json").write_text(json.dumps({**marker, "schema_version": SCHEMA_VERSION - 1}))
    other_rows = tmp_path / "other-rows"
    shutil.copytree(a, other_rows)
    rewrite(other_rows / "logits" / one_cell(a) / "r1.parquet", "row_hash", "0" * 64)
    other_weights = tmp_path / "other-weights"
    shutil.copytree(c, other_weights)
    rewrite(other_weights / "cells" / f"{one_cell(c)}.parquet", "weights_sha256", "f" * 64)
    for src, needle in (
        (old, f"schema_version {SCHEMA_VERSION - 1}, this logit-matrix merges {SCHEMA_VERSION}"),
        (other_rows, f"cell {one_cell(a)} is in the destination with different rows"),
        (other_weights, f"weights_sha256 {'f' * 64} for model 'tiny'"),
    ):
        bad = run_cli("merge", str(src), "--into", str(dest))
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and needle in lines[0], bad.stderr[-2000:]
        assert str(src) in lines[0] and snapshot(dest) == before

    # two sources that disagree on a model's weights, into a new path: refused, and no warehouse appears
    fresh = tmp_path / "fresh"
    bad = run_process("merge", str(c), str(other_weights), "--into", str(fresh))
    assert bad.returncode == 2 and f"weights_sha256 {'f' * 64} for model 'tiny', {c} has" in bad.stderr, bad.stderr
    assert not fresh.exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(c, damaged)
    shard = damaged / "logits" / one_cell(c) / "r0.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the logits pages
    shard.write_bytes(bytes(data))
    d = run_cli("merge", str(damaged), "--into", str(dest), "--json")
    assert d.returncode == 1, d.stderr[-2000:]
    (src,) = json.loads(d.stdout)["sources"]
    assert src["merged"] == [] and src["left_out"][one_cell(c)].startswith(f"damaged: {shard}")
    assert snapshot(dest) == before  # nothing of the damaged cell arrived
    fine = run_cli("merge", str(c), "--into", str(dest), "--json")
    assert fine.returncode == 0 and json.loads(fine.stdout)["sources"][0]["merged"] == [one_cell(c)]
    assert len(sql(dest, "select * from cells")) == 3
