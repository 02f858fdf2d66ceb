"""actors/capture.py's Overlap: a prompt's rows rounded, written and measured on a worker thread
while the next prompt's forward runs. The real HF backend (SmolLM2 cut to a few layers) and the
real shard writer; the rows must be the forwards' own, in prompt order, and a failure on either
side must leave no shard and no temp file."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from actors import capture
from actors.capture import capture_shard
from backends.hf_backend import HFBackend
from common.positions import Positions
from common.stack import StackDesc
from store.warehouse import ShardWriter, Warehouse, native_rows

IDS = [1, 504, 3365, 8187, 418, 3732, 28, 564, 260, 9726, 5001, 15407, 1326, 1069, 9043, 31, 2]
PROMPTS = [(f"p{i}", IDS[: 9 + 2 * i] * (1 + i % 2)) for i in range(4)]  # four lengths: 9 to 30 tokens
STRIDE = 4


@pytest.fixture(scope="module")
def be(tiny_model):
    b = HFBackend(StackDesc("hf", "fp32", "eager"), str(tiny_model), 1)
    b.load()
    return b


def _capture(be, wh, cell, prompts=PROMPTS, observe=None, store="bf16"):
    Warehouse(wh).create()
    return capture_shard(be, ShardWriter(str(wh), "run", cell, 0), prompts, STRIDE, store=store, observe=observe)


def _leftovers(wh) -> list[str]:
    return sorted(str(p.relative_to(wh)) for p in (wh / "logits").rglob("*") if p.is_file())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "rows-too-big-kept-on-the-spot"])
def test_the_stored_rows_are_the_forwards_own_in_prompt_order(be, tmp_path, monkeypatch, overlap):
    if not overlap:
        monkeypatch.setattr(capture, "OVERLAP_BYTES", 0)
    seen = []
    out = _capture(be, tmp_path / "wh", "c", observe=lambda pid, pos, stored, shift: seen.append(
        (pid, threading.current_thread().name)), store="native")
    want = "capture-keep" if overlap else threading.current_thread().name
    assert [p for p, _ in seen] == [p for p, _ in PROMPTS]
    assert all(t.startswith(want) for _, t in seen), seen
    table = Warehouse(tmp_path / "wh").read_shard("c", 0)
    assert table.column("prompt_id").to_pylist() == [p for p, ids in PROMPTS for _ in Positions.every(STRIDE).fed(ids)[1]]
    rows = native_rows(table)  # (rows, vocab) float32
    direct = np.concatenate([be.forward(*Positions.every(STRIDE).fed(ids)) for _, ids in PROMPTS])
    assert out["rows"] == len(direct) == len(rows)
    assert np.array_equal(rows.view(np.uint32), direct.view(np.uint32))  # bit for bit


def test_a_forward_failing_while_rows_are_in_flight_leaves_nothing(be, tmp_path):
    bad = PROMPTS[:2] + [("p2", IDS[:5] + [10 ** 7])]  # an id past the vocabulary: the embedding raises
    done = []
    with pytest.raises(IndexError):
        _capture(be, tmp_path / "wh", "c", bad, observe=lambda pid, *_: done.append(pid))
    assert done == ["p0", "p1"]  # the prompt in flight was finished before the writer was aborted
    assert _leftovers(tmp_path / "wh") == []


def test_a_failure_keeping_rows_stops_the_capture_at_the_next_prompt(be, tmp_path, monkeypatch):
    forwards = []
    real = be.forward
    monkeypatch.setattr(be, "forward", lambda ids, pos: forwards.append(len(ids)) or real(ids, pos))

    def observe(pid, *_):
        if pid == "p1":
            raise ValueError("p1 could not be measured")

    with pytest.raises(ValueError, match="p1 could not be measured"):
        _capture(be, tmp_path / "wh", "c", observe=observe)
    assert len(forwards) == 3  # p0, p1, then p2's forward ran beside p1's failing keep; p3 never started
    assert _leftovers(tmp_path / "wh") == []
