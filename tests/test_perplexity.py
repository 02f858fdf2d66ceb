"""Perplexity from the stored rows: each row's -log p(next token) on both sides (metrics), the
summary's PPL, ratio and correlation, and per prompt, against a float64 computation of its own."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import analyzed_copy, run_cli, sql
from tests.float64_rows import matrix

pytestmark = pytest.mark.slow  # the session's `swept` sweep runs on a Ray cluster


def _nll(wh, cell_id: str) -> dict[tuple[str, int], float]:
    """(prompt, position) -> logsumexp(row) - row[next token], in float64, for repeat 0."""
    t = pq.read_table(
        wh / "logits" / cell_id / "r0.parquet", columns=["prompt_id", "position", "next_token_id", "logits"]
    )
    rows = matrix(t["logits"])  # (rows, vocab), float32 values widened
    top = rows.max(axis=1)
    lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    out = {}
    for i, (pid, pos, nxt) in enumerate(
        zip(t["prompt_id"].to_pylist(), t["position"].to_pylist(), t["next_token_id"].to_pylist())
    ):
        if nxt is not None:
            out[(pid, pos)] = float(lse[i] - rows[i, nxt])
    return out


@pytest.fixture(scope="module")
def analyzed(swept, tmp_path_factory):
    return analyzed_copy(swept, tmp_path_factory, "ppl")


def test_row_nll_and_perplexity_match_a_float64_computation(analyzed):
    wh, cells = analyzed
    ref = _nll(wh, cells["bf16.eager"])
    summary = {s["cell_id"]: s for s in sql(wh, "select * from summary")}
    for name in ("fp32.eager", "fp32.sdpa", "bf16.sdpa"):
        stk = _nll(wh, cells[name])
        got = sql(
            wh,
            f"select prompt_id, position, nll_stack, nll_ref from metrics "
            f"where cell_id = '{cells[name]}' and repeat = 0 and nll_stack is not null",
        )
        assert len(got) == len(stk) > 20
        for g in got:
            key = (g["prompt_id"], g["position"])
            assert g["nll_stack"] == pytest.approx(stk[key], rel=1e-9, abs=1e-12)
            assert g["nll_ref"] == pytest.approx(ref[key], rel=1e-9, abs=1e-12)
        s = summary[cells[name]]
        mean_s, mean_r = np.mean([stk[k] for k in stk]), np.mean([ref[k] for k in stk])
        assert s["ppl"] == pytest.approx(math.exp(mean_s), rel=1e-9)
        assert s["ppl_ref"] == pytest.approx(math.exp(mean_r), rel=1e-9)
        assert s["ppl_ratio"] == pytest.approx(math.exp(mean_s - mean_r), rel=1e-9)
        assert s["nll_correlation"] == pytest.approx(
            np.corrcoef([stk[k] for k in stk], [ref[k] for k in stk])[0, 1], rel=1e-9
        )
        # the 2-layer cut predicts poorly (a PPL in the 1e9s), and its bf16 and fp32 stacks agree on it
        assert s["ppl"] > 1.0 and 0.5 < s["ppl_ratio"] < 2.0 and s["nll_correlation"] > 0.99
    reference = summary[cells["bf16.eager"]]
    assert reference["is_reference"] and reference["ppl"] == pytest.approx(
        math.exp(np.mean(list(ref.values()))), rel=1e-9
    )
    per = sql(wh, f"select prompt_id, rows, ppl from ppl_by_prompt where cell_id = '{cells['fp32.sdpa']}'")
    stk = _nll(wh, cells["fp32.sdpa"])
    for p in per:
        mine = [v for (pid, _), v in stk.items() if pid == p["prompt_id"]]
        assert p["rows"] == len(mine) and p["ppl"] == pytest.approx(math.exp(np.mean(mine)), rel=1e-9)


def test_the_card_gives_perplexity(analyzed):
    wh, cells = analyzed
    r = run_cli("card", cells["fp32.sdpa"], "--warehouse", str(wh), "--format", "json", "--allow-undisclosed")
    assert r.returncode == 0, r.stderr[-2000:]
    n = json.loads(r.stdout)["numbers"]
    s = sql(wh, f"select ppl, ppl_ratio from summary where cell_id = '{cells['fp32.sdpa']}'")[0]
    assert (n["ppl"], n["ppl_ratio"]) == (s["ppl"], s["ppl_ratio"])
    md = run_cli("card", cells["fp32.sdpa"], "--warehouse", str(wh), "--allow-undisclosed")
    assert f"| perplexity: candidate / reference (ratio; correlation of ln p) | {n['ppl']:.4g} / " in md.stdout
