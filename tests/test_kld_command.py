"""`matrix kld`: llama-perplexity's --kl-divergence job on real GGUF files of the test model (F16
reference; Q8_0 and Q4_K_M candidates), its statistics checked against a float64 computation of
this test's own from the stored rows, then a third candidate that alone is captured."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, run_cli, run_process, sql
from tests.float64_rows import log_softmax, stored

pytestmark = pytest.mark.slow  # builds GGUF files and runs llama.cpp tools over them

N_CTX = 64


@pytest.fixture(scope="module")
def ggufs(tiny_model):
    from backends.gguf_build import build_for
    from common.files import weights_digest_cached

    sha = weights_digest_cached(Path(tiny_model))
    return {d: build_for(d, str(tiny_model), sha, 2)["path"] for d in ("f16", "q8_0", "q4_k_m", "q4_0")}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """About a sixth of configs/corpus/long_prose.txt: a dozen chunks of N_CTX tokens."""
    prose = (REPO / "configs/corpus/long_prose.txt").read_text()
    f = tmp_path_factory.mktemp("text") / "prose.txt"
    f.write_text(prose[: len(prose) // 6])
    return str(f)


@pytest.fixture(scope="module")
def job(ggufs, text, tmp_path_factory):
    wh = tmp_path_factory.mktemp("kld") / "wh"
    r = run_process(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q8_0"],
        "--candidate",
        ggufs["q4_k_m"],
        "--text",
        text,
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(wh),
        "--json",
        "--keep-rows",
    )  # every stack's values: the statistics are checked against them below
    assert r.returncode == 0, r.stderr[-3000:]
    return wh, json.loads(r.stdout), r.stderr


def _own(wh: Path, ref_cell: str, cell: str) -> dict:
    """llama-perplexity's closing statistics, computed here from both cells' stored rows."""
    ref, stk = stored(wh, ref_cell), stored(wh, cell)  # (chunk, position) -> (float64 row, next id)
    kl, dp, nll, nll_ref, same = [], [], [], [], []
    for key in sorted(stk):
        (x, t), (y, _) = ref[key], stk[key]
        lp, lq = log_softmax(x), log_softmax(y)
        kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
        dp.append(math.exp(lq[t]) - math.exp(lp[t]))
        nll.append(-lq[t])
        nll_ref.append(-lp[t])
        same.append(int(np.argmax(x) == np.argmax(y)))
    kl, dp, nll, nll_ref = map(np.array, (kl, dp, nll, nll_ref))
    n = len(kl)

    def se(x):
        return float(np.std(x) / math.sqrt(n - 1))  # E[x^2] - E[x]^2 over n - 1, as perplexity.cpp

    cov = float(np.cov(nll, nll_ref, bias=True)[0, 1]) / (n - 1)
    return {
        "rows": n,
        "kld": (kl.mean(), se(kl)),
        "kld_p99": np.percentile(kl, 99),
        "kld_max": kl.max(),
        "kld_median": np.median(kl),
        "delta_p": (dp.mean(), se(dp)),
        "delta_p_p5": np.percentile(dp, 5),
        "rms": math.sqrt(np.mean(dp**2)),
        "same": float(np.mean(same)),
        "ppl": math.exp(nll.mean()),
        "ppl_ref": math.exp(nll_ref.mean()),
        "ratio": math.exp(nll.mean() - nll_ref.mean()),
        "cor": cov / (se(nll) * se(nll_ref)),
    }


def test_statistics_match_a_float64_computation_from_the_stored_rows(job, ggufs):
    wh, out, _ = job
    results = {Path(r["candidate"]).name: r for r in out["results"]}
    assert set(results) == {Path(ggufs["q8_0"]).name, Path(ggufs["q4_k_m"]).name}
    ref_cell = next(c["cell_id"] for c in sql(wh, "select cell_id from cells where is_reference"))
    kls = {}
    for name, r in results.items():
        s, own = r["statistics"], _own(wh, ref_cell, r["cell_id"])
        # chunks of 64 from long_prose.txt; the scored half is positions 32..62 of each
        assert s["rows"] == own["rows"] == r["chunks"] * (N_CTX // 2 - 1) and r["chunks"] >= 5
        assert s["kld"][0] == pytest.approx(own["kld"][0], rel=1e-9)
        assert s["kld"][1] == pytest.approx(own["kld"][1], rel=1e-6)
        assert s["kld_percentiles"]["99.0%"] == pytest.approx(own["kld_p99"], rel=1e-9)
        assert (s["kld_max"], s["kld_median"]) == pytest.approx((own["kld_max"], own["kld_median"]), rel=1e-9)
        assert s["delta_p"][0] == pytest.approx(own["delta_p"][0], rel=1e-7, abs=1e-12)
        assert s["delta_p_percentiles"]["5.0%"] == pytest.approx(own["delta_p_p5"], rel=1e-7, abs=1e-12)
        assert s["rms_delta_p"][0] == pytest.approx(own["rms"], rel=1e-9)
        assert s["same_top_p"][0] == pytest.approx(own["same"], abs=2 / own["rows"])  # bf16 rows can tie at the top
        assert s["ppl"][0] == pytest.approx(own["ppl"], rel=1e-9)
        assert s["ppl_ref"][0] == pytest.approx(own["ppl_ref"], rel=1e-9)
        assert s["ppl_ratio"][0] == pytest.approx(own["ratio"], rel=1e-9)
        assert s["ln_ppl_correlation"] == pytest.approx(own["cor"], rel=1e-6)
        assert r["card"]["numbers"]["kld_mean"] == pytest.approx(s["kld"][0], rel=1e-12)
        kls[name] = s["kld"][0]
    # Q4_K_M is further from F16 than Q8_0 is
    assert 0 < kls[Path(ggufs["q8_0"]).name] < kls[Path(ggufs["q4_k_m"]).name]


def test_card_and_admit_take_a_stack_by_its_readable_name(job):
    wh, out, _ = job
    r = run_process("stacks", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    stacks = {s["name"]: s for s in json.loads(r.stdout)["stacks"]}
    cells = {res["candidate"].rsplit("-", 1)[-1].split(".")[0]: res["cell_id"] for res in out["results"]}
    assert (
        set(stacks) == {"llamacpp/f16", "llamacpp/q8_0", "llamacpp/q4_k_m"} and stacks["llamacpp/f16"]["is_reference"]
    )
    assert stacks["llamacpp/q4_k_m"]["cell_id"] == cells["q4_k_m"]
    r = run_cli("card", "llamacpp/q4_k_m", "--warehouse", str(wh), "--allow-undisclosed", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cell_id"] == cells["q4_k_m"], r.stderr[-2000:]
    r = run_cli("admit", "q8_0", "--warehouse", str(wh), "--json")  # a part of a name is enough where one stack has it
    assert r.returncode in (0, 1) and json.loads(r.stdout)["cell_id"] == cells["q8_0"], r.stderr[-2000:]
    r = run_cli("card", "llamacpp", "--warehouse", str(wh))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and str(wh) in err[0] and "matches 3 stacks" in err[0], r.stderr
    r = run_cli("admit", "llamacpp/q2_k", "--warehouse", str(wh))
    assert r.returncode == 2 and "'llamacpp/q2_k' is no cell id or stack name" in r.stderr, r.stderr


def test_the_spec_is_beside_the_warehouse_and_a_new_candidate_alone_is_captured(job, ggufs, text, tmp_path):
    """The second call also runs where transformers cannot be imported: a job of GGUF files alone
    needs neither it nor a dequantised copy of the reference, in the driver or in a worker."""
    wh, out, first = job
    blocked = tmp_path / "no-transformers" / "transformers"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('a GGUF-only job imported transformers')\n")
    spec = Path(out["spec"])
    assert spec == wh.with_name("wh.kld.yaml") and spec.is_file()
    before = {c["cell_id"]: c["run_id"] for c in sql(wh, "select cell_id, run_id from cells")}
    assert len(before) == 3
    r = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q4_0"],
        "--keep-rows",
        "--text",
        text,
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(wh),
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")]))},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    after = {c["cell_id"]: c["run_id"] for c in sql(wh, "select cell_id, run_id from cells")}
    new = set(after) - set(before)
    assert len(new) == 1 and all(after[c] == before[c] for c in before)  # the earlier cells were not run again
    assert "1 cell(s) to run" in r.stderr and "Mean    KLD:" in r.stdout and "Same top p:" in r.stdout
    assert f"model-q4_0.gguf against {Path(ggufs['f16']).name}" in r.stdout
    assert r.stdout.count("====== KL divergence statistics ======") == 1  # this call's candidate only
    spec_text = spec.read_text()
    assert all(Path(ggufs[d]).as_posix() in spec_text for d in ("q8_0", "q4_k_m", "q4_0"))


def test_a_bad_candidate_is_one_line_and_exit_2(ggufs, text, tmp_path):
    r = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        str(tmp_path / "missing.gguf"),
        "--text",
        text,
        "--warehouse",
        str(tmp_path / "wh"),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--candidate" in r.stderr and "missing.gguf" in r.stderr
    assert not (tmp_path / "wh").exists()


def test_a_candidate_that_fails_where_it_runs_leaves_the_others_reported(ggufs, text, tmp_path):
    """A file whose header passes the driver's check but whose tensors are cut off: llama.cpp
    refuses it in its worker. That cell fails, the other candidate's statistics still print, exit 2."""
    whole = Path(ggufs["q8_0"]).read_bytes()
    broken = tmp_path / "broken-q8_0.gguf"
    broken.write_bytes(whole[: len(whole) // 2])
    r = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        str(broken),
        "--candidate",
        ggufs["q4_k_m"],
        "--text",
        text,
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(tmp_path / "wh"),
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stdout.count("====== KL divergence statistics ======") == 1
    assert f"### {Path(ggufs['q4_k_m']).name} against" in r.stdout
    assert "no statistics for broken-q8_0.gguf" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"matrix: error: {broken}: llama.cpp could not load this GGUF"
    spec = (tmp_path / "wh.kld.yaml").read_text()
    assert str(broken) not in spec and ggufs["q4_k_m"] in spec  # a refused file does not come back with later calls


def test_another_text_for_the_same_warehouse_is_refused(job, ggufs, tmp_path):
    wh = job[0]
    other = tmp_path / "other.txt"
    other.write_text("Another text entirely. " * 400)
    before = (wh.parent / "wh.kld.yaml").read_text()
    r = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q8_0"],
        "--text",
        str(other),
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(wh),
        "--keep-rows",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "corpus: this warehouse's job has" in r.stderr and "(--text / --n-ctx)" in r.stderr
    assert (wh.parent / "wh.kld.yaml").read_text() == before


def test_a_candidate_without_metrics_is_measured_by_analyze_and_reported_the_same(job, ggufs, text, tmp_path):
    """A completed candidate whose metrics are missing (its capture could not measure it) is measured
    by `matrix analyze` at the end of the job: its rows' metrics are those its capture measured, bit
    for bit, and so are its statistics but for the last bits of the sums DuckDB takes over a file of
    another layout."""
    import shutil

    from matrix import api

    first = {Path(r["candidate"]).name: r for r in job[1]["results"]}
    q8 = first[Path(ggufs["q8_0"]).name]
    wh = tmp_path / "wh"
    shutil.copytree(job[0], wh)
    measured = wh / "metrics" / f"{q8['cell_id']}.parquet"
    captured = pq.read_table(measured)
    measured.unlink()
    lines: list[str] = []
    out = api.kld(
        ggufs["f16"],
        [ggufs["q8_0"], ggufs["q4_k_m"]],
        text,
        str(wh),
        n_ctx=N_CTX,
        threads=2,
        keep_rows=True,
        executor="local",
        log=lines.append,
    )
    assert any(x.startswith("nothing to do: all") for x in lines), lines  # nothing captured again
    assert "measuring the candidates their capture did not measure (matrix analyze)" in lines
    assert pq.read_table(measured).select(captured.column_names).equals(captured)
    again = {Path(r.candidate).name: r for r in out.results}
    assert set(again) == set(first)
    for name, r in again.items():
        assert r.cell_id == first[name]["cell_id"] and r.chunks == first[name]["chunks"]
        got, want = _flat(json.loads(json.dumps(r.statistics))), _flat(first[name]["statistics"])
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300), name
        assert r.card["numbers"]["kld_mean"] == pytest.approx(r.statistics["kld"][0], rel=1e-12)


def _flat(d, key: str = "") -> dict:
    """A statistics dict's numbers by their path (nested dicts and lists flattened)."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else None
    if items is None:
        return {key: d}
    return {k: v for sub, val in items for k, v in _flat(val, f"{key}/{sub}").items()}


def _shard(wh: Path, cell_id: str):
    return pq.ParquetFile(wh / "logits" / cell_id / "r0.parquet")


def test_by_default_only_the_reference_keeps_its_values_and_the_rest_is_the_same(job, ggufs, text, tmp_path):
    """Without --keep-rows a candidate's rows are measured and hashed where they are captured, their
    values not stored: the same statistics to the bit, the same row hashes as the job that keeps
    them, a shard a fraction of the size; verify passes, a reader of its values is told why not,
    and a spec that asks for every stack's values captures the candidates again, to the same bits."""
    kept_wh, kept, _ = job
    wh = tmp_path / "wh"
    r = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q8_0"],
        "--candidate",
        ggufs["q4_k_m"],
        "--text",
        text,
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(wh),
        "--json",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [x["statistics"] for x in out["results"]] == [x["statistics"] for x in kept["results"]]
    ref_cell = next(c["cell_id"] for c in sql(wh, "select cell_id from cells where is_reference"))
    hashes = {}
    for res in out["results"]:
        f, cid = _shard(wh, res["cell_id"]), res["cell_id"]
        assert f.schema_arrow.metadata[b"logit_matrix.values"] == b"not kept"
        t = f.read(columns=["prompt_id", "position", "row_hash", "logits"])
        assert t["logits"].null_count == t.num_rows == res["statistics"]["rows"]
        hashes[cid] = t.select(["prompt_id", "position", "row_hash"]).to_pylist()
        assert hashes[cid] == _shard(kept_wh, cid).read(columns=["prompt_id", "position", "row_hash"]).to_pylist()
        size = (wh / "logits" / cid / "r0.parquet").stat().st_size
        assert size * 20 < (wh / "logits" / ref_cell / "r0.parquet").stat().st_size
    assert b"logit_matrix.values" not in (_shard(wh, ref_cell).schema_arrow.metadata or {})
    r = run_cli("verify", "--warehouse", str(wh), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["damage"] == [], r.stdout[-2000:] + r.stderr[-2000:]
    before = sql(wh, "select * from metrics order by cell_id, prompt_id, position")
    r = run_cli("analyze", "--warehouse", str(wh), "--force")  # nothing to measure these cells' rows with again
    assert r.returncode == 0 and r.stderr.count("stay as measured where it was captured") == 2, r.stderr[-3000:]
    assert sql(wh, "select * from metrics order by cell_id, prompt_id, position") == before
    cid = out["results"][0]["cell_id"]
    r = run_process("fixture", "export", cid, "--warehouse", str(wh), "--out", str(tmp_path / "f.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "values not kept" in r.stderr, r.stderr
    r = run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q8_0"],
        "--keep-rows",
        "--text",
        text,
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(wh),
    )
    assert r.returncode == 2 and "keep_rows: this warehouse's job has references, not all (--keep-rows)" in r.stderr
    spec = Path(out["spec"])
    (wh / "metrics" / f"{cid}.parquet").unlink()  # as if the run had stopped before this cell completed
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local")
    assert r.returncode == 0 and "no metrics of them were stored; capturing it again" in r.stderr, r.stderr[-3000:]
    assert "1 cell(s) to run" in r.stderr and (wh / "metrics" / f"{cid}.parquet").is_file()
    spec.write_text(spec.read_text().replace("keep_rows: references", "keep_rows: all"))
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local")
    assert r.returncode == 0 and "values were not kept" in r.stderr and "2 cell(s) to run" in r.stderr, r.stderr[-3000:]
    for c, want in hashes.items():
        f = _shard(wh, c)
        assert b"logit_matrix.values" not in (f.schema_arrow.metadata or {})
        assert f.read(columns=["prompt_id", "position", "row_hash"]).to_pylist() == want


def test_a_text_tokenised_ahead_gives_the_ids_of_a_plain_call_once(ggufs, text, tmp_path):
    from backends import llama_binding as lb
    from common.errors import UserError

    lb._AHEAD.clear()  # another test's result left waiting is not this test's
    words = Path(text).read_text()
    want = lb.gguf_tokenize(ggufs["f16"], words)
    assert len(want[0]) > 100
    lb.tokenize_ahead(ggufs["f16"], words + " and more")  # another text: no call of this one takes it
    lb.tokenize_ahead(ggufs["f16"], words)
    assert lb.gguf_tokenize(ggufs["f16"], words) == want
    assert len(lb._AHEAD) == 1  # taken once; the other text's result still waits for its own call
    assert lb.gguf_tokenize(ggufs["f16"], words + " and more")[0][: len(want[0]) - 1] == want[0][:-1]
    assert not lb._AHEAD
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(Path(ggufs["f16"]).read_bytes()[:4096])
    lb.tokenize_ahead(str(broken), words)  # its failure is the caller's, raised where it takes the result
    with pytest.raises(UserError, match="broken.gguf: llama.cpp could not read this GGUF's vocabulary"):
        lb.gguf_tokenize(str(broken), words)
    assert not lb._AHEAD


def test_the_run_takes_the_text_kld_tokenised_ahead(ggufs, text, tmp_path, monkeypatch):
    """write_job starts the tokenising; the run's prepare takes that result: one vocabulary load."""
    from backends import llama_binding as lb
    from matrix.run.runner import prepare
    from matrix.spec import kld
    from matrix.spec.cells import load_spec
    from store import Warehouse

    lb._AHEAD.clear()
    loads, real = [], lb._tokenize
    monkeypatch.setattr(lb, "_tokenize", lambda path, words: loads.append(path) or real(path, words))
    ref, cand = kld.classify(ggufs["f16"], "--reference"), kld.classify(ggufs["q8_0"], "--candidate")
    spec_path, _, _ = kld.write_job(ref, [cand], Path(text), N_CTX, 2, str(tmp_path / "wh"), lambda m: None)
    plan = prepare(load_spec(spec_path), Warehouse(str(tmp_path / "wh")), lambda m: None)
    assert loads == [ggufs["f16"]] and not lb._AHEAD
    (ids,) = [m.prompts for m in plan.models.values()]
    assert len(ids) > 10 and all(len(p.token_ids) == N_CTX for p in ids)  # the text cut in chunks of N_CTX
