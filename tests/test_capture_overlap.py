"""actors/capture.py's Overlap and RowWork: a prompt's rows rounded, written and measured beside
the next prompt's forward, or, for a CPU engine whose threads keep their cores while they wait and
whose capture measures (HF here), written and measured side by side between forwards. The real HF
backend (SmolLM2 cut to a few layers) and the real shard writer; the rows must be the forwards' own,
in prompt order, and a failure on either side must leave no shard and no temp file."""

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

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

IDS = [1, 504, 3365, 8187, 418, 3732, 28, 564, 260, 9726, 5001, 15407, 1326, 1069, 9043, 31, 2]
PROMPTS = [(f"p{i}", IDS[: 9 + 2 * i] * (1 + i % 2)) for i in range(4)]  # four lengths: 9 to 30 tokens
STRIDE = 4


@pytest.fixture(scope="module")
def be(tiny_model):
    b = HFBackend(StackDesc.of("hf", "fp32", "eager"), str(tiny_model), 1)
    b.load()
    return b


def _capture(be, wh, cell, prompts=PROMPTS, observe=None, store="bf16"):
    Warehouse(wh).create()
    return capture_shard(be, ShardWriter(str(wh), "run", cell, 0), prompts, STRIDE, store=store, observe=observe)


def _leftovers(wh) -> list[str]:
    return sorted(str(p.relative_to(wh)) for p in (wh / "logits").rglob("*") if p.is_file())


def as_if_on_a_gpu(be, monkeypatch):
    """The capture asks the backend where row work runs (rows_beside_forward: beside, off the CPU);
    the model stays where it loaded."""
    monkeypatch.setattr(be, "stack", be.stack.replace(device="cuda"))


@pytest.mark.parametrize(
    "mode",
    ["beside", "too-big", "cpu"],
    ids=["beside-the-next-forward", "rows-too-big-kept-on-the-spot", "cpu-engine-between-forwards"],
)
def test_the_stored_rows_are_the_forwards_own_in_prompt_order(be, tmp_path, monkeypatch, mode):
    if mode != "cpu":
        as_if_on_a_gpu(be, monkeypatch)
    if mode == "too-big":
        monkeypatch.setattr(capture, "OVERLAP_BYTES", 0)
    seen, writes = [], []
    real_add = ShardWriter.add
    monkeypatch.setattr(
        ShardWriter,
        "add",
        lambda self, rows: writes.append((rows.prompt_id, threading.current_thread().name)) or real_add(self, rows),
    )
    out = _capture(
        be,
        tmp_path / "wh",
        "c",
        observe=lambda pid, pos, stored, shift: seen.append((pid, threading.current_thread().name)),
        store="native",
    )
    want = "capture-keep" if mode == "beside" else threading.current_thread().name
    assert [p for p, _ in seen] == [p for p, _ in PROMPTS] == [p for p, _ in writes]
    assert all(t.startswith(want) for _, t in seen), seen
    assert all(t.startswith("capture-write") for _, t in writes), writes  # beside the measuring, in every mode
    table = Warehouse(tmp_path / "wh").read_shard("c", 0)
    assert table.column("prompt_id").to_pylist() == [
        p for p, ids in PROMPTS for _ in Positions.every(STRIDE).fed(ids)[1]
    ]
    rows = native_rows(table)  # (rows, vocab) float32
    direct = np.concatenate([be.forward(*Positions.every(STRIDE).fed(ids)) for _, ids in PROMPTS])
    assert out["rows"] == len(direct) == len(rows)
    assert np.array_equal(rows.view(np.uint32), direct.view(np.uint32))  # bit for bit


def test_a_forward_failing_while_rows_are_in_flight_leaves_nothing(be, tmp_path, monkeypatch):
    as_if_on_a_gpu(be, monkeypatch)  # rows beside the forward, so p1's are in flight when p2's fails
    bad = PROMPTS[:2] + [("p2", IDS[:5] + [10**7])]  # an id past the vocabulary: the embedding raises
    done = []
    with pytest.raises(IndexError):
        _capture(be, tmp_path / "wh", "c", bad, observe=lambda pid, *_: done.append(pid))
    assert done == ["p0", "p1"]  # the prompt in flight was finished before the writer was aborted
    assert _leftovers(tmp_path / "wh") == []


@pytest.mark.parametrize("gpu", [True, False], ids=["beside-the-next-forward", "cpu-engine-between-forwards"])
def test_a_failure_keeping_rows_stops_the_capture_at_the_next_prompt(be, tmp_path, monkeypatch, gpu):
    if gpu:
        as_if_on_a_gpu(be, monkeypatch)
    forwards = []
    real = be.forward
    monkeypatch.setattr(be, "forward", lambda ids, pos: forwards.append(len(ids)) or real(ids, pos))

    def observe(pid, *_):
        if pid == "p1":
            raise ValueError("p1 could not be measured")

    with pytest.raises(ValueError, match="p1 could not be measured"):
        _capture(be, tmp_path / "wh", "c", observe=observe)
    # beside: p2's forward ran while p1's rows failed, and p3's never started; between forwards
    # p1's failure stops the capture before p2's
    assert len(forwards) == (3 if gpu else 2)
    assert _leftovers(tmp_path / "wh") == []
