"""`reference_metrics: in_actor`: each stack measured against its reference in the
capturing actor, as llama-perplexity's --kl-divergence pass does, with analyze's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end


def _tables(wh: Path) -> dict[str, tuple[dict, list[dict]]]:
    out = {}
    for f in sorted((wh / "metrics").glob("*.parquet")):
        t = pq.read_table(f)
        meta = json.loads(t.schema.metadata[b"logit_matrix"]) if b"logit_matrix" in (t.schema.metadata or {}) else {}
        out[f.stem] = (meta, t.to_pylist())
    return out


def test_in_actor_metrics_equal_analyzes_and_analyze_reuses_them(tmp_path, tiny_model, short_corpus):
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "bf16"],
        attention=["eager", "sdpa"],
        exclude=[{"dtype": "bf16", "attention": "sdpa"}],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=2,
        store="bf16",
        reference_metrics="in_actor",
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["metrics_in_actor"] == 3  # the reference's repeat 1 too
    log = r.stderr.splitlines()
    ref = sql(wh, "select cell_id from cells where is_reference")[0]["cell_id"]
    done_at = next(i for i, line in enumerate(log) if line.endswith(f"{ref} done"))
    # the others' loads: bf16 eager's own, fp32 sdpa taking the reference's loaded model over (hosts: shared)
    loaded = [i for i, line in enumerate(log) if line.startswith("loaded ") and ref not in line]
    took_over = [i for i, line in enumerate(log) if f" took over the model {ref} loaded " in line]
    assert len(loaded) == len(took_over) == 1 and min(loaded + took_over) > done_at  # they waited for its shards
    inline = _tables(wh)
    assert set(inline) == {c["cell_id"] for c in sql(wh, "select cell_id from cells")}
    assert {m["computed_in"] for m, _ in inline.values()} == {"actor"}
    n = sql(wh, "select count(*) as n from metrics")[0]["n"]
    assert (
        n
        == 3 * sql(wh, "select rows_per_repeat from cells limit 1")[0]["rows_per_repeat"] * 2
        - sql(wh, "select rows_per_repeat from cells limit 1")[0]["rows_per_repeat"]
    )  # 2 stacks x 2 repeats + ref r1

    r = run_cli("analyze", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["computed"]["cells"] == 0 and s["reused"]["cells"] == 3, s  # nothing measured again
    assert sql(wh, "select count(*) as n from summary")[0]["n"] == 3

    r = run_cli("analyze", "--warehouse", str(wh), "--json", "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    again = _tables(wh)
    for cid, (meta, rows) in again.items():
        assert meta["computed_in"] == "analyze" and meta["key"] == inline[cid][0]["key"]
        assert rows == inline[cid][1], cid  # every column of every row, exactly
    kl = sql(wh, f"select cell_id, avg(kld) as k from metrics where cell_id != '{ref}' group by all")
    assert len(kl) == 2 and all(k["k"] > 0 for k in kl)


def test_reference_metrics_takes_only_its_values(tmp_path, tiny_model, short_corpus):
    spec = write_spec(tmp_path / "spec.yaml", tiny_model, short_corpus, reference_metrics="inline")
    r = run_cli("run", str(spec), "--warehouse", str(tmp_path / "wh"))
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"matrix: error: {spec}: reference_metrics: expected one of analyze, in_actor (got 'inline')"
    ), r.stderr
    assert not (tmp_path / "wh").exists()


def test_a_skipped_reference_releases_the_cells_waiting_for_it(tmp_path, tiny_model, short_corpus):
    # Q2_K: the 2-layer cut's shapes let llama.cpp store no tensor as Q2_K, so the reference is
    # skipped at load; its model's other cells must still run (measured later, by analyze)
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "llamacpp", "dtype": "q2_k", "attention": "default"},
        repeats=1,
        include=[{"engine": "llamacpp", "dtype": "q2_k", "attention": "default"}],
        reference_metrics="in_actor",
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "start once their reference is done" in r.stderr
    assert json.loads(r.stdout)["metrics_in_actor"] == 0
    cells = {(c["engine"], c["attention"]): c["status"] for c in sql(wh, "select engine, attention, status from cells")}
    assert cells == {("llamacpp", "default"): "skipped", ("hf", "eager"): "done", ("hf", "sdpa"): "done"}
    assert not (wh / "metrics").exists() or not list((wh / "metrics").glob("*.parquet"))
