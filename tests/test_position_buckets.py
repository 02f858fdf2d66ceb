"""Long-context analysis by position bucket: the position_buckets view against a float64 computation
of its own over the stored logits, the report's chart of it and the card's context line and block,
on a small warehouse of two 20,000-token chunks whose sampled rows reach every bucket."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis import report_buckets as B
from analysis.disclosure import measured_context
from analysis.sql import connect, dict_rows
from common import metric_defs as D
from common.files import ids_sha256
from store import ShardWriter, Warehouse
from store import rows as R
from store.prompt_rows import PromptRows
from tests.conftest import run_cli
from tests.float64_rows import bucket, log_softmax, stored

VOCAB, N_TOKENS, MODEL = 300, 20_000, "m"
# every 97th position, the last, and both sides of each bucket edge (lo is in its bucket, hi is not)
POSITIONS = sorted(set(range(0, N_TOKENS, 97)) | {N_TOKENS - 1, 1023, 1024, 4095, 4096, 16383, 16384})
NOISE = {"ref": 0.0, "near": 0.1, "far": 0.5}  # each candidate's logits: the reference's plus N(0, noise²)
NAN_AT = ("p0", 9991)  # a row of `near` whose logits hold a NaN: flagged, in no mean


def _cell_row(cid: str) -> dict:
    return R.cell_row(
        cid,
        "run",
        "done",
        model=MODEL,
        engine="hf",
        dtype="fp32",
        attention=cid,  # what names the stack apart from the others
        tp=1,
        device="cpu",
        repeats=1,
        rows_per_repeat=2 * len(POSITIONS),
        n_prompts=2,
        stride=97,
        is_reference=cid == "ref",
        reference_cell_id="ref",
        vocab_size=VOCAB,
        logits_dtype="fp32",
        stack_id=cid,
    )


def _build(wh_dir) -> None:
    """Two chunks named as the corpus names a text's (<id>-c<k>); a reference and two candidates."""
    wh = Warehouse(wh_dir)
    wh.create()
    rng = np.random.default_rng(0)
    ids = {f"p{k}": rng.integers(0, VOCAB, N_TOKENS).tolist() for k in range(2)}
    for k, (pid, tok) in enumerate(ids.items()):
        row = R.prompt_row(prompt_id=pid, model=MODEL, corpus="c", name=f"t-c{k}", category="long_context", source="")
        row |= {"token_ids": tok, "n_tokens": N_TOKENS, "ids_sha256": ids_sha256(tok), "bos_policy": "never"}
        wh.write_rows("prompts", pid, [row])
    base = {pid: 3 * rng.standard_normal((len(POSITIONS), VOCAB)).astype(np.float32) for pid in ids}
    for cid, noise in NOISE.items():
        w = ShardWriter(wh_dir, "run", cid, 0)
        for pid, tok in ids.items():
            x = base[pid] + np.float32(noise) * rng.standard_normal(base[pid].shape).astype(np.float32)  # (rows, vocab)
            if cid == "near" and pid == NAN_AT[0]:
                x[POSITIONS.index(NAN_AT[1]), 7] = np.nan
            w.add(PromptRows(pid, POSITIONS, [tok[p + 1] if p + 1 < N_TOKENS else None for p in POSITIONS], x))
        w.commit()
        wh.write_rows("cells", cid, [_cell_row(cid)])
    wh.write_rows("runs", "run", [R.run_row("run", "done", started_at=R.now(), finished_at=R.now(), spec_name="t")])


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    wh = tmp_path_factory.mktemp("buckets") / "wh"
    _build(wh)
    r = run_cli("analyze", "--warehouse", str(wh), "--workers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    return wh


def _expected(wh, cid: str) -> dict[str, dict]:
    """Per bucket: rows, flagged rows, mean and s.e. of KL(ref || cell), top-1 agreement, mean Δp, in float64."""
    ref, cand = stored(wh, "ref"), stored(wh, cid)
    acc: dict[str, dict[str, list]] = {}
    for key, (q, nxt) in cand.items():
        b = acc.setdefault(bucket(key[1]), {"kld": [], "top1": [], "dp": [], "flagged": 0, "rows": 0})
        b["rows"] += 1
        if not np.isfinite(q).all():
            b["flagged"] += 1
            continue
        lp, lq = log_softmax(ref[key][0]), log_softmax(q)
        b["kld"].append(float(np.sum(np.exp(lp) * (lp - lq))))
        b["top1"].append(bool(ref[key][0].argmax() == q.argmax()))
        if nxt is not None:
            b["dp"].append(float(np.exp(lq[nxt]) - np.exp(lp[nxt])))
    return {
        label: {
            "rows": b["rows"],
            "nonfinite_rows": b["flagged"],
            "kld_mean": np.mean(b["kld"]),
            "kld_stderr": np.std(b["kld"], ddof=1) / np.sqrt(len(b["kld"])),
            "top1_agreement": np.mean(b["top1"]),
            "delta_p_mean": np.mean(b["dp"]),
        }
        for label, b in acc.items()
    }


def _view(wh) -> list[dict]:
    con = connect(str(wh))
    try:
        return dict_rows(con, "SELECT * FROM position_buckets ORDER BY cell_id, lo")
    finally:
        con.close()


def test_the_view_matches_a_float64_computation_over_the_stored_rows(warehouse):
    rows = _view(warehouse)
    assert {(r["cell_id"], r["model"], r["reference_cell_id"]) for r in rows} == {
        ("near", MODEL, "ref"),
        ("far", MODEL, "ref"),
    }  # the reference is not measured against itself
    for cid in ("near", "far"):
        got = [r for r in rows if r["cell_id"] == cid]
        assert [(r["bucket"], r["lo"], r["hi"]) for r in got] == list(D.POSITION_BUCKETS)
        want = _expected(warehouse, cid)
        for r in got:
            w = want[r["bucket"]]
            assert (r["rows"], r["nonfinite_rows"]) == (w["rows"], w["nonfinite_rows"]), r["bucket"]
            # Both sides take each row in float64 from the same stored float32 logits and differ only in the
            # kernel's exp/log and summation order, ~1e-11 relative a row at most (seen: 3e-14); KL rows are
            # >= 0, so their mean is as close. The s.e. subtracts rows from their mean: a decade more room.
            assert r["kld_mean"] == pytest.approx(w["kld_mean"], rel=1e-11), (cid, r["bucket"])
            assert r["kld_stderr"] == pytest.approx(w["kld_stderr"], rel=1e-10), (cid, r["bucket"])
            assert r["top1_agreement"] == w["top1_agreement"], (cid, r["bucket"])  # argmax: exact
            # Δp: a difference of two float64 probabilities (<= 1), each within ~1e-15 (seen: 7e-18 on the mean)
            assert r["delta_p_mean"] == pytest.approx(w["delta_p_mean"], rel=0, abs=1e-14), (cid, r["bucket"])
    near = {r["bucket"]: r for r in rows if r["cell_id"] == "near"}
    assert near[bucket(NAN_AT[1])]["nonfinite_rows"] == 1 and sum(r["nonfinite_rows"] for r in rows) == 1
    counts = {label: sum(2 for p in POSITIONS if bucket(p) == label) for label, _, _ in D.POSITION_BUCKETS}
    assert {b: r["rows"] for b, r in near.items()} == counts  # both prompts' rows, each edge on its upper side


def test_the_report_draws_kl_by_bucket_one_line_per_stack(warehouse, tmp_path):
    r = run_cli("report", "--warehouse", str(warehouse), "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "report.html").read_text()
    assert 'id="kld-buckets-0"' in page
    series = {i for i in range(4) if f'id="kld-buckets-0-series-{i}"' in page}
    assert series == {0, 1}  # near and far; the reference is the yardstick, not a line
    assert all(f">{label}</text>" in page for label, _, _ in D.POSITION_BUCKETS)  # the buckets name the x axis
    assert len(json.loads(r.stdout)["buckets"]) == 8


def test_a_model_whose_rows_lie_in_one_bucket_has_no_bucket_chart():
    row = {"cell_id": "c", "bucket": "0-1k", "lo": 0, "kld_mean": 0.1, "kld_stderr": 0.01}
    data = {"buckets": [row], "names": {"c": "stack c"}}
    assert B.chart(data, [{"cell_id": "c"}], 0) == ""
    two = {**data, "buckets": [row, {**row, "bucket": "1k-4k", "lo": 1024}]}
    assert 'id="kld-buckets-3"' in B.chart(two, [{"cell_id": "c"}], 3)


def test_the_card_states_the_context_measured_and_kl_perbucket(warehouse):
    r = run_cli("card", "near", "--warehouse", str(warehouse), "--allow-undisclosed")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| context | 20,000 tokens per chunk (positions up to 19,999 scored) |" in r.stdout
    assert "| positions | rows | mean KLD ± s.e. | top-1 agreement | mean Δp (next token) |" in r.stdout
    view = {x["bucket"]: x for x in _view(warehouse) if x["cell_id"] == "near"}
    for label, _, _ in D.POSITION_BUCKETS:
        assert f"| {label} | {view[label]['rows']} | {view[label]['kld_mean']:.4g} ± " in r.stdout
    js = json.loads(run_cli("card", "near", "--warehouse", str(warehouse), "--allow-undisclosed", "--json").stdout)
    assert js["disclosure"]["context_lengths"]["measured"].startswith("20,000 tokens per chunk")
    assert [b["bucket"] for b in js["position_buckets"]] == [label for label, _, _ in D.POSITION_BUCKETS]


@pytest.mark.parametrize(
    ("names", "lengths", "max_tokens", "want"),
    [
        (["t-c0", "t-c1"], [16384, 16384], None, "16,384 tokens per chunk (positions up to 16,382 scored)"),
        (["base.kld chunk 0"], [512], None, "512 tokens per chunk (positions up to 16,382 scored)"),
        (["a", "b"], [300, 9000], None, "up to 9,000 tokens per prompt (positions up to 16,382 scored)"),
        (["a", "b"], [3000, 9000], 2048, "2,048 tokens per prompt (positions up to 16,382 scored)"),
    ],
)
def test_the_context_line_names_chunks_prompts_and_the_fed_prefix(names, lengths, max_tokens, want):
    prompts = [{"name": n, "n_tokens": k} for n, k in zip(names, lengths)]
    assert measured_context({"max_tokens": max_tokens}, prompts, {"last": 16382}) == want
    assert measured_context({}, [], {"last": None}) is None
