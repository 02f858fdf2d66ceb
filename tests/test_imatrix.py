"""imatrix ladders: a Q4_K_M quantised with an importance matrix computed on a
calibration text, next to the round-to-nearest Q4_K_M of the same weights, both measured against
the HF reference; the collector's sums checked against activations HF computes itself; and a
calibration text that quotes the evaluation corpus refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # builds GGUF files and runs llama.cpp tools over them

pytest.importorskip("llama_cpp")

BUILTIN_CAL = REPO / "configs" / "corpus" / "calibration.txt"


def _spec(tmp_path, tiny_model, short_corpus, imatrix, f16=True):
    include = [
        {"engine": "llamacpp", "dtype": "q4_k_m", "attention": "default"},
        {"engine": "llamacpp", "dtype": "q4_k_m", "attention": "default", "imatrix": imatrix},
    ]
    if f16:  # nothing to weight: listed as skipped with the reason
        include.append({"engine": "llamacpp", "dtype": "f16", "attention": "default", "imatrix": imatrix})
    return write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        include=include,
    )


def test_q4_k_m_with_and_without_imatrix(tmp_path, tiny_model, short_corpus):
    from common.files import sha256_file
    from store.gguf_meta import read_info

    spec = _spec(tmp_path, tiny_model, short_corpus, {"corpus": "builtin", "chunks": 2})
    listed = json.loads(run_cli("cells", str(spec), "--json").stdout)
    assert len(listed["cells"]) == 3
    (skip,) = listed["skipped"]
    assert skip["dtype"] == "f16" and "quantises nothing" in skip["reason"]
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    rows = sql(
        wh,
        "select c.cell_id, c.options, c.artifact_recipe, c.artifact, c.artifact_sha256, s.kld_mean, s.top1_agreement "
        "from cells c join summary s using (cell_id) where c.engine = 'llamacpp'",
    )
    by = {("imatrix" in json.loads(r["options"])): r for r in rows}
    assert set(by) == {True, False}
    rtn, imx = json.loads(by[False]["artifact_recipe"]), json.loads(by[True]["artifact_recipe"])
    assert rtn["imatrix"] is None
    im = imx["imatrix"]
    assert im["calibration"] == "builtin" and im["calibration_sha256"] == sha256_file(BUILTIN_CAL)
    assert im["chunks"] == 2 and im["ctx"] == 512 and im["tokens_used"] == 1024 and im["tokens"] > 2000
    assert im["entries"] == 2 * 7  # q, k, v, output, gate, up, down of each of the cut's 2 layers
    files = {k: {"path": r["artifact"], "sha256": r["artifact_sha256"]} for k, r in by.items()}
    assert files[True]["sha256"] != files[False]["sha256"]  # the imatrix changed the quantised weights
    header = read_info(files[True]["path"]).imatrix  # what llama-quantize --imatrix writes, written here
    assert header["dataset"] == "builtin" and header["chunks_count"] == 2 and header["entries_count"] == 14
    assert read_info(files[False]["path"]).imatrix == {}
    k_rtn, k_imx = by[False]["kld_mean"], by[True]["kld_mean"]
    assert 0 < k_rtn < 0.5 and 0 < k_imx < 0.5 and k_rtn != k_imx, (k_rtn, k_imx)
    card = json.loads(run_cli("card", by[True]["cell_id"], "--warehouse", str(wh), "--json").stdout)["disclosure"]
    assert card["calibration_data"].startswith(
        f"importance matrix (sha256 {im['sha256']}) from calibration text builtin"
    )
    assert "2 chunks of 512" in card["calibration_data"]
    _check_sums_against_hf(tiny_model, files[True], im)


def _check_sums_against_hf(tiny_model: Path, art: dict, im: dict) -> None:
    """The imatrix's sums of squares are those of the activations HF feeds the same matmuls."""
    import torch
    import transformers

    from backends import gguf_imatrix
    from backends.llamacpp_backend import gguf_tokenize

    f32 = json.loads((Path(art["path"]).parent / "recipe.json").read_text())
    got = gguf_imatrix.read(_imatrix_path(im))
    assert got["chunk_count"] == 2 and got["chunk_size"] == 512
    src = _f32_path(f32["source_sha256"])
    ids, bos = gguf_tokenize(src, BUILTIN_CAL.read_text())
    chunks = gguf_imatrix.chunks_of(ids, 512, 2, bos)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    seen = {}
    hooks = [
        model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
            lambda m, a: seen.setdefault("blk.0.attn_q.weight", []).append(a[0][0])
        ),
        model.model.layers[1].mlp.down_proj.register_forward_pre_hook(
            lambda m, a: seen.setdefault("blk.1.ffn_down.weight", []).append(a[0][0])
        ),
    ]
    with torch.no_grad():
        for c in chunks:
            model(torch.tensor([c]))
    for h in hooks:
        h.remove()
    for name, xs in seen.items():
        want = (torch.cat(xs).double() ** 2).sum(0).numpy()  # (cols,)
        sums, counts = got["entries"][name]
        assert counts.tolist() == [1024.0]
        np.testing.assert_allclose(sums[0], want, rtol=2e-3, atol=1e-3 * want.mean())


def _imatrix_path(im: dict) -> str:
    from common.files import cache_root

    hits = [
        p
        for p in (cache_root() / "artifacts" / "imatrix").glob("*/imatrix.gguf")
        if json.loads((p.parent / "recipe.json").read_text())["sha256"] == im["sha256"]
    ]
    assert hits, im["sha256"]
    return str(hits[0])


def _f32_path(sha: str) -> str:
    from common.files import cache_root

    hits = [
        p
        for p in (cache_root() / "artifacts" / "gguf").glob("*/model-f32.gguf")
        if json.loads((p.parent / "recipe.json").read_text())["sha256"] == sha
    ]
    assert hits, sha
    return str(hits[0])


def test_a_calibration_text_quoting_the_corpus_is_refused(tmp_path, tiny_model, short_corpus):
    # the short corpus's prose prompt is the first 1,500 characters of long_prose.txt
    spec = _spec(
        tmp_path, tiny_model, short_corpus, {"corpus": str(REPO / "configs" / "corpus" / "long_prose.txt")}, f16=False
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert "imatrix.corpus" in line and "long_prose.txt" in line and "of prompt prose" in line, line
    assert not list(wh.rglob("*.parquet"))


@pytest.mark.parametrize(
    "imatrix, field",
    [
        ({"corpus": "builtin", "chunks": 0}, "imatrix.chunks"),
        ({"corpus": "builtin", "nchunks": 4}, "imatrix.nchunks"),
        ({"corpus": "no-such-file.txt"}, "imatrix.corpus"),
        ({"chunks": 4}, "imatrix"),
    ],
)
def test_imatrix_spec_errors(tmp_path, tiny_model, short_corpus, imatrix, field):
    spec = _spec(tmp_path, tiny_model, short_corpus, imatrix, f16=False)
    r = run_cli("cells", str(spec))
    assert r.returncode == 2 and field in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
