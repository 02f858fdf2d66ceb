"""Positions windows, llama-perplexity's chunker, and corpora given as token ids.

The chunker is checked against llama.cpp's own recorded tokenisations: each ggml-vocab-*.gguf test
vocabulary in the llama-cpp-python sdist comes with .inp texts and the .out ids llama.cpp's
test-tokenizer-0 expects for them (add_special off, parse_special off).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from common.positions import Positions
from matrix.spec import corpus as C
from matrix.spec.parse import parse_spec
from tests.conftest import dedent, run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end


def test_plain_stride_keeps_every_stride_th_and_the_last_and_windows_cut_as_asked():
    for n in (1, 2, 31, 32, 33, 64, 65, 100):
        want = list(range(0, n, 32))
        assert Positions.every(32).of(n) == (want if want[-1] == n - 1 else want + [n - 1])
    assert Positions(stride=1, start=256, stop=510, last=False).of(512) == list(range(256, 511))
    lp = Positions(stride=1, start="half", stop=-2, last=False)  # the llama_perplexity preset
    assert lp.of(512) == list(range(256, 511)) and lp.of(8) == [4, 5, 6]
    assert Positions(stride=4, start=3, stop=None, last=True).of(12) == [3, 7, 11]
    assert Positions(stride=4, start=3, stop=None, last=True).of(13) == [3, 7, 11, 12]
    assert Positions(stride=1, start=10, stop=20, last=False).of(8) == []  # the window misses a short prompt
    assert Positions(stride=2, start=0, stop=100, last=False).of(7) == [0, 2, 4, 6]


def _spec(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(dedent(body))
    return p


def test_spec_positions_forms_and_their_errors(tmp_path):
    s = parse_spec(_spec(tmp_path, "models: [smollm2-135m]\npositions: llama_perplexity\n"))
    assert s.positions == Positions(stride=1, start="half", stop=-2, last=False) and s.stride == 1
    s = parse_spec(_spec(tmp_path, "models: [smollm2-135m]\npositions: {from: 256, to: 510, stride: 1}\n"))
    assert s.positions.of(512) == list(range(256, 511))
    assert parse_spec(_spec(tmp_path, "models: [smollm2-135m]\nstride: 8\n")).positions == Positions.every(8)
    bad = {
        "positions: {from: 9, to: 3}": "positions.to: must not be before from (9) (got 3)",
        "positions: {form: 3}": "positions.form: unknown key",
        "positions: {stride: 0}": "positions.stride: must be a positive integer (got 0)",
        "positions: scored": "positions: unknown preset",
        "stride: 4\npositions: {from: 1}": "stride: give the step inside positions",
    }
    for line, msg in bad.items():
        p = _spec(tmp_path, f"models: [smollm2-135m]\n{line}\n")
        with pytest.raises(UserError) as e:
            parse_spec(p)
        assert str(e.value).startswith(f"{p}: {msg}"), str(e.value)
    r = run_cli("cells", str(_spec(tmp_path, "models: [smollm2-135m]\npositions: {from: -1}\n")))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "positions.from: must be a position >= 0 or 'half' (got -1)" in r.stderr


def _vocab_tests(tools: Path, name: str) -> list[tuple[str, list[int]]]:
    inp = (
        (tools / "models" / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    )
    out = (tools / "models" / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(v) for v in o.split()]) for t, o in zip(inp, out)]


class _NoTokenizer:
    """tokenize() asks the reference tokenizer only for its BOS id when `vocab:` tokenises."""

    bos_token_id = None


@pytest.mark.parametrize("vocab,bos", [("llama-spm", 1), ("gpt-2", None)])
def test_chunks_equal_llama_perplexity_on_a_ggml_vocab_file(tmp_path, vocab, bos):
    from backends.gguf_build import tools_dir

    tools = tools_dir()
    cases = [(t, ids) for t, ids in _vocab_tests(tools, vocab) if len(ids) + (bos is not None) >= 6]
    assert len(cases) >= 8  # runs of spaces, blank lines before digits, unicode: the hard cases
    n_ctx = 4
    lines = ["name: chunked", "prompts:"]
    for i, (text, _) in enumerate(cases):
        (tmp_path / f"t{i}.txt").write_text(text, encoding="utf-8")
        lines.append(
            f"  - {{id: t{i}, file: t{i}.txt, chunks: {n_ctx}, vocab: {tools}/models/ggml-vocab-{vocab}.gguf}}"
        )
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\n")
    got = C.tokenize(str(tmp_path / "c.yaml"), "m", _NoTokenizer(), "tokenizer")
    want = []
    for i, (_, ids) in enumerate(cases):
        # perplexity.cpp: tokens = common_tokenize(ctx, text, true); chunk c = tokens[c*n_ctx, (c+1)*n_ctx),
        # evaluated with BOS in place of its first token when the vocabulary adds BOS
        tokens = ([bos] if bos is not None else []) + ids
        for c in range(len(tokens) // n_ctx):
            chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
            want.append((f"t{i}-c{c}", ([bos] + chunk[1:]) if bos is not None else chunk))
    assert [(p.name, p.token_ids) for p in got] == want
    assert all(p.text is None and p.bos_added == (bos is not None) for p in got)


def test_ids_corpora_inline_npy_parquet_and_a_base_file(tmp_path, reference_model):
    from transformers import AutoTokenizer

    from store import llamacpp_kld as K

    tok = AutoTokenizer.from_pretrained(reference_model.hf_dir)
    np.save(tmp_path / "two.npy", np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int64))
    pq.write_table(pa.table({"name": ["a", "b"], "token_ids": [[9, 10, 11], [12, 13]]}), tmp_path / "ids.parquet")
    base_tokens = np.arange(100, 100 + 3 * 8, dtype=np.int32).reshape(3, 8)
    K.write(
        tmp_path / "base.kld", 8, base_tokens, [np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)] * 3
    )
    (tmp_path / "c.yaml").write_text(
        dedent("""
        name: ids
        prompts:
          - {id: inline, ids: [42, 43, 44, 45, 46]}
          - {id: cut, ids: [1, 2, 3, 4, 5, 6, 7], chunks: 3}
          - {id: arr, ids_file: two.npy}
          - {id: pq, ids_file: ids.parquet}
          - {id: kld, ids_file: base.kld}
          - {id: text, text: "Plain text still tokenises."}
    """)
    )
    got = {p.name: p for p in C.tokenize(str(tmp_path / "c.yaml"), "smollm2", tok, "tokenizer")}
    assert got["inline"].token_ids == [42, 43, 44, 45, 46] and got["inline"].bos_policy == "ids"
    assert [got["cut-c0"].token_ids, got["cut-c1"].token_ids] == [[1, 2, 3], [4, 5, 6]] and "cut-c2" not in got
    assert got["arr-1"].token_ids == [5, 6, 7, 8] and got["pq-b"].token_ids == [12, 13]
    assert [got[f"kld-chunk{c}"].token_ids for c in range(3)] == base_tokens.tolist()  # SmolLM2 takes no BOS
    assert got["text"].text == "Plain text still tokenises." and got["text"].bos_policy == "tokenizer"
    assert len({p.prompt_id for p in got.values()}) == len(got)
    (tmp_path / "bad.yaml").write_text("prompts:\n  - {id: big, ids: [1, 49152]}\n")
    with pytest.raises(
        UserError,
        match=r"bad.yaml: prompts big: token id 49152 is outside the vocabulary of "
        r"smollm2 \(0..49151\)",
    ):
        C.tokenize(str(tmp_path / "bad.yaml"), "smollm2", tok, "tokenizer")
    (tmp_path / "bad2.yaml").write_text("prompts:\n  - {id: x, ids: [1, 2], text: hi}\n")
    with pytest.raises(UserError, match=r"prompts\[0\]: needs exactly one of text, file, chat, ids, ids_file"):
        C.load_entries(str(tmp_path / "bad2.yaml"))
    (tmp_path / "bad3.yaml").write_text("prompts:\n  - {id: x, text: short, chunks: 512}\n")
    with pytest.raises(UserError, match=r"prompts x: chunks: 512, but the text is only \d+ tokens"):
        C.tokenize(str(tmp_path / "bad3.yaml"), "smollm2", tok, "tokenizer")


def test_a_window_over_an_ids_corpus_captures_exactly_those_rows(tmp_path, tiny_model):
    (tmp_path / "c.yaml").write_text(
        dedent("""
        name: window
        prompts:
          - {id: ids, ids: [504, 3458, 314, 260, 1881, 28, 7110, 30, 506, 3119, 2051, 1049, 1928, 346, 429, 47, 29]}
          - {id: long, text: "The museum opens at nine, but the queue starts forming long before that,
            and by half past eight it reaches the corner.", chunks: 12}
          - {id: short, ids: [1, 2, 3]}
    """)
    )
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        tmp_path / "c.yaml",
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
    )
    body = spec.read_text().replace("stride: 16\n", "positions: {from: 4, to: -2, stride: 3}\n")
    spec.write_text(body)
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    keep = Positions(stride=3, start=4, stop=-2, last=False)
    prompts = {p["name"]: p for p in sql(wh, "select name, prompt_id, token_ids from prompts")}
    assert set(prompts) >= {"ids", "short"} and any(n.startswith("long-c") for n in prompts)
    rows = sql(wh, "select cell_id, prompt_id, position, next_token_id from logits order by all")
    for cell in {r["cell_id"] for r in rows}:
        for name, p in prompts.items():
            mine = [r for r in rows if r["cell_id"] == cell and r["prompt_id"] == p["prompt_id"]]
            assert [r["position"] for r in mine] == keep.of(len(p["token_ids"])), (cell, name)
            assert [r["next_token_id"] for r in mine] == [p["token_ids"][q + 1] for q in keep.of(len(p["token_ids"]))]
    assert not [r for r in rows if r["prompt_id"] == prompts["short"]["prompt_id"]]  # 3 ids: the window misses it
    cells = sql(wh, "select positions, tokenizer_parity from cells")
    assert {json.dumps(json.loads(c["positions"]), sort_keys=True) for c in cells} == {keep.to_json()}
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    n = sql(wh, "select count(*) as n, count(distinct position) as q from metrics")[0]
    assert n["n"] == sum(len(keep.of(len(p["token_ids"]))) for p in prompts.values())


def test_round_bf16_matches_torch_and_its_floor_matches_the_metric_kernel():
    import torch

    from analysis.metrics import row_metrics
    from store.floors import bf16_floor
    from store.warehouse import round_bf16, shift_by_max, widen

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 4099)) * 4 + 20).astype(np.float32)  # (rows, vocab), logits far from 0
    x[3, 7] = -np.inf  # a masked token survives the shift
    bits = round_bf16(x)
    shifted = x - x.max(-1, keepdims=True)
    assert np.array_equal(bits, torch.from_numpy(shifted).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    stored = widen(bits)
    assert stored[3, 7] == -np.inf and (stored.max(-1) == 0).all()
    floor = bf16_floor(shift_by_max(x)[0], stored)  # what the actor records
    kernel = row_metrics(x, stored)["kld"]  # the analysis kernel, float64
    fin = np.isfinite(x).all(-1)  # the kernel flags a row with -inf as not finite; the floor still counts it
    assert np.allclose(floor[fin], kernel[fin], rtol=1e-4, atol=0) and (floor > 0).all()
    unshifted = row_metrics(x, widen(torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)))
    assert unshifted["kld"][fin].mean() > 10 * floor[fin].mean()  # why the row max is subtracted first
    nan = x.copy()
    nan[1, 0] = np.nan
    assert np.isnan(bf16_floor(shift_by_max(nan)[0], widen(round_bf16(nan)))[1])
    assert np.isnan(widen(round_bf16(nan))[1, 0])


def test_store_bf16_records_each_rows_floor_and_analysis_carries_it(tmp_path, tiny_model, short_corpus):
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=2,
        store="bf16",
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    cells = sql(wh, "select cell_id, logits_dtype, storage, bit_reproducible, rows_per_repeat, repeats from cells")
    assert len(cells) == 2 and {c["logits_dtype"] for c in cells} == {"bf16"}
    floors = {}
    for c in cells:
        st = json.loads(c["storage"])
        assert st["store"] == "bf16" and not st["lossless"] and c["bit_reproducible"]
        assert st["rows_measured"] == c["rows_per_repeat"] * c["repeats"]
        assert 1e-7 < st["storage_floor"] < 1e-4 and st["storage_floor"] <= st["storage_floor_max"]
        floors[c["cell_id"]] = st["storage_floor"]
    top = sql(wh, "select max(list_max(logits)) as m, min(list_max(logits)) as n, min(abs(shift)) as s from logits")[0]
    assert top["m"] == top["n"] == 0.0 and top["s"] > 0  # every stored row is shifted by its max, which is kept
    # the raw logits come back as logits + shift, within half a bf16 step of the engine's own
    from backends.hf_backend import HFBackend
    from common.stack import StackDesc
    from store.stream import Rows, shard_index
    from store.warehouse import Warehouse

    eager = next(c["cell_id"] for c in cells if ".eager." in c["cell_id"])
    p = sql(wh, "select prompt_id, token_ids from prompts order by n_tokens desc limit 1")[0]
    idx = shard_index(Warehouse(wh), eager, 0)
    got = Rows(Warehouse(wh), idx, p["prompt_id"], 64).take(np.arange(len(idx.prompts[p["prompt_id"]].positions)))
    be = HFBackend(StackDesc.of("hf", "fp32", "eager"), str(tiny_model), 1)
    be.load()
    want = be.forward(p["token_ids"], idx.prompts[p["prompt_id"]].positions.tolist())  # (rows, vocab)
    step = np.abs(want - want.max(-1, keepdims=True)) * 2.0**-8 + 1e-4  # bf16: 8 significant bits
    assert got.shape == want.shape and (np.abs(got - want) <= step).all()
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    got = sql(wh, "select cell_id, min(storage_floor) as lo, max(storage_floor) as hi from metrics group by all")
    ref = sql(wh, "select cell_id from cells where is_reference")[0]["cell_id"]
    assert len(got) == 2 and all(g["lo"] == g["hi"] for g in got)
    for g in got:  # each comparison's floor: the reference's own plus the stack's own
        assert abs(g["lo"] - (floors[ref] + floors[g["cell_id"]])) < 1e-18, (got, floors)


def test_the_fast_bf16_floor_agrees_with_the_float64_one_on_real_rows(reference_model):
    """bf16_floor (float32 elementwise, what the actor runs) against the float64 metric kernel on real SmolLM2 rows."""
    from analysis.metrics import row_metrics
    from backends.hf_backend import HFBackend
    from common.stack import StackDesc
    from store.floors import bf16_floor
    from store.warehouse import round_bf16, shift_by_max, to_bf16, widen

    be = HFBackend(StackDesc.of("hf", "fp32", "sdpa"), reference_model.hf_dir, 2)
    be.load()
    ids = list(range(1000, 1100))
    x = be.forward(ids, list(range(0, 100, 3)))  # (34, 49152) float32
    z, _ = shift_by_max(x)
    fast, exact = bf16_floor(z, widen(to_bf16(z))), row_metrics(x, widen(round_bf16(x)))["kld"]
    assert np.allclose(fast, exact, rtol=1e-4, atol=0) and 1e-7 < exact.mean() < 1e-4, (fast[:4], exact[:4])


@pytest.mark.parametrize("vocab", [4099, 262144])  # several rows per cache block, and one
def test_storage_keep_rounds_as_round_bf16_and_its_floor_is_the_float64_one(vocab):
    """Storage.keep (the fused pass a capture runs) against round_bf16 and the float64 metric
    kernel, with a masked token, a NaN and an infinite logit among the rows (those go the general way)."""
    from analysis.metrics import row_metrics
    from store.floors import Storage
    from store.warehouse import round_bf16, widen

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, vocab)) * 3 + 15).astype(np.float32)  # (rows, vocab)
    x[1, 3], x[3, 0], x[4, 2] = -np.inf, np.nan, np.inf
    st = Storage("bf16")
    stored, shift = st.keep(x)
    assert np.array_equal(stored, round_bf16(x))
    clean = np.isfinite(x).all(-1)  # rows 0, 2, 5
    assert np.array_equal(shift[clean], x[clean].max(-1)) and shift[3] == shift[4] == 0
    exact = row_metrics(x[clean], widen(stored[clean]) + shift[clean, None])["kld"]
    assert st.rows == 4 and st.nonfinite == 2  # the masked row's floor counts; NaN and +inf rows do not
    masked = Storage("bf16")
    masked.keep(x[1:2])
    assert np.isclose(st.floor_sum - masked.floor_sum, exact.sum(), rtol=1e-4, atol=0)
    assert 1e-7 < exact.mean() < 1e-4


def test_store_bf16_keeps_a_bf16_stacks_rows_as_they_are(tmp_path, tiny_model, short_corpus):
    """A bf16 stack's rows are bf16 already: `store: bf16` stores them as the engine gave them (no
    shift, no rounding), its floor is 0, and its rows hash as `store: native`'s do."""
    got = {}
    for store in ("native", "bf16"):
        spec = write_spec(
            tmp_path / f"{store}.yaml",
            tiny_model,
            short_corpus,
            dtypes=["bf16"],
            attention=["eager"],
            repeats=1,
            store=store,
        )
        r = run_cli("run", str(spec), "--warehouse", str(tmp_path / store), "--executor", "local")
        assert r.returncode == 0, r.stderr[-3000:]
        cell = sql(tmp_path / store, "select storage from cells")[0]
        rows = sql(tmp_path / store, "select prompt_id, position, row_hash, shift from logits order by all")
        got[store] = json.loads(cell["storage"]), rows
    storage, rows = got["bf16"]
    assert storage["store"] == "bf16" and storage["lossless"] and storage["storage_floor"] == 0.0
    assert storage["rows_measured"] == 0 and {r["shift"] for r in rows} == {None}
    assert len(rows) > 20 and rows == got["native"][1]
