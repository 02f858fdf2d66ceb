"""HF checkpoints quantised at load with the CPU kernels this machine has: torchao
int8 and optimum-quanto int8 / int4, each against the HF fp32 reference of the same weights."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

pytest.importorskip("torchao")
pytest.importorskip("optimum.quanto")


def test_torchao_and_quanto_stacks_against_the_hf_reference(tmp_path, tiny_model, short_corpus):
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "int4"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=2,
        include=[
            {"dtype": "int8", "attention": "eager"},  # torchao, the int8 default
            {"dtype": "int8", "attention": "sdpa", "quantizer": "quanto"},
            {"dtype": "int4", "attention": "sdpa", "quantizer": "torchao"},
        ],
    )  # no CPU kernel
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert len(listed["cells"]) == 4
    (skip,) = listed["skipped"]
    assert skip["dtype"] == "int4" and "torchao has no CPU kernel for int4" in skip["reason"]
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    rows = sql(
        wh,
        "select c.cell_id, c.dtype, c.attention, c.artifact_recipe, c.versions, c.bit_reproducible, "
        "s.kld_mean, s.top1_agreement from cells c join summary s using (cell_id) where c.dtype like 'int%'",
    )
    got = {(r["dtype"], json.loads(r["artifact_recipe"])["tool"]): r for r in rows}
    assert set(got) == {("int8", "torchao"), ("int8", "optimum-quanto"), ("int4", "optimum-quanto")}
    for (dtype, tool), r in got.items():
        recipe = json.loads(r["artifact_recipe"])
        assert recipe["weights"] == dtype and recipe["activations"] == "fp32" and recipe["version"]
        assert tool in json.loads(r["versions"]) and r["bit_reproducible"]
    k8, k8q, k4 = (
        got[k]["kld_mean"] for k in (("int8", "torchao"), ("int8", "optimum-quanto"), ("int4", "optimum-quanto"))
    )
    # measured here on the 2-layer cut: int8 ~3e-4 (both libraries), int4 ~3e-2
    assert 0 < k8 < 5e-3 and 0 < k8q < 5e-3 and 5 * max(k8, k8q) < k4 < 0.5, (k8, k8q, k4)
    assert got[("int8", "torchao")]["top1_agreement"] > 0.95
    card = json.loads(
        run_cli("card", got[("int4", "optimum-quanto")]["cell_id"], "--warehouse", str(wh), "--json").stdout
    )["disclosure"]
    assert card["calibration_data"].startswith("none: optimum-quanto int4 weight-only round-to-nearest")
    assert card["candidate_artifact"]["kind"] == "built by logit-matrix (optimum-quanto)"
