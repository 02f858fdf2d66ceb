"""Batch composition, captured for real on the 2-layer SmolLM2: HF (padded batch with a mask),
llama.cpp (several sequences in one llama_batch) and MLX (padded batch) at batch 1 and 4, the batch_drift view checked
against a float64 computation from the stored rows, batch 1 against the batch-free cell bit for bit,
and what the settings, the card and the report say of it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import run_cli, sql, write_spec
from tests.float64_rows import log_softmax, stored

BATCH = [1, 4]
# the most one row may move from batch 1 to 4 (measured on this model: fp32 1e-11, f16 1e-6, bf16 2e-3)
BOUND = {"fp32": 1e-8, "f16": 1e-4, "bf16": 5e-2}


@pytest.fixture(scope="module")
def batch_sweep(tiny_model, short_corpus, tmp_path_factory):
    """Batch-free HF fp32 eager (the reference), and at batch 1 and 4: the same stack, HF bf16 sdpa
    with `deterministic: true`, llama.cpp F16, MLX bf16. Two repeats each (bit-reproducibility)."""
    pytest.importorskip("llama_cpp")
    d = tmp_path_factory.mktemp("batch")
    spec = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        include=[
            {"engine": "hf", "dtype": "fp32", "attention": "eager", "batch": BATCH},
            {"engine": "hf", "dtype": "bf16", "attention": "sdpa", "batch": BATCH, "deterministic": True},
            {"engine": "llamacpp", "dtype": "f16", "attention": "default", "batch": BATCH},
            # MLX's Linux CPU kernels are slow: the first 24 tokens of each sequence
            {"engine": "mlx", "dtype": "bf16", "attention": "default", "batch": BATCH, "max_tokens": 24},
        ],
    )
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-3000:]
    cells = [c for c in sql(wh, "select * from cells") if c["status"] == "done"]
    by = {(c["engine"], c["dtype"], c["batch_size"]): c for c in cells}
    assert len(by) == len(cells) == 9, sorted(by)
    return wh, by, a.stderr


def _hashes(wh, cell_id: str) -> dict:
    rows = sql(wh, f"select prompt_id, position, row_hash from logits where cell_id = '{cell_id}' and repeat = 0")
    return {(r["prompt_id"], r["position"]): r["row_hash"] for r in rows}


@pytest.mark.slow
def test_batch_1_rows_equal_the_batch_free_cells_bit_for_bit(batch_sweep):
    wh, by, _ = batch_sweep
    alone, one = _hashes(wh, by[("hf", "fp32", None)]["cell_id"]), _hashes(wh, by[("hf", "fp32", 1)]["cell_id"])
    assert len(alone) > 20 and alone == one


@pytest.mark.slow
def test_batch_drift_matches_a_float64_computation_from_the_stored_rows(batch_sweep, tmp_path):
    wh, by, log = batch_sweep
    view = {r["cell_id"]: r for r in sql(wh, "select * from batch_drift")}
    stacks = (("hf", "fp32"), ("hf", "bf16"), ("llamacpp", "f16"), ("mlx", "bf16"))
    assert set(view) == {by[(e, d, 4)]["cell_id"] for e, d in stacks}
    assert "batch drift: 4 batch cell(s) against batch 1" in log
    for cid, v in view.items():
        one = by[(v["engine"], v["dtype"], 1)]["cell_id"]
        assert v["batch_1_cell_id"] == one and v["batch_size"] == 4 and v["fill"] == "corpus"
        four, base = stored(wh, cid), stored(wh, one)
        assert four.keys() == base.keys() and v["rows"] == len(base)
        kl, top1 = [], []
        for k, (x1, _) in base.items():
            l1, l4 = log_softmax(x1), log_softmax(four[k][0])
            kl.append(float(np.sum(np.exp(l1) * (l1 - l4))))
            top1.append(int(np.argmax(x1)) == int(np.argmax(four[k][0])))
        mine = _hashes(wh, cid)
        same = sum(mine[k] == h for k, h in _hashes(wh, one).items())
        assert v["identical_rows"] == same and v["bit_identical"] == (same == len(base))
        assert v["kld_mean"] == pytest.approx(np.mean(kl), rel=1e-9, abs=1e-15)
        # one row's KL (near 1e-6 nats) sums a vocabulary of terms: its rounding is ~1e-15 absolute
        assert v["kld_max"] == pytest.approx(max(kl), rel=1e-9, abs=1e-13)
        assert v["top1_agreement"] == pytest.approx(np.mean(top1))
        # the same prompt's rows: another sequence's would be nats away and disagree on top-1
        assert v["kld_max"] < BOUND[v["dtype"]] and v["top1_agreement"] >= 0.9, v
        ref = sql(wh, f"select kld_mean from summary where cell_id = '{cid}'")[0]["kld_mean"]
        assert v["kld_vs_reference"] == pytest.approx(ref)


@pytest.mark.slow
def test_each_engine_records_how_it_batched(batch_sweep):
    _, by, _ = batch_sweep
    hf = json.loads(by[("hf", "bf16", 4)]["settings"])
    assert (hf["batch_size"], hf["padding_side"], hf["attention_mask"]) == (4, "right", True)
    mlx = json.loads(by[("mlx", "bf16", 4)]["settings"])
    assert (mlx["batch_size"], mlx["padding_side"]) == (4, "right")
    lc = json.loads(by[("llamacpp", "f16", 4)]["settings"])
    assert (lc["n_seq_max"], lc["kv_unified"]) == (4, True)
    assert json.loads(by[("llamacpp", "f16", 1)]["batch"]) == {"size": 1}
    assert json.loads(by[("llamacpp", "f16", 4)]["batch"]) == {"size": 4, "fill": "corpus"}
    assert hf["deterministic_algorithms"] is True and json.loads(by[("hf", "bf16", 4)]["options"])["deterministic"]
    assert json.loads(by[("hf", "fp32", None)]["settings"])["deterministic_algorithms"] is False


@pytest.mark.slow
def test_deterministic_batch_cells_are_bit_reproducible_across_repeats(batch_sweep):
    _, by, _ = batch_sweep
    assert by[("hf", "bf16", 1)]["repeats"] == 2
    assert by[("hf", "bf16", 1)]["bit_reproducible"] and by[("hf", "bf16", 4)]["bit_reproducible"]


@pytest.mark.slow
def test_the_card_and_the_report_give_the_batch_drift(batch_sweep, tmp_path):
    wh, by, _ = batch_sweep
    cid = by[("llamacpp", "f16", 4)]["cell_id"]
    card = run_cli("card", cid, "--warehouse", str(wh))
    assert card.returncode == 0, card.stderr[-2000:]
    v = sql(wh, f"select * from batch_drift where cell_id = '{cid}'")[0]
    line = next(x for x in card.stdout.splitlines() if x.startswith("- batch 1 vs 4 (corpus fill): "))
    assert (
        line.endswith(f"bit-identical ({v['rows']} rows)") if v["bit_identical"] else f"KL {v['kld_mean']:.3g}" in line
    )
    r = run_cli("report", "--warehouse", str(wh), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "report.html").read_text()
    assert "Batch drift: each stack among other sequences" in page and 'id="batch-0"' in page


@pytest.mark.slow
def test_a_second_analyze_measures_no_pair_again(batch_sweep):
    wh, _, _ = batch_sweep
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-2000:]
    assert "batch drift: 4 batch cell(s) against batch 1" in a.stderr and "(4 up to date)" in a.stderr, a.stderr
    assert "[batch]" not in a.stderr
