"""Rows streamed out of the forward (Backend.forward_blocks, actors/capture.py RowWork.stream,
ShardWriter.add_blocks): a long prompt's rows stored block by block are the rows the same capture
stores from the rows held whole, bit for bit, and the capture's peak memory follows the block, not
the prompt. The real llama.cpp and HF backends on SmolLM2 cut to a few layers, the real writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import backends.base as base
from actors.capture import capture_shard
from common.positions import Positions
from common.stack import StackDesc
from store.prompt_rows import PromptRows
from store.warehouse import ShardWriter, Warehouse, native_rows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(7)
LONG = [1] + RNG.integers(100, 40000, 1499).tolist()  # 1,500 tokens: two 512-token pieces and a part
HALF = Positions(stride=1, start="half")  # llama-perplexity's scored half (and the last position)


def _load(cls, dtype, attention, model_dir):
    be = cls(StackDesc.of(cls.engine, dtype, attention), str(model_dir), 2)
    be.load()
    return be


@pytest.fixture(scope="module")
def llama(tiny_model):
    from backends.llamacpp_backend import LlamaCppBackend

    be = _load(LlamaCppBackend, "f16", "default", tiny_model)
    yield be
    be.close()


def _shard(be, wh: Path, cell: str, prompts, store: str, observe=None) -> tuple[dict, np.ndarray, list]:
    Warehouse(wh).create()
    got = capture_shard(be, ShardWriter(str(wh), "run", cell, 0), prompts, HALF, store=store, observe=observe)
    import pyarrow.parquet as pq

    t = pq.read_table(wh / got["path"])
    return got, native_rows(t), t.select(["prompt_id", "position", "row_hash", "shift"]).to_pylist()


def test_llamacpp_pieces_are_the_whole_forward_bit_for_bit(llama, monkeypatch):
    pos = HALF.of(len(LONG))
    whole = llama.forward(LONG, pos).copy()  # (rows, vocab), one llama_decode of n_batch 2048
    monkeypatch.setattr(base, "STREAM_BYTES", 100 * 4 * llama.vocab_size())  # streamed past 100 rows
    monkeypatch.setattr(base, "BLOCK_BYTES", 200 * 4 * llama.vocab_size())  # in blocks of 200
    assert llama.streams(len(pos))
    blocks = [b.copy() for b in llama.forward_blocks(LONG, pos)]
    # calls 0..949 (ubatches of 512 and 438), 950..1149, 1150..1349, 1350..1499
    assert [len(b) for b in blocks] == [200, 200, 200, 150]
    assert np.array_equal(np.concatenate(blocks).view(np.uint32), whole.view(np.uint32))


@pytest.mark.parametrize("store", ["native", "bf16"])
def test_a_streamed_shard_holds_the_rows_held_whole(llama, tmp_path, monkeypatch, store):
    prompts = [("short", LONG[:40]), ("long", LONG), ("after", LONG[:300])]
    got_whole, whole, meta_whole = _shard(llama, tmp_path / "whole", "c", prompts, store)
    monkeypatch.setattr(base, "STREAM_BYTES", 100 * 4 * llama.vocab_size())
    got, streamed, meta = _shard(llama, tmp_path / "streamed", "c", prompts, store)
    assert got["rows"] == got_whole["rows"] == len(meta) == 20 + 750 + 150
    assert meta == meta_whole  # the same positions, row hashes and shifts, in the same order
    assert streamed.dtype == whole.dtype and np.array_equal(streamed, whole)
    assert got["storage"] == got_whole["storage"]  # the same bf16 floor over the same rows


def test_rows_measured_as_they_stream_are_measured_as_whole(llama, tiny_model, tmp_path, monkeypatch):
    """The in-capture measurement against a reference (InlineMetrics) reads the reference prompt on
    from block to block: the same metrics as from the rows held whole."""
    from actors.inline_metrics import InlineMetrics
    from backends.llamacpp_backend import LlamaCppBackend

    wh, prompts = tmp_path / "wh", [("long", LONG), ("short", LONG[:64])]
    _shard(llama, wh, "ref", prompts, "bf16")
    q8 = _load(LlamaCppBackend, "q8_0", "default", tiny_model)
    tables = []
    for cell, limit in (("whole", base.STREAM_BYTES), ("streamed", 100 * 4 * q8.vocab_size())):
        monkeypatch.setattr(base, "STREAM_BYTES", limit)
        m = InlineMetrics(str(wh), "ref", cell, 0)
        _shard(q8, wh, cell, prompts, "bf16", observe=m.observe)
        out = m.outcome()
        assert "error" not in out, out
        tables.append(out["table"].drop(["cell_id"]).to_pylist())
    q8.close()
    assert len(tables[0]) == 750 + 32 and tables[0] == tables[1]
    assert 0 < np.mean([r["kld"] for r in tables[0]]) < 1e-2  # q8_0 against f16: small, not nothing


def test_hf_blocks_are_the_model_head_over_one_prefill(tiny_model, monkeypatch):
    """HF: the first block is the model's own forward; the others the LM head over the same
    prefill's last hidden state, within a matmul's rounding of the rows held whole."""
    from backends.hf_backend import HFBackend

    be = _load(HFBackend, "fp32", "sdpa", tiny_model)
    ids, pos = LONG[:600], HALF.of(600)
    whole = be.forward(ids, pos).copy()
    monkeypatch.setattr(base, "STREAM_BYTES", 64 * 4 * be.vocab_size())
    monkeypatch.setattr(base, "BLOCK_BYTES", 64 * 4 * be.vocab_size())
    blocks = [b.copy() for b in be.forward_blocks(ids, pos)]
    assert [len(b) for b in blocks] == [64] * 4 + [44]  # positions 300..599
    assert be.stream_head == "lm_head over the last hidden state"
    assert np.array_equal(blocks[0], whole[:64])  # the model's own forward
    assert np.abs(np.concatenate(blocks) - whole).max() < 1e-4  # fp32 logits of magnitude ~10-30


def test_hf_head_it_cannot_reproduce_takes_a_forward_per_block(tiny_model, monkeypatch):
    from backends import hf_stream
    from backends.hf_backend import HFBackend

    be = _load(HFBackend, "fp32", "eager", tiny_model)
    ids, pos = LONG[:300], HALF.of(300)
    whole = be.forward(ids, pos).copy()
    monkeypatch.setattr(base, "STREAM_BYTES", 64 * 4 * be.vocab_size())
    monkeypatch.setattr(base, "BLOCK_BYTES", 64 * 4 * be.vocab_size())
    monkeypatch.setattr(hf_stream, "_head", lambda model, h: model.lm_head(h) + 1.0)  # not the model's head
    got = np.concatenate([b.copy() for b in be.forward_blocks(ids, pos)])
    assert be.stream_head == "a forward per block"
    assert np.abs(got - whole).max() < 1e-4


PEAK = """
import json, resource, sys
sys.path.insert(0, {repo!r})
from actors.capture import capture_shard
from backends.llamacpp_backend import LlamaCppBackend
from common.positions import Positions
from common.stack import StackDesc
from store.warehouse import ShardWriter, Warehouse
n, wh = int(sys.argv[1]), sys.argv[2]
be = LlamaCppBackend(StackDesc.of("llamacpp", "f16", "default"), {model!r}, 2)
be.load()
ids = [1] + [100 + (i * 7919) % 39000 for i in range(n - 1)]
Warehouse(wh).create()
got = capture_shard(be, ShardWriter(wh, "run", "c", 0), [("p", ids)], Positions(stride=1, start="half"), store="bf16")
status = open("/proc/self/status").read()
hwm = int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps({{"rows": got["rows"], "peak": hwm, "vocab": be.vocab_size()}}))
"""


def _peak(tiny_model, n: int, tmp_path) -> dict:
    script = PEAK.format(repo=str(REPO), model=str(tiny_model))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(n), str(tmp_path / f"wh{n}")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_does_not_follow_the_context(tiny_model, tmp_path):
    """A capture of one prompt of 2,048 and of 8,192 tokens, its second half kept (llama-perplexity's
    rows), each in a fresh process. The shorter's 1,024 rows (192 MB of float32) are under
    STREAM_BYTES and held whole; the longer's 4,096 are streamed. Its peak (VmHWM) may grow by
    llama.cpp's own context for 6,144 more tokens, not by its rows: held whole they would add 3,072
    x 49,152 x 10 bytes (llama.cpp's float32 outputs, the capture's float32 copy, the bf16 it
    stores), 1.5 GB. The bound, 256 MB: the KV cache (2 layers x 3 KV heads x 64 x 2 x 2 bytes,
    1.5 KB a token: 9 MB) and the attention scores of a 512-token ubatch over 8,192 cells (9 heads
    x 4 bytes: 151 MB without flash attention), the rest slack for the allocator. Measured on a
    2-core AMD EPYC (AVX2): 829 MiB at 2,048 tokens, 739 MiB at 8,192."""
    short, long = _peak(tiny_model, 2048, tmp_path), _peak(tiny_model, 8192, tmp_path)
    assert (short["rows"], long["rows"]) == (1024, 4096)
    whole = (long["rows"] - short["rows"]) * long["vocab"] * 10
    grew = long["peak"] - short["peak"]
    print(f"peak {short['peak'] / 2**20:.0f} MiB at 2,048 tokens, {long['peak'] / 2**20:.0f} MiB at 8,192")
    assert grew < 256 << 20 < whole / 4, (short, long)


def test_a_prompt_sent_in_several_row_groups_reads_as_one(tmp_path):
    """A node that cannot see the warehouse sends a long prompt to the depot in messages of
    MESSAGE_BYTES, each its own row group (ShardWriter.add_encoded): the readers take the prompt's
    consecutive row groups as one prompt, pages and Arrow alike, every row checked."""
    from store.stream import Rows, shard_index
    from store.verify import verify_shard
    from store.warehouse import encode_rows, rows_table

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((50, 1000)).astype(np.float32)  # (rows, vocab)
    wh = tmp_path / "wh"
    Warehouse(wh).create()
    w = ShardWriter(str(wh), "run", "c", 0)
    w.add(PromptRows("before", [0, 1], [5, 6], rows[:2]))
    for a in (0, 20, 40):  # three messages of one prompt, as RemoteShard.add cuts it
        pos = list(range(a, min(a + 20, 50)))
        part = PromptRows("long", pos, [7] * len(pos), rows[a : a + 20])
        w.add_encoded(encode_rows(rows_table("run", "c", 0, part)))
    w.add(PromptRows("after", [3], [None], rows[:1]))
    w.commit()
    index = shard_index(Warehouse(wh), "c", 0)
    assert index.prompts["long"].groups == [1, 2, 3] and len(index.prompts["long"].positions) == 50
    for batch in (7, 64):  # batches that cross row groups' ends, and one larger than any
        got = Rows(Warehouse(wh), index, "long", batch).take(np.arange(50))
        assert np.array_equal(got, rows)
    assert verify_shard(Warehouse(wh), "c", 0, 53)[0] == []


def test_a_prompt_in_row_groups_apart_is_damage(tmp_path):
    from store.stream import shard_index
    from store.verify import DamagedShard

    rows = np.ones((4, 10), np.float32)
    wh = tmp_path / "wh"
    Warehouse(wh).create()
    w = ShardWriter(str(wh), "run", "c", 0)
    w.add(PromptRows("p", [0, 1], [1, 1], rows[:2]))
    w.add(PromptRows("q", [0], [1], rows[:1]))
    w.add(PromptRows("p", [2, 3], [1, 1], rows[2:]))
    w.commit()
    with pytest.raises(DamagedShard, match="row groups that do not follow each other"):
        shard_index(Warehouse(wh), "c", 0)
