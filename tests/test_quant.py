"""Quant-author workflow on real captures: model cards, admission gates, llama.cpp KLD-base interop."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from store import Warehouse
from store import llamacpp_kld as K
from store.warehouse import logits_matrix
from tests.conftest import DENSE, analyzed_copy, run_cli, run_process, sql

pytestmark = pytest.mark.slow  # the session's `swept` sweep runs on a Ray cluster

DISCLOSURE = {
    "reference_checkpoint",
    "reference_runtime",
    "candidate_runtime",
    "candidate_artifact",
    "evaluation_text",
    "calibration_data",
    "context_lengths",
    "sampled_positions",
    "kl_direction",
    "vocabulary_truncation",
    "aggregation",
    "storage_floor",
    "bit_reproducible",
}


@pytest.fixture(scope="module")
def analyzed(swept, tmp_path_factory):
    return analyzed_copy(swept, tmp_path_factory, "quant")


def test_card_discloses_every_field_and_matches_the_summary(analyzed):
    wh, cells = analyzed
    r = run_cli("card", cells["fp32.sdpa"], "--warehouse", str(wh), "--format", "json")
    assert r.returncode == 0, r.stderr[-2000:]
    card = json.loads(r.stdout)
    assert set(card["disclosure"]) == DISCLOSURE and card["undisclosed"] == []
    assert '"undisclosed",' not in r.stdout and ': "undisclosed"' not in r.stdout
    s = sql(wh, f"select * from summary where cell_id = '{cells['fp32.sdpa']}'")[0]
    assert card["numbers"]["kld_mean"] == pytest.approx(s["kld_mean"], rel=1e-12) and s["kld_mean"] > 0
    assert card["reference_cell_id"] == cells["bf16.eager"]
    d = card["disclosure"]
    assert (
        d["reference_checkpoint"]["weights_sha256"]
        == sql(wh, "select weights_sha256 from cells limit 1")[0]["weights_sha256"]
    )
    assert d["candidate_runtime"]["attention"] == "sdpa" and d["reference_runtime"]["dtype"] == "bf16"
    assert d["candidate_runtime"]["libraries"]["torch"].startswith("2.")
    assert d["sampled_positions"]["stride"] == 16 and d["sampled_positions"]["count"] == s["rows"]
    assert d["evaluation_text"]["prompts"] == 4 and len(d["evaluation_text"]["token_ids_sha256"]) == 64
    assert d["kl_direction"].startswith("KL(P_reference || P_candidate)")
    assert d["calibration_data"].startswith("none")
    assert {x["range"] for x in card["ranges"]} == {"0-511"}
    md = run_cli("card", cells["fp32.sdpa"], "--warehouse", str(wh))
    assert md.returncode == 0 and "| mean KLD ± s.e. |" in md.stdout and "| kl_direction |" in md.stdout
    js = run_cli("card", cells["fp32.sdpa"], "--warehouse", str(wh), "--json")  # like every other command
    assert js.returncode == 0 and json.loads(js.stdout) == card


def test_card_refuses_an_unknown_field_unless_allowed(analyzed, tmp_path):
    wh0, cells = analyzed
    wh = tmp_path / "wh"
    shutil.copytree(wh0, wh)
    w = Warehouse(wh)
    row = w.read_rows("cells", cells["fp32.eager"])[0]
    w.write_rows("cells", cells["fp32.eager"], [{**row, "threads": None}])
    r = run_process("card", cells["fp32.eager"], "--warehouse", str(wh))
    assert r.returncode == 2 and "candidate_runtime.threads is unknown" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("card", cells["fp32.eager"], "--warehouse", str(wh), "--allow-undisclosed", "--format", "json")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)
    assert card["disclosure"]["candidate_runtime"]["threads"] == "undisclosed"
    assert card["undisclosed"] == ["candidate_runtime.threads"]
    r = run_cli("card", "no-such-cell", "--warehouse", str(wh))
    assert r.returncode == 2 and "'no-such-cell' is no cell id or stack name" in r.stderr


def test_admit_passes_the_reference_and_fails_tight_gates(analyzed, tmp_path):
    wh, cells = analyzed
    r = run_process("admit", cells["bf16.eager"], "--warehouse", str(wh), "--json")  # the reference is the yardstick
    assert r.returncode == 2 and "is the reference its model's stacks are measured against" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("admit", cells["fp32.sdpa"], "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert (
        out["pass"]
        and out["class"] == "fp16"
        and {g["gate"] for g in out["gates"]}
        >= {"finite", "mean_kld", "p99_kld", "max_kld", "top1_agreement", "cosine_min", "norm_ratio_tol"}
    )
    kl = sql(wh, f"select avg(kld) as k from metrics where cell_id = '{cells['fp32.sdpa']}' and repeat = 0")[0]["k"]
    assert kl > 0 and next(g for g in out["gates"] if g["gate"] == "mean_kld")["measured"] == pytest.approx(
        kl, rel=1e-12
    )
    tight = tmp_path / "tight.yaml"
    tight.write_text("classes:\n  fp16: {mean_kld: 1.0e-9, max_kld: 1.0e-6, cosine_min: 0.5}\n")
    r = run_cli("admit", cells["bf16.sdpa"], "--warehouse", str(wh), "--gates", str(tight))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "REJECTED" in r.stdout and "mean_kld" in r.stdout and "FAIL" in r.stdout and "pass" in r.stdout
    for body, needle in [
        ("classes:\n  fp16: {mean_kl: 0.1}\n", "classes.fp16.mean_kl: unknown gate"),
        ("classes:\n  fp16: {mean_kld: lots}\n", "classes.fp16.mean_kld: threshold must be a number"),
        ("classes: [1]\n", "classes: a mapping"),
        ("classes:\n  fp16: {mean_kld: 1}\ndtypes: {bf16: 3bit}\n", "dtypes.bf16: unknown class"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(body)
        r = run_cli("admit", cells["bf16.sdpa"], "--warehouse", str(wh), "--gates", str(bad))
        assert r.returncode == 2 and needle in r.stderr and str(bad) in r.stderr, (body, r.stderr)


@pytest.fixture(scope="module")
def dense(capture, tmp_path_factory):
    """Every position of the first 40 tokens (conftest DENSE), in a copy: the import writes into it."""
    _, captured = capture(**DENSE)
    wh = tmp_path_factory.mktemp("dense") / "wh"
    shutil.copytree(captured, wh)
    cells = {c["dtype"]: c["cell_id"] for c in sql(wh, "select * from cells")}
    return wh, cells


def test_llamacpp_kld_base_round_trip(dense, tmp_path):
    wh, cells = dense
    base = tmp_path / "ref.kld"
    r = run_cli(
        "kld-base", "export", cells["fp32"], "--n-ctx", "32", "--out", str(base), "--warehouse", str(wh), "--json"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["n_chunk"] == 2 and out["rows"] == 2 * 15  # chat (98 tokens) and prose (338); 16..30
    f = K.read(base)
    assert (f["n_ctx"], f["n_vocab"], f["n_chunk"]) == (32, 49152, 2)
    assert base.stat().st_size == 20 + 4 * 2 * 32 + 2 * 2 * 15 * K.row_width(49152)
    # decoded log-probs vs the originals: within half a step above the clamp, clamped below it
    t = pq.read_table(wh / "logits" / cells["fp32"] / "r0.parquet")
    keys = list(zip(t["prompt_id"].to_pylist(), t["position"].to_pylist()))
    logits = logits_matrix(t["logits"]).astype(np.float64)
    for c, pid in enumerate(out["prompts"]):
        orig = logits[[keys.index((pid, j)) for j in range(16, 31)]]
        lp = orig - orig.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        dec = K.decode_rows(np.asarray(f["rows"][c]), 49152).astype(np.float64)
        scale = np.asarray(f["rows"][c][:, :2]).view(np.float32)[:, 0].astype(np.float64)
        above = lp > lp.max(-1, keepdims=True) - 15.99
        err = np.abs(dec - lp)
        assert (err[above] <= (scale[:, None] * 0.5 + 2e-5).repeat(49152, 1)[above]).all(), err[above].max()
        assert (dec[~above] <= lp.max(-1, keepdims=True).repeat(49152, 1)[~above] - 15.9).all()
        assert (
            np.asarray(f["tokens"][c])
            == sql(wh, f"select token_ids from prompts where prompt_id = '{pid}'")[0]["token_ids"][:32]
        ).all()
    # import it back: a lossy reference cell, its floor measured against the original rows
    r = run_cli("kld-base", "import", str(base), "--model", "tiny", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    imp = json.loads(r.stdout)
    assert imp["lossy"] and imp["matched_prompts"] == 2 and imp["rows"] == 30
    assert "LOSSY" in r.stderr and "no model or tokenizer hash" in r.stderr
    again = run_cli("kld-base", "import", str(base), "--model", "tiny", "--warehouse", str(wh), "--json")
    assert again.returncode == 0 and not json.loads(again.stdout)["imported"]
    r = run_cli("analyze", "--warehouse", str(wh), "--reference", imp["cell_id"], "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    m = sql(
        wh,
        f"""select avg(kld) as k, max(kld) as kmax, min(top1_match::int) as t1, count(*) as n,
                    avg(storage_floor) as floor from metrics where cell_id = '{cells["fp32"]}'""",
    )[0]
    assert m["n"] == 30 and m["t1"] == 1  # only the imported rows line up; the rest are left out (and said so)
    assert "have no row of reference" in r.stderr
    # the format's own floor, measured: within the bound the import estimated from the file alone
    assert m["floor"] == pytest.approx(imp["storage_floor"]) and 0 < m["k"] <= m["floor"], m


def test_kld_base_bad_input(dense, tmp_path):
    wh, cells = dense
    r = run_cli(
        "kld-base", "export", cells["fp32"], "--n-ctx", "64", "--out", str(tmp_path / "x.kld"), "--warehouse", str(wh)
    )
    assert r.returncode == 2 and "lacks" in r.stderr and "stride: 1" in r.stderr, r.stderr
    good = tmp_path / "ok.kld"
    assert (
        run_cli(
            "kld-base", "export", cells["fp32"], "--n-ctx", "32", "--out", str(good), "--warehouse", str(wh)
        ).returncode
        == 0
    )
    data = good.read_bytes()
    cases = {"foreign.kld": b"GGUF" + data[4:], "short.kld": data[:-10], "empty.kld": b""}
    for name, body in cases.items():
        p = tmp_path / name
        p.write_bytes(body)
        r = run_process("kld-base", "import", str(p), "--model", "tiny", "--warehouse", str(wh))
        assert r.returncode == 2 and str(p) in r.stderr, (name, r.stderr)
        assert ("magic" in r.stderr) if name != "short.kld" else ("do not add up" in r.stderr), r.stderr
    r = run_cli("kld-base", "import", str(good), "--model", "nosuch", "--warehouse", str(wh))
    assert r.returncode == 2 and "--model nosuch" in r.stderr


def test_fixture_from_hf_bf16_passes_the_same_stack_and_fails_sdpa_under_tight_gates(analyzed, tiny_model, tmp_path):
    wh, cells = analyzed
    fx = tmp_path / "bf16.json"
    r = run_cli("fixture", "export", cells["bf16.eager"], "--out", str(fx), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(
        "fixture",
        "check",
        str(fx),
        "--engine",
        "hf",
        "--model",
        str(tiny_model),
        "--dtype",
        "bf16",
        "--attention",
        "eager",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert (
        out["pass"]
        and out["rows"]
        == sql(wh, f"select rows_per_repeat from cells where cell_id = '{cells['bf16.eager']}'")[0]["rows_per_repeat"]
    )
    assert next(g for g in out["gates"] if g["gate"] == "top1_agreement")["measured"] == 1.0
    assert out["header_checked"] and out["differences"] == []  # the same stack: weights, build, hardware
    # a stack of other weights (one layer fewer): refused naming both hashes, unless allowed
    from matrix.spec.models import cut_layers

    other = cut_layers(tiny_model, tmp_path / "one-layer", 1)
    r = run_cli(
        "fixture", "check", str(fx), "--engine", "hf", "--model", str(other), "--dtype", "bf16", "--attention", "eager"
    )
    fixture_weights = json.loads(fx.read_text())["model"]["weights_sha256"]
    assert r.returncode == 1 and "same_weights" in r.stdout and "FAIL" in r.stdout, r.stdout + r.stderr[-2000:]
    assert f"weights_sha256: fixture {fixture_weights}, this stack " in r.stdout
    r = run_cli(
        "fixture",
        "check",
        str(fx),
        "--engine",
        "hf",
        "--model",
        str(other),
        "--dtype",
        "bf16",
        "--attention",
        "eager",
        "--allow-other-weights",
        "--json",
    )
    gate = next(g for g in json.loads(r.stdout)["gates"] if g["gate"] == "same_weights")
    assert gate["pass"] and fixture_weights in gate["measured"], gate
    # an edited header (one prompt id changed) is refused before any model loads
    body = json.loads(fx.read_text())
    body["prompts"][0]["token_ids"][1] += 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(body))
    r = run_process("fixture", "check", str(edited), "--engine", "hf", "--model", str(tiny_model), "--dtype", "bf16")
    assert r.returncode == 2 and "header_sha256: the header" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    tight = tmp_path / "tight.yaml"
    tight.write_text("classes:\n  fp16: {mean_kld: 1.0e-9}\n")
    r = run_cli(
        "fixture",
        "check",
        str(fx),
        "--engine",
        "hf",
        "--model",
        str(tiny_model),
        "--dtype",
        "bf16",
        "--attention",
        "sdpa",
        "--gates",
        str(tight),
    )
    assert r.returncode == 1 and "REJECTED" in r.stdout, r.stdout + r.stderr[-2000:]


def _rewrite(path, column: str, edit) -> None:
    import pyarrow as pa

    t = pq.read_table(path)
    vals = edit(t[column].to_pylist())
    pq.write_table(
        t.set_column(t.schema.get_field_index(column), column, pa.array(vals, t.schema.field(column).type)), path
    )


def test_admit_fails_on_a_nan_row_a_parity_mismatch_and_raw_logit_gates_naming_the_worst_row(analyzed, tmp_path):
    from store.warehouse import row_hash

    src, cells = analyzed
    wh = tmp_path / "wh"
    shutil.copytree(src, wh)
    sdpa, fp32 = cells["bf16.sdpa"], cells["fp32.sdpa"]
    shard = wh / "logits" / sdpa / "r0.parquet"
    t = pq.read_table(shard)
    first = (t["prompt_id"][5].as_py(), t["position"][5].as_py())

    def nan_row(rows):
        rows[5][7] = float("nan")
        return rows

    _rewrite(shard, "logits", nan_row)
    t = pq.read_table(shard)  # as if the engine returned the NaN: its hash is of those values (bf16 bits)
    bits = (np.array(t["logits"][5].as_py(), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    _rewrite(shard, "row_hash", lambda h: h[:5] + [row_hash(bits)] + h[6:])
    _rewrite(wh / "cells" / f"{fp32}.parquet", "tokenizer_parity", lambda v: ["mismatch"] * len(v))
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("admit", sdpa, "--warehouse", str(wh), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    finite = next(g for g in json.loads(r.stdout)["gates"] if g["gate"] == "finite")
    assert not finite["pass"] and finite["measured"] == 1
    assert (finite["worst"]["prompt_id"], finite["worst"]["position"]) == first
    r = run_cli("admit", fp32, "--warehouse", str(wh), "--json")
    assert (
        r.returncode == 1
        and not next(g for g in json.loads(r.stdout)["gates"] if g["gate"] == "tokenizer_parity")["pass"]
    ), r.stdout
    r = run_cli("admit", fp32, "--warehouse", str(wh), "--json", "--allow-tokenizer-mismatch")
    assert r.returncode == 0, r.stdout
    assert next(g for g in json.loads(r.stdout)["gates"] if g["gate"] == "tokenizer_parity")["allowed"]
    tight = tmp_path / "tight.yaml"
    tight.write_text("classes:\n  fp16: {max_abs_diff: 1.0e-9, spearman_min: 0.999999, mean_nmse: 1.0}\n")
    r = run_cli("admit", fp32, "--warehouse", str(wh), "--gates", str(tight), "--allow-tokenizer-mismatch")
    assert r.returncode == 1 and "max_abs_diff: worst row prompt" in r.stdout, r.stdout
    worst = sql(
        wh,
        f"select prompt_id, position from metrics where cell_id = '{fp32}' and repeat = 0 "
        "order by max_abs_diff desc limit 1",
    )[0]
    assert f"max_abs_diff: worst row prompt {worst['prompt_id']} position {worst['position']} " in r.stdout
    gates = {
        g["gate"]: g
        for g in json.loads(
            run_cli(
                "admit", fp32, "--warehouse", str(wh), "--gates", str(tight), "--json", "--allow-tokenizer-mismatch"
            ).stdout
        )["gates"]
    }
    assert not gates["max_abs_diff"]["pass"] and gates["mean_nmse"]["pass"]
    s = sql(
        wh,
        f"select nmse_mean, max_abs_diff, spearman_mean, rows, nonfinite_rows, kld_stderr from summary "
        f"where cell_id = '{sdpa}'",
    )[0]
    se = sql(
        wh, f"select stddev_samp(kld) / sqrt(count(kld)) as se from metrics where cell_id = '{sdpa}' and repeat = 0"
    )
    assert s["nonfinite_rows"] == 1 and s["kld_stderr"] == pytest.approx(se[0]["se"], rel=1e-12)  # finite rows only
    assert 0 < s["nmse_mean"] < 1 and s["max_abs_diff"] > 0 and 0.5 < s["spearman_mean"] <= 1


def test_fixture_check_runs_the_stack_on_a_ray_node_as_matrix_run_places_it(analyzed, tiny_model, tmp_path):
    """--address: the stack runs in a cell actor on a worker node (the head has no CPU for it), and
    measures exactly what the in-process check measures; a device no node has is exit 2."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    wh, cells = analyzed
    fx = tmp_path / "bf16.json"
    assert run_cli("fixture", "export", cells["bf16.eager"], "--out", str(fx), "--warehouse", str(wh)).returncode == 0
    args = (
        "fixture",
        "check",
        str(fx),
        "--engine",
        "hf",
        "--model",
        str(tiny_model),
        "--dtype",
        "bf16",
        "--attention",
        "sdpa",
        "--threads",
        "1",
        "--json",
    )
    here = run_cli(*args)
    assert here.returncode == 0, here.stderr[-2000:]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        worker = c.add_node(num_cpus=1)
        c.wait_for_nodes()
        there = run_cli(*args, "--address", c.address)
        assert there.returncode == 0, there.stderr[-2000:]
        far, near = json.loads(there.stdout), json.loads(here.stdout)
        assert far["ran_on"]["where"] == "ray" and far["ran_on"]["node_id"] == worker.node_id
        assert near["ran_on"]["where"] == "this process"
        assert far["rows"] == near["rows"] > 0
        # the same arithmetic on the same machine: every gate's value equal
        assert [(g["gate"], g["measured"]) for g in far["gates"]] == [(g["gate"], g["measured"]) for g in near["gates"]]
        assert far["differences"] == near["differences"]
        r = run_cli(*args[:-1], "--address", c.address, "--device", "h200")
        assert r.returncode == 2 and "--device h200" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        c.shutdown()
