"""`matrix kld --chunks N` (llama-perplexity's --chunks: the text's first N chunks) and `--n-ctx`
against the context the reference declares, on the real SmolLM2: the corpus key `max_chunks`, the
flags' refusals, and a job of two chunks whose rows are those of the same chunks in a job of all."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.errors import UserError
from matrix.spec import corpus as C
from matrix.spec import kld
from tests.conftest import REPO, run_cli, sql

N_CTX = 64


class _NoTokenizer:
    """tokenize() asks the reference tokenizer only for its BOS id when `vocab:` tokenises."""

    bos_token_id = None


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    """The catalog SmolLM2's shipped GGUF: its vocabulary and its header's context length."""
    return kld.catalog_gguf("smollm2-135m", lambda m: None)


def _prose(tmp: Path, fraction: int) -> Path:
    prose = (REPO / "configs/corpus/long_prose.txt").read_text()
    f = tmp / "prose.txt"
    f.write_text(prose[: len(prose) // fraction])
    return f


def _corpus(tmp: Path, text: Path, vocab: str, extra: str = "") -> str:
    f = tmp / f"c{len(list(tmp.glob('c*.yaml')))}.yaml"
    f.write_text(f"prompts:\n  - {{id: t, file: {text}, chunks: {N_CTX}, vocab: {vocab}{extra}}}\n")
    return str(f)


def test_max_chunks_takes_the_first_chunks_of_the_text(tmp_path, smollm2_gguf):
    text = _prose(tmp_path, 12)
    every = C.tokenize(_corpus(tmp_path, text, smollm2_gguf), "m", _NoTokenizer(), "tokenizer")
    assert len(every) >= 4
    first = C.tokenize(_corpus(tmp_path, text, smollm2_gguf, ", max_chunks: 2"), "m", _NoTokenizer(), "tokenizer")
    assert [(p.prompt_id, p.token_ids) for p in first] == [(p.prompt_id, p.token_ids) for p in every[:2]]
    more = C.tokenize(_corpus(tmp_path, text, smollm2_gguf, ", max_chunks: 1000"), "m", _NoTokenizer(), "tokenizer")
    assert [p.prompt_id for p in more] == [p.prompt_id for p in every]  # min(max_chunks, what the text holds)
    assert C.chunk_ids(list(range(10)), 4, None, 1) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("value", ["0", "-1", "true", "'2'", "1.5"])
def test_a_bad_max_chunks_is_one_line_naming_the_file_field_and_value(tmp_path, value):
    (tmp_path / "t.txt").write_text("some text")
    f = tmp_path / "c.yaml"
    f.write_text(f"prompts:\n  - {{id: t, file: t.txt, chunks: {N_CTX}, max_chunks: {value}}}\n")
    with pytest.raises(UserError) as e:
        C.load_entries(str(f))
    msg = str(e.value)
    assert msg.startswith(f"{f}: prompts[0].max_chunks: must be a number of chunks >= 1 (got ") and "\n" not in msg


def test_max_chunks_needs_a_text_cut_into_chunks(tmp_path):
    (tmp_path / "t.txt").write_text("some text")
    f = tmp_path / "c.yaml"
    f.write_text("prompts:\n  - {id: t, file: t.txt, max_chunks: 2}\n")
    with pytest.raises(UserError, match=r"prompts\[0\]\.max_chunks: only a text cut into chunks"):
        C.load_entries(str(f))


def _kld_on_catalog_smollm2(tmp_path, *flags: str):
    """`matrix kld` of the catalog SmolLM2 against itself over a short text, with flags."""
    (tmp_path / "t.txt").write_text("some text")
    return run_cli(
        "kld",
        "--reference",
        "smollm2-135m",
        "--candidate",
        "smollm2-135m",
        "--text",
        str(tmp_path / "t.txt"),
        *flags,
        "--warehouse",
        str(tmp_path / "wh"),
    )


@pytest.mark.parametrize("value", ["0", "-1"])
def test_chunks_below_one_exits_2(tmp_path, value):
    r = _kld_on_catalog_smollm2(tmp_path, f"--chunks={value}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"--chunks {value}: must be a number of chunks >= 1" in r.stderr
    assert not (tmp_path / "wh").exists() and not (tmp_path / "wh.kld.yaml").exists()


def test_n_ctx_past_the_references_context_exits_2_naming_its_limit(tmp_path, smollm2_gguf):
    r = _kld_on_catalog_smollm2(tmp_path, "--n-ctx", "16384")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert (
        f"--n-ctx 16384: the reference smollm2-135m ({smollm2_gguf}) supports at most 8192 tokens "
        "(its llama.context_length)" in r.stderr
    )
    assert not (tmp_path / "wh.kld.yaml").exists()
    ref = kld.classify("smollm2-135m", "--reference")
    kld.check_n_ctx(ref, smollm2_gguf, 8192)  # the limit itself is taken


def test_an_hf_checkpoints_limit_is_its_config(tmp_path, reference_model):
    ref = kld.classify(str(reference_model.hf_dir), "--reference")
    assert kld.context_limit(ref, None) == (8192, "its config.json max_position_embeddings")
    with pytest.raises(UserError, match=r"^--n-ctx 8194: the reference .* supports at most 8192 tokens"):
        kld.check_n_ctx(ref, None, 8194)
    d = tmp_path / "multimodal"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert kld.context_limit(kld.Source("path", str(d)), None) == (
        4096,
        "its config.json text_config.max_position_embeddings",
    )
    (d / "config.json").write_text(json.dumps({"model_type": "none"}))
    assert kld.context_limit(kld.Source("path", str(d)), None) is None  # declares none: any n_ctx
    kld.check_n_ctx(kld.Source("path", str(d)), None, 1 << 20)


@pytest.fixture(scope="module")
def ggufs(tiny_model):
    from backends.gguf_build import build_for
    from common.files import weights_digest_cached

    sha = weights_digest_cached(Path(tiny_model))
    return {d: build_for(d, str(tiny_model), sha, 2)["path"] for d in ("f16", "q8_0")}


def _kld(ggufs, text: Path, wh: Path, *extra: str):
    return run_cli(
        "kld",
        "--reference",
        ggufs["f16"],
        "--candidate",
        ggufs["q8_0"],
        "--text",
        str(text),
        "--n-ctx",
        str(N_CTX),
        "--threads",
        "2",
        "--warehouse",
        str(wh),
        "--json",
        *extra,
    )


def _hashes(wh: Path, prompts: list[str]) -> list:
    rows = sql(wh, "select c.dtype, prompt_id, position, row_hash from logits join cells c using (cell_id)")
    return sorted((r["dtype"], r["prompt_id"], r["position"], r["row_hash"]) for r in rows if r["prompt_id"] in prompts)


@pytest.mark.slow  # two llama.cpp jobs over a text of several chunks
def test_chunks_captures_the_first_chunks_as_a_job_of_every_chunk_does(ggufs, tmp_path):
    from analysis.kld_stats import stats

    text = _prose(tmp_path, 12)
    r = _kld(ggufs, text, tmp_path / "two", "--chunks", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    (two,) = json.loads(r.stdout)["results"]
    r = _kld(ggufs, text, tmp_path / "all")
    assert r.returncode == 0, r.stderr[-3000:]
    (every,) = json.loads(r.stdout)["results"]
    assert two["chunks"] == 2 and every["chunks"] >= 4
    scored = N_CTX // 2 - 1  # positions n_ctx/2 .. n_ctx-2 of each chunk
    counts = sql(
        tmp_path / "two",
        f"select count(*) n, count(distinct prompt_id) p from metrics where cell_id = '{two['cell_id']}'",
    )
    assert counts == [{"n": 2 * scored, "p": 2}] and two["statistics"]["rows"] == 2 * scored
    prompts = [r["prompt_id"] for r in sql(tmp_path / "two", "select distinct prompt_id from metrics")]
    cols = "kld, delta_p, nll_stack, nll_ref, top1_match"
    rows = sql(
        tmp_path / "all",
        f"select prompt_id, {cols} from metrics where cell_id = '{every['cell_id']}' order by prompt_id, position",
    )
    mine = [r for r in rows if r["prompt_id"] in prompts]
    assert len(mine) == 2 * scored
    want = stats(
        *(np.array([r[k] for r in mine], dtype=np.float64) for k in cols.split(", ")[:4]),
        np.array([r["top1_match"] for r in mine], dtype=bool),
    )
    assert {k: v for k, v in two["statistics"].items() if k != "nonfinite_rows"} == want
    hashes = _hashes(tmp_path / "two", prompts)
    assert hashes == _hashes(tmp_path / "all", prompts) and {h[0] for h in hashes} == {"f16", "q8_0"}
    before = (tmp_path / "two.kld.yaml").read_text()
    r = _kld(ggufs, text, tmp_path / "two", "--chunks", "3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert (
        "max_chunks: this warehouse's job has the first 2 chunks of the text, not the first 3 chunks of the text "
        "(--chunks)" in r.stderr
    )
    assert (tmp_path / "two.kld.yaml").read_text() == before
