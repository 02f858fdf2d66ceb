"""Per-cell extras are plug-ins: a module outside the package (tests/toy_extra/), registered only by
its distribution's entry point (group logit_matrix.extras) as an outside engine is, has its key
validated, its rows captured beside the cell's, verified by `matrix verify` and analysed by `matrix
analyze`, with no other code changed. On the real 2-layer SmolLM2 cut, HF fp32 eager."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import REPO, run_cli, run_process, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

TOY = REPO / "tests" / "toy_extra"
ECHO = {"PYTHONPATH": os.pathsep.join([str(TOY), str(REPO)])}  # the distribution, as if installed


@pytest.fixture(scope="module")
def echoed(tiny_model, short_corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("echo")
    spec = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        echo="on",
    )
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json", env=ECHO)
    assert r.returncode == 0, r.stderr[-3000:]
    a = run_cli("analyze", "--warehouse", str(wh), "--json", env=ECHO)
    assert a.returncode == 0, a.stderr[-3000:]
    return spec, wh, json.loads(a.stdout)


def test_an_unregistered_key_is_refused(tiny_model, short_corpus, tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", tiny_model, short_corpus, echo="on")
    r = run_process("cells", str(spec))
    assert r.returncode == 2 and "echo: unknown key" in r.stderr, r.stderr


def test_the_entry_point_registers_it_and_a_process_without_it_fails_the_cell(monkeypatch):
    import extras
    from common.stack import StackDesc

    stack = StackDesc.of("hf", "fp32", "eager", extras=(("echo", "on"),))
    with pytest.raises(RuntimeError, match=r"extra echo is not installed on .*group logit_matrix\.extras"):
        extras.require(stack)
    monkeypatch.syspath_prepend(str(TOY))
    extras.refresh()
    try:
        assert extras.get("echo").target == "toy_extra:Echo" and extras.keys()[-1] == "echo"
        extras.require(stack)  # installed here: nothing to say
        assert "echo_agreement" in extras._views()
        # a view named as the core's is refused, naming the plug-in, never put in its place
        monkeypatch.setattr(type(extras.get("echo")), "views", lambda self: {"summary": ("SELECT 1", "x")})
        with pytest.raises(ValueError, match=r"extra echo \(toy_extra:Echo\) declares view summary, which the core"):
            extras._views()
    finally:
        monkeypatch.undo()
        extras.refresh()
    assert "echo" not in extras.keys()


def test_the_toy_extra_is_captured_in_each_cells_decode_file(echoed):
    _, wh, _ = echoed
    cells = sql(wh, "select * from cells")
    assert len(cells) == 2
    for cell in cells:
        assert json.loads(cell["settings"])["echo"] == "each prefill evaluated twice in one process"
        got = sql(
            wh,
            "select path, count(*) as n, count(distinct position) as p "
            f"from read_parquet('{wh}/logits/{cell['cell_id']}/d0.parquet') group by path order by path",
        )
        n = cell["rows_per_repeat"]  # each sampled row and its echo, at the same positions
        assert [(g["path"], g["n"]) for g in got] == [("echo", n), ("prefill", n)], got


def test_the_toy_extra_is_analysed(echoed):
    _, wh, summary = echoed
    assert summary["decode"]["cells"] == 2 and summary["decode"]["rows"] > 0
    got = sql(
        wh,
        "select cell_id, rows, kld_vs_prefill_mean, identical_share from summary_by_path "
        "where path = 'echo' order by cell_id",
    )
    cells = sql(wh, "select cell_id, rows_per_repeat from cells order by cell_id")
    assert [(g["cell_id"], g["rows"]) for g in got] == [(c["cell_id"], c["rows_per_repeat"]) for c in cells]
    # HF fp32 on one thread gives the same prefill twice: every echo row bit-identical, KL 0
    assert all(g["identical_share"] == 1.0 and g["kld_vs_prefill_mean"] == 0.0 for g in got), got
    # the view the plug-in declares, beside the core's, where the plug-in is installed
    r = run_cli(
        "sql", "select * from echo_agreement order by cell_id", "--warehouse", str(wh), "--format", "json", env=ECHO
    )
    assert r.returncode == 0, r.stderr[-2000:]
    mine = json.loads(r.stdout)
    assert [(m["cell_id"], m["rows"], m["identical_share"], m["max_abs_diff"]) for m in mine] == [
        (g["cell_id"], g["rows"], 1.0, 0.0) for g in got
    ], mine
    r = run_cli("sql", "select * from echo_agreement", "--warehouse", str(wh))
    assert r.returncode == 2 and "echo_agreement" in r.stderr, r.stderr  # not installed here: no such view


def test_the_toy_extra_is_verified(echoed, tmp_path):
    _, wh, _ = echoed
    copy = tmp_path / "wh"
    shutil.copytree(wh, copy)
    r = run_cli("verify", "--warehouse", str(copy), "--json", env=ECHO)
    assert r.returncode == 0 and json.loads(r.stdout)["shards"] == 4, r.stderr[-2000:]
    cid = sql(copy, "select cell_id from cells order by cell_id")[0]["cell_id"]
    (copy / "logits" / cid / "d0.parquet").unlink()
    r = run_cli("verify", "--warehouse", str(copy), "--json", env=ECHO)
    assert r.returncode == 1, r.stderr[-2000:]
    assert json.loads(r.stdout)["damage"][0]["what"].startswith("missing"), r.stdout


def test_a_plug_in_that_takes_a_core_table_or_column_name_is_refused(monkeypatch):
    import extras
    from common import plugins

    x = extras.get("batch")
    monkeypatch.setattr(type(x), "tables", lambda self: {"metrics": None})
    with pytest.raises(ValueError, match="extra batch .* declares table metrics, as the core does"):
        plugins.provider.tables()
    monkeypatch.setattr(type(x), "cell_columns", lambda self: [("status", None, "")])
    with pytest.raises(ValueError, match="extra batch .* declares cells column status, as the core does"):
        plugins.provider.columns()
