"""The pinned SDPA kernels of the HF engine (backends/hf_sdpa.py) where PyTorch refuses a call:
a length refused (fed a longer prefix, or the prompt's rows left out and said so), grouped-query
attention refused (the KV heads repeated), and the logits' host buffers (backends/torch_rows.py).

PyTorch on CPU refuses no length and no GQA call, so a stand-in for
torch.nn.functional.scaled_dot_product_attention raises PyTorch's own message where the H200's
kernels did; the real backend, capture and shard writer run around it (SmolLM2 cut to 2 layers).
The `gpu` tests run the real kernels on CUDA (LOGIT_MATRIX_GPU_MODEL: an HF model directory)."""

from __future__ import annotations

import json
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.capture import capture_shard
from backends import hf_sdpa, torch_rows
from backends.base import LengthRefused, SkipCell
from backends.hf_backend import HFBackend
from common.errors import UserError
from common.positions import Positions
from common.stack import StackDesc
from matrix.run.outcome import refusals_column
from matrix.run.runner import Resume, complete_shards
from store.prompt_rows import PromptRows
from store.warehouse import ShardWriter, Warehouse, native_rows, widen

REFUSAL = "No available kernel. Aborting execution."  # PyTorch's RuntimeError where no allowed kernel takes a call
IDS = [1, 504, 3365, 8187, 418, 3732, 28, 564, 260, 9726, 5001, 15407, 1326, 1069, 9043, 31, 2] * 3
# every 32nd position from 0, not the last: a 20-token prompt keeps row 0 alone, so 1 token is fed
KEEP = Positions(stride=32, start=0, stop=None, last=False)
SHORTEST = 8  # the stand-in refuses fewer query tokens than this
PROMPTS = [
    ("longer", IDS[:20]),  # needs 1 token, refused at 1, 2 and 4; fed 8
    ("refused", IDS[20:25]),  # 5 tokens in all: every length refused, its row left out
    ("taken", IDS[5:45]),  # rows 0 and 32: 33 tokens fed, taken as they are
]


def load(model_dir, attention="sdpa_math", dtype="fp32") -> HFBackend:
    be = HFBackend(StackDesc.of("hf", dtype, attention), str(model_dir), 1)
    be.load()
    return be


def refusing(monkeypatch, refuses) -> None:
    """scaled_dot_product_attention raising PyTorch's refusal where refuses(query, kwargs) says so."""
    real = torch.nn.functional.scaled_dot_product_attention

    def kernel(q, *a, **k):  # q: (batch, heads, T, head_dim)
        if refuses(q, k):
            raise RuntimeError(REFUSAL)
        return real(q, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", kernel)


def capture(be, wh, cell, repeat=0, prompts=PROMPTS) -> dict:
    if not Warehouse(wh).check():
        Warehouse(wh).create()
    return capture_shard(be, ShardWriter(str(wh), "run", cell, repeat), prompts, KEEP, store="native")


def rows_by_prompt(wh, cell, repeat=0) -> dict[str, tuple[list[int], np.ndarray]]:
    t = Warehouse(wh).read_shard(cell, repeat)
    native, pids, pos = native_rows(t), t.column("prompt_id").to_pylist(), t.column("position").to_pylist()
    return {
        p: ([q for q, pp in zip(pos, pids) if pp == p], native[[i for i, pp in enumerate(pids) if pp == p]])
        for p in dict.fromkeys(pids)
    }


@pytest.fixture(scope="module")
def refused_captures(tiny_model, tmp_path_factory):
    """The same prompts captured by sdpa_math as it is, and under a stand-in that refuses fewer than
    SHORTEST query tokens (two repeats)."""
    wh = tmp_path_factory.mktemp("refused") / "wh"
    be = load(tiny_model)  # load()'s 4-token check runs before the stand-in
    plain = capture(be, wh, "plain")
    with pytest.MonkeyPatch.context() as mp:
        refusing(mp, lambda q, k: q.shape[-2] < SHORTEST)
        got = [capture(be, wh, "refusing", r) for r in (0, 1)]
        alone = be.forward(IDS[:8], [0])  # (1, vocab): the longer prompt's row, fed 8 tokens directly
    return SimpleNamespace(wh=wh, be=be, plain=plain, got=got, alone=alone)


def test_a_refused_length_is_fed_longer_and_a_prompt_refused_at_every_length_loses_its_rows(refused_captures):
    c = refused_captures
    plain, refused = rows_by_prompt(c.wh, "plain"), rows_by_prompt(c.wh, "refusing")
    assert list(refused) == ["longer", "taken"] and list(plain) == ["longer", "refused", "taken"]
    # taken: the same feed under the same kernel, so the same bits
    assert refused["taken"][0] == plain["taken"][0] == [0, 32]
    assert np.array_equal(refused["taken"][1], plain["taken"][1])
    # longer: row 0 from 8 tokens is exactly what the engine gives fed 8 tokens; against the
    # 1-token feed it is the same row (causal: row 0 reads token 0 alone), but the projections' and
    # the LM head's matmuls run at another M, so their sums may round apart: close, not equal
    assert np.array_equal(refused["longer"][1], c.alone)
    np.testing.assert_allclose(refused["longer"][1], plain["longer"][1], rtol=0, atol=1e-4)
    part = c.got[0]["length_refusals"]
    longer = part["longer_feeds"]["longer"]
    assert (longer["needed"], longer["fed"], longer["refused"]) == (1, 8, [1, 2, 4]) and list(part["longer_feeds"]) == [
        "longer"
    ]
    assert longer["reason"].endswith(f"at 4 tokens: {REFUSAL}")
    assert set(part["skipped"]) == {"refused"} and part["skipped_rows"] == 1
    skipped = part["skipped"]["refused"]
    assert skipped["rows"] == 1 and skipped["refused"] == [1, 2, 4, 5]
    assert skipped["reason"].startswith("attention sdpa_math: PyTorch") and skipped["reason"].endswith(
        f"on cpu (float32) at 5 tokens: {REFUSAL}"
    )
    assert c.plain["length_refusals"] is None and c.got[0]["rows"] == c.plain["rows"] - 1


def test_both_repeats_refuse_the_same_rows_and_the_record_says_so_once(refused_captures):
    c = refused_captures
    wh = Warehouse(c.wh)
    assert wh.shard_hashes("refusing", 0) == wh.shard_hashes("refusing", 1)  # bit-reproducible: like with like
    assert c.got[0]["length_refusals"] == c.got[1]["length_refusals"]
    rows, refused = wh.shard_tally("refusing", 0)
    assert rows == 3 and set(refused) == {"refused"}  # the footer names the prompt whose rows are not there
    assert wh.shard_tally("plain", 0) == (4, {})
    one = json.loads(refusals_column({0: c.got[0]["length_refusals"], 1: c.got[1]["length_refusals"]}))
    assert one["repeats"] == [0, 1] and one["skipped_rows"] == 1
    apart = json.loads(refusals_column({0: c.got[0]["length_refusals"], 1: None}))
    assert set(apart) == {"by_repeat"} and apart["by_repeat"]["1"] is None
    assert refusals_column({0: None, 1: None}) is None


def test_a_resumed_run_counts_a_shard_without_the_refused_rows_complete(refused_captures, tmp_path):
    """matrix/run/runner.py complete_shards: the rows the footer says were refused are not expected;
    a shard that lacks rows without saying so is still damaged."""
    c = refused_captures
    plan = SimpleNamespace(
        spec=SimpleNamespace(positions=KEEP, keep_rows="all"),
        models={"tiny": SimpleNamespace(prompts=[SimpleNamespace(prompt_id=p, token_ids=ids) for p, ids in PROMPTS])},
    )
    cell = SimpleNamespace(cell_id="refusing", model="tiny", max_tokens=None, extras=())
    wh = Warehouse(c.wh)
    assert complete_shards(plan, wh, cell, Resume(), print) == {0, 1}
    assert complete_shards(plan, wh, cell, Resume(recapture_damaged=True), print) == {0, 1}
    w = ShardWriter(str(c.wh), "run", "silent", 0)  # the same rows, no footer
    for p, (pos, rows) in rows_by_prompt(c.wh, "refusing").items():
        w.add(PromptRows(p, pos, [None] * len(pos), rows))
    w.commit()
    with pytest.raises(UserError, match="3 rows, the cell has 4 per repeat"):
        complete_shards(plan, wh, SimpleNamespace(**{**vars(cell), "cell_id": "silent"}), Resume(), print)


def test_analyze_measures_what_both_sides_have(refused_captures, tmp_path):
    """A candidate lacking rows the reference has, and a reference lacking rows a candidate has:
    `matrix analyze` measures the rows both have and notes the others as unaligned."""
    import shutil

    from matrix import api
    from store import rows as R

    wh = tmp_path / "wh"
    shutil.copytree(refused_captures.wh, wh)

    def cell(cid, ref, rows):
        facts = {"model": "tiny", "engine": "hf", "dtype": "fp32", "attention": "sdpa_math", "vocab_size": 49152}
        return R.cell_row(
            cid, "run", "done", repeats=1, rows_per_repeat=rows, is_reference=cid == ref, reference_cell_id=ref, **facts
        )

    store = Warehouse(str(wh))
    for ref, cand in (("plain", "refusing"), ("refusing", "plain")):
        store.write_rows("cells", "plain", [cell("plain", ref, 4)])
        store.write_rows("cells", "refusing", [cell("refusing", ref, 3)])
        lines = []
        api.analyze(str(wh), workers=1, force=True, centroid="none", log=lines.append)
        con = api.connect(str(wh))
        got = con.sql(f"select prompt_id, position, kld from metrics where cell_id = '{cand}' order by all").fetchall()
        con.close()
        assert [(p, q) for p, q, _ in got] == [("longer", 0), ("taken", 0), ("taken", 32)], got
        assert got[1][2] == got[2][2] == 0.0  # the rows both took as they are: the same bits
        assert 0 <= got[0][2] < 1e-8  # the row fed 8 tokens against the row fed 1
        if ref == "refusing":  # the candidate's row the reference lacks is left out, and said so
            assert any("1 of 4 row(s) have no row of reference refusing" in m for m in lines), lines


def test_analyze_cuts_its_pieces_from_every_repeats_prompts(monkeypatch):
    """A repeat holding a prompt's rows that the first lacks: `matrix analyze`'s pieces (cut by
    prompt) still hold that prompt, so its rows are measured (analysis/units.py)."""
    from analysis import units

    monkeypatch.setattr(units, "PIECE_ROWS", 2)  # a piece per prompt
    digests = {
        "ref": {0: ("r", {"a": 2, "b": 2, "c": 2})},
        "c": {0: ("x", {"a": 2, "c": 2}), 1: ("y", {"a": 2, "b": 2, "c": 2})},
    }
    from store.cell_rows import CellRow

    axes = {"model": "m", "engine": "hf", "dtype": "fp32", "attention": "sdpa", "status": "done"}
    cells = [CellRow.of({"cell_id": "c", "repeats": 2, **axes}), CellRow.of({"cell_id": "ref", "repeats": 1, **axes})]
    (u,) = [u for u in units._cell_units(cells, cells[1], digests) if u.name == "c"]
    assert sorted(p for piece in u.pieces for p in piece) == ["a", "b", "c"] and u.rows == 10


def test_length_refused_travels_through_pickle_and_is_a_skip_cell():
    e = pickle.loads(pickle.dumps(LengthRefused("no kernel at 1 token", 1)))
    assert isinstance(e, SkipCell) and str(e) == "no kernel at 1 token" and e.tokens == 1


def test_kv_expanded_attention_is_sdpa_bit_for_bit_on_cpu(tiny_model):
    """transformers' sdpa with enable_gqa (what it passes without a mask) against the registered
    function's repeated KV heads, under the math and flash kernels PyTorch has on CPU: measured
    bit-identical, as the math kernel itself repeats the heads for GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    be = load(tiny_model, "sdpa")
    module = be.model.model.layers[0].self_attn
    assert module.num_key_value_groups == 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 37, 64, generator=g) for h in (9, 3, 3))  # (batch, heads, T, head_dim)
    for kernel in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel([kernel]):
            a, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)
            b, _ = hf_sdpa.kv_expanded_attention(module, q, k, v, None, scaling=0.125)
        assert a.shape == b.shape == (1, 37, 9, 64) and torch.equal(a, b), kernel


def test_a_kernel_refusing_grouped_query_attention_runs_with_the_kv_heads_repeated(tiny_model, monkeypatch):
    """load()'s check refused with enable_gqa (PyTorch 2.11's memory-efficient kernel on an H200)
    tries again with the KV heads repeated; the settings say so, and the rows are the grouped
    call's bit for bit (math on CPU)."""
    pos = Positions.every(8).of(len(IDS))
    want = load(tiny_model).forward(IDS, pos)
    refusing(monkeypatch, lambda q, k: k.get("enable_gqa", False))
    be = load(tiny_model)
    s = be.settings()
    assert s["attention"] == hf_sdpa.EXPANDED
    assert {k: s[k] for k in ("sdpa_kernel", "kv_heads_expanded", "query_heads", "kv_heads")} == {
        "sdpa_kernel": "MATH",
        "kv_heads_expanded": True,
        "query_heads": 9,
        "kv_heads": 3,
    }
    assert np.array_equal(be.forward(IDS, pos), want)


def test_a_kernel_refusing_the_dtype_still_skips_the_cell(tiny_model, monkeypatch):
    """Refused at load()'s 4 tokens both ways: the cell is skipped (a SkipCell, not a length
    refusal), both reasons said, and the model is left at transformers' sdpa."""
    refusing(monkeypatch, lambda q, k: True)
    be = HFBackend(StackDesc.of("hf", "fp32", "sdpa_flash"), str(tiny_model), 1)
    with pytest.raises(SkipCell) as e:
        be.load()
    assert type(e.value) is SkipCell
    assert "FLASH_ATTENTION SDPA kernel for this model on cpu (float32) at 4 tokens" in str(e.value)
    assert "and with its 3 KV heads repeated for its 9 query heads: " in str(e.value)
    assert be.model.config._attn_implementation == "sdpa"


def test_logits_on_the_host_are_handed_back_without_a_copy_and_the_ring_copies_bit_for_bit(tiny_model):
    """On the CPU forward() hands back the model's own logits (a copy would add one: measured in
    docs/engines.md); copy_into, the GPU path, gives the same bits into the ring's buffers, each
    reused every second call."""
    pos = Positions.every(8).of(len(IDS))
    for dtype in ("fp32", "bf16"):
        be = load(tiny_model, dtype=dtype)
        fresh = be.forward(IDS, pos)  # (rows, vocab): keep_outputs(0)
        be.keep_outputs(2)
        got = [be.forward(IDS, pos) for _ in range(3)]
        assert all(np.array_equal(g, fresh) for g in got) and not np.shares_memory(got[0], got[2])
        assert be._outputs.bufs == [None, None]  # the ring holds nothing on the CPU
        with torch.inference_mode(), hf_sdpa.pinned(torch, be.model, "sdpa_math", len(IDS)):  # forward()'s call
            out = be.model(input_ids=torch.tensor([IDS]), logits_to_keep=torch.tensor(pos), use_cache=False)
        logits = out.logits[0]  # (rows, vocab), the model's own tensor
        ring = torch_rows.host_ring(torch, 2, pinned=False)
        out = [torch_rows.copy_into(torch, logits, ring) for _ in range(3)]
        assert all(np.array_equal(o, fresh) for o in out) and out[0].dtype == fresh.dtype
        at = [o.__array_interface__["data"][0] for o in out]
        assert at[0] == at[2] != at[1]  # two buffers, handed out in turn
        be.keep_outputs(0)


GPU_MODEL = os.environ.get("LOGIT_MATRIX_GPU_MODEL")
needs_cuda = pytest.mark.skipif(
    not (GPU_MODEL and torch.cuda.is_available()), reason="needs CUDA and LOGIT_MATRIX_GPU_MODEL"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "f16"])
@pytest.mark.parametrize("attention", ["sdpa_efficient", "sdpa_cudnn"])
def test_cuda_kernels_capture_with_their_refusals_recorded(attention, dtype, tmp_path):
    """On CUDA: memory-efficient attention runs at every dtype (with the KV heads repeated where
    PyTorch refuses GQA for it); cuDNN at bf16 and f16, its 1-token refusals fed longer; two
    repeats hold the same rows. A kernel PyTorch lacks at a dtype skips the cell."""
    be = HFBackend(StackDesc.of("hf", dtype, attention, device="cuda"), GPU_MODEL, 8)
    try:
        be.load()
    except SkipCell as e:
        assert type(e) is SkipCell and "at 4 tokens" in str(e)
        pytest.skip(f"{attention} {dtype}: {e}")
    s = be.settings()
    print(attention, dtype, {k: s.get(k) for k in ("attention", "kv_heads_expanded", "query_heads", "kv_heads")})
    got = [capture(be, tmp_path / "wh", "c", r) for r in (0, 1)]
    print(attention, dtype, got[0]["rows"], got[0]["length_refusals"])
    assert got[0]["length_refusals"] == got[1]["length_refusals"]
    wh = Warehouse(tmp_path / "wh")
    assert wh.shard_hashes("c", 0) == wh.shard_hashes("c", 1)
    rows = rows_by_prompt(tmp_path / "wh", "c")
    assert set(rows) | set((got[0]["length_refusals"] or {}).get("skipped", {})) == {p for p, _ in PROMPTS}
    assert all(np.isfinite(widen(r)).all() for _, r in rows.values())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_logits_land_in_reused_pinned_host_buffers(dtype):
    be = HFBackend(StackDesc.of("hf", dtype, "sdpa", device="cuda"), GPU_MODEL, 8)
    be.load()
    pos = Positions.every(8).of(len(IDS))
    fresh = be.forward(IDS, pos)  # keep_outputs(0): a new pageable array
    be.keep_outputs(2)
    got = [be.forward(IDS, pos) for _ in range(3)]
    assert all(np.array_equal(g, fresh) for g in got)
    at = [g.__array_interface__["data"][0] for g in got]
    assert at[0] == at[2] != at[1]
    view = got[0].view(np.int16) if got[0].dtype == np.uint16 else got[0]
    assert torch.from_numpy(view).is_pinned()
    be.keep_outputs(0)
