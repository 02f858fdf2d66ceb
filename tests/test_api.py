"""The Python API in-process, as a notebook uses it: a sweep with the local executor, its analysis,
DuckDB over the warehouse, and a KLD job on real GGUF files, with the values each call returns
checked against the warehouse's own rows (tests/test_api_verbs.py: every verb against its call)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.errors import UserError
from matrix import api
from tests.conftest import REPO, run_cli, same_json, write_spec


@pytest.fixture(scope="module")
def sweep(tiny_model, short_corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    spec = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
    )
    lines: list[str] = []
    result = api.run(spec, str(d / "wh"), executor="local", log=lines.append)
    return spec, d / "wh", result, lines


def test_run_returns_what_it_captured(sweep):
    spec, wh, result, lines = sweep
    assert isinstance(result, api.RunResult) and result.ok, result.failed
    assert (result.cells_total, result.cells_done, result.cells_run) == (2, 2, 2)
    assert result.failed == {} and result.bad_input is None and result.run_id
    assert result.wall_s >= result.seconds > 0
    con = api.connect(str(wh))
    try:
        rows = con.execute("SELECT count(*) FROM logits WHERE repeat = 0").fetchone()[0]
        runs = con.execute("SELECT run_id FROM runs").fetchall()
    finally:
        con.close()
    assert result.rows_written == rows > 0  # one repeat: every row written is one of repeat 0
    assert [r[0] for r in runs] == [result.run_id]
    assert any(line.startswith(f"run {result.run_id}: 2/2 cells complete") for line in lines)


def test_a_second_run_has_nothing_to_do(sweep):
    spec, wh, first, _ = sweep
    again = api.run(spec, str(wh), executor="local", log=lambda line: None)
    assert (again.run_id, again.cells_run, again.rows_written, again.cells_done) == (None, 0, 0, 2)
    assert again.to_dict()["cells_total"] == 2


def test_analyze_and_connect_give_the_rows_own_kl(sweep):
    _, wh, result, _ = sweep
    out = api.analyze(str(wh), workers=1, log=lambda line: None)
    assert isinstance(out, api.AnalyzeResult)
    # the bf16 cell measured against the fp32 reference, every row of it (half of the rows written)
    assert out.cells == 1 and out.metric_rows == result.rows_written // 2
    con = api.connect(str(wh))
    try:
        got = dict(con.execute("SELECT dtype, kld_mean FROM summary").fetchall())
        # float64 KL of the bf16 cell's stored rows against the reference's, row by row
        pairs = con.execute(
            """SELECT r.logits AS ref, s.logits AS stk FROM logits r JOIN logits s USING (prompt_id, position, repeat)
               JOIN cells cr ON cr.cell_id = r.cell_id JOIN cells cs ON cs.cell_id = s.cell_id
               WHERE repeat = 0 AND cr.dtype = 'fp32' AND cs.dtype = 'bf16'"""
        ).fetchall()
    finally:
        con.close()
    kl = []
    for ref, stk in pairs:
        lp = np.asarray(ref, np.float64) - np.logaddexp.reduce(np.asarray(ref, np.float64))
        lq = np.asarray(stk, np.float64) - np.logaddexp.reduce(np.asarray(stk, np.float64))
        kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
    assert got["fp32"] == 0.0
    assert got["bf16"] == pytest.approx(float(np.mean(kl)), rel=1e-9) and got["bf16"] > 0


@pytest.fixture(scope="module")
def ggufs(tiny_model):
    from backends.gguf_build import build_for
    from common.files import weights_digest_cached

    sha = weights_digest_cached(Path(tiny_model))
    return {d: build_for(d, str(tiny_model), sha, 2)["path"] for d in ("f16", "q8_0")}


@pytest.mark.slow  # it converts and quantises the model to GGUF first
def test_kld_returns_llama_perplexity_statistics_as_values(ggufs, tmp_path):
    prose = (REPO / "configs/corpus/long_prose.txt").read_text()
    text = tmp_path / "prose.txt"
    text.write_text(prose[: len(prose) // 12])
    wh = tmp_path / "kld"
    job = api.kld(ggufs["f16"], [ggufs["q8_0"]], text, str(wh), n_ctx=64, threads=2, log=lambda line: None)
    assert isinstance(job, api.KldResult) and job.refused is None and job.incomplete == ()
    assert job.run is not None and job.run.ok and Path(job.spec).is_file()
    (r,) = job.results
    assert r.candidate == ggufs["q8_0"] and r.chunks >= 2
    con = api.connect(str(wh))
    try:
        kld, n = con.execute(
            "SELECT avg(kld), count(*) FROM metrics WHERE cell_id = ? AND repeat = 0 AND nll_stack IS NOT NULL",
            [r.cell_id],
        ).fetchone()
    finally:
        con.close()
    assert r.statistics["rows"] == n > 0
    assert r.statistics["kld"][0] == pytest.approx(kld, rel=1e-12) and kld > 0
    assert r.card["model"] and r.to_dict()["statistics"] == r.statistics
    # the verb with the same files and text resumes the job: what it prints is the same call's to_dict()
    cli = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q8_0"],
        "--text",
        str(text),
        "--warehouse",
        str(wh),
        "--n-ctx",
        "64",
        "--threads",
        "2",
        "--json",
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert same_json(json.loads(cli.stdout), json.loads(json.dumps(job.to_dict(), default=str)))
    _model_index_reads_back(wh, r, text, ggufs["f16"])


def _model_index_reads_back(wh, r, text: Path, reference: str) -> None:
    """`matrix card --format model-index` is what huggingface_hub reads from a model card's front
    matter: the candidate's statistics, the text's name and sha256, the reference file's sha256."""
    import hashlib

    from huggingface_hub import ModelCard

    import matrix

    cli = run_cli("card", r.cell_id, "--warehouse", str(wh), "--format", "model-index")
    assert cli.returncode == 0, cli.stderr[-2000:]
    results = ModelCard(f"---\n{cli.stdout}---\n").data.eval_results
    got = {e.metric_type: e for e in results}
    assert got["kl_divergence"].metric_value == pytest.approx(r.statistics["kld"][0], rel=1e-12)
    assert got["kl_divergence_stderr"].metric_value == pytest.approx(r.statistics["kld"][1], rel=1e-9)
    assert got["perplexity_ratio"].metric_value == pytest.approx(r.card["numbers"]["ppl_ratio"], rel=1e-12)
    assert got["same_top_p"].metric_value == r.card["numbers"]["top1_agreement"]
    sha = {f: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in (text, reference)}
    for e in results:
        assert (e.task_type, e.dataset_name, e.dataset_revision) == ("text-generation", text.name, sha[text])
        assert e.metric_args == {
            "reference_sha256": sha[reference],
            "n_ctx": 64,
            "tool": f"logit-matrix {matrix.__version__}",
        }
    assert (
        len(results) == 7 and results[0].dataset_revision != r.card["disclosure"]["evaluation_text"]["token_ids_sha256"]
    )


def test_bad_input_raises_one_line(tmp_path, tiny_model):
    with pytest.raises(UserError, match="no such file"):
        api.kld(str(tiny_model), [str(tiny_model)], tmp_path / "missing.txt", str(tmp_path / "wh"), log=lambda m: None)
    with pytest.raises(UserError, match="executor 'gpu'"):
        api.run(REPO / "configs/smoke.yaml", str(tmp_path / "wh2"), executor="gpu", log=lambda m: None)
    assert not (tmp_path / "wh2").exists()
