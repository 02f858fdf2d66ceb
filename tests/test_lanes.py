"""Several prompts' forwards at once (actors/lanes.py, Backend.lanes): the rows of a capture whose
prompts ran two at a time on llama.cpp's lanes are those of the same capture one prompt after
the other, bit for bit, in the same order; prompts go to lanes in turn, their rows come back in
prompt order, and a lane's failure is the capture's. The real llama.cpp backend on SmolLM2 cut to
two layers, the real writer."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from actors.capture import capture_shard
from actors.lanes import Ahead, lanes_for
from common.positions import Positions
from common.stack import StackDesc
from store.warehouse import ShardWriter, Warehouse, native_rows

RNG = np.random.default_rng(11)
IDS = [1] + RNG.integers(100, 40000, 399).tolist()
# lengths that change from prompt to prompt: each lane makes and keeps a context of its own per length
PROMPTS = [(f"p{i}", IDS[:n]) for i, n in enumerate([40, 300, 40, 200, 400, 300, 64])]
HALF = Positions(stride=1, start="half")


@pytest.fixture(scope="module")
def llama(tiny_model):
    from backends.llamacpp_backend import LlamaCppBackend

    be = LlamaCppBackend(StackDesc.of("llamacpp", "f16", "default"), str(tiny_model), 2)
    be.load()
    yield be
    be.close()


def _capture(be, wh, store: str) -> tuple[dict, np.ndarray, list]:
    Warehouse(wh).create()
    got = capture_shard(be, ShardWriter(str(wh), "run", "c", 0), PROMPTS, HALF, store=store)
    t = pq.read_table(wh / got["path"])
    return got, native_rows(t), t.select(["prompt_id", "position", "row_hash", "shift"]).to_pylist()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["native", "bf16"])
def test_two_lanes_store_the_rows_of_one_prompt_after_the_other(llama, tmp_path, monkeypatch, store):
    assert llama.lanes() == 2 and llama.settings()["lanes"] == {"at_most": 2, "threads_each": [1, 1]}
    two, rows_two, meta_two = _capture(llama, tmp_path / "two", store)
    monkeypatch.setattr(llama, "lanes", lambda: 1)  # every forward on the calling thread, both threads
    one, rows_one, meta_one = _capture(llama, tmp_path / "one", store)
    assert (two["lanes"], one["lanes"]) == (2, 1)
    assert meta_two == meta_one  # prompt order, positions, row hashes, shifts
    assert [m["prompt_id"] for m in meta_two][:20] == ["p0"] * 20 and len(meta_two) == two["rows"] == 672
    assert rows_two.dtype == rows_one.dtype and np.array_equal(rows_two.view(np.uint8), rows_one.view(np.uint8))
    assert two["storage"] == one["storage"]


@pytest.mark.slow
def test_a_forward_failing_on_a_lane_fails_the_capture_and_leaves_no_shard(llama, tmp_path, monkeypatch):
    real = llama.forward

    def forward(ids, positions, taps=None):
        if len(ids) == 200:  # p3, on lane 1
            raise RuntimeError("decode failed on p3")
        return real(ids, positions, taps)

    monkeypatch.setattr(llama, "forward", forward)
    Warehouse(tmp_path).create()
    with pytest.raises(RuntimeError, match="decode failed on p3"):
        capture_shard(llama, ShardWriter(str(tmp_path), "run", "c", 0), PROMPTS, HALF)
    assert not list((tmp_path / "logits").rglob("*.parquet"))
    monkeypatch.setattr(llama, "forward", real)
    assert _capture(llama, tmp_path / "after", "native")[0]["lanes"] == 2  # the lanes serve the next capture


class FakeLanes:
    """A stand-in engine for the lane bookkeeping alone: which lane each thread bound to."""

    def __init__(self, n: int, vocab: int = 10):
        self.n, self.vocab, self.bound = n, vocab, {}

    def lanes(self) -> int:
        return self.n

    def vocab_size(self) -> int:
        return self.vocab

    def bind_lane(self, i: int) -> None:
        self.bound[threading.get_ident()] = i


def test_prompts_go_to_the_lanes_in_turn_and_come_back_in_order():
    be, started, taken = FakeLanes(2), [], []
    ahead = Ahead(be, 2)

    def work(k: int):
        started.append((k, len(taken)))
        time.sleep(0.01 * (k % 3 == 0))  # some finish after the prompt behind them
        return k, be.bound[threading.get_ident()]

    for k, lane in ahead.map(work, range(7)):
        taken.append(k)
        assert lane == k % 2
    ahead.close()
    assert taken == list(range(7))
    # prompt k + 2 starts only once prompt k is taken: at most two in flight, two rows per lane held
    assert all(seen >= k - 1 for k, seen in started)


def test_lanes_run_only_where_nothing_needs_prompts_one_at_a_time():
    plan = [("a", [1, 2, 3], [1, 2], [0, 1]), ("b", [1, 2], [1], [0])]
    never = lambda rows: False  # noqa: E731
    assert lanes_for(FakeLanes(2), False, plan, never, 1 << 20) == 2
    assert lanes_for(FakeLanes(1), False, plan, never, 1 << 20) == 1
    assert lanes_for(FakeLanes(2), True, plan, never, 1 << 20) == 1  # an extra runs
    assert lanes_for(FakeLanes(2), False, plan[:1], never, 1 << 20) == 1  # one prompt
    assert lanes_for(FakeLanes(2), False, plan, lambda rows: True, 1 << 20) == 1  # streamed
    assert lanes_for(FakeLanes(2, vocab=1 << 18), False, plan, never, 1 << 20) == 1  # 2 rows x 1 MiB each


@pytest.mark.slow
def test_the_lanes_variable_sets_fewer(tiny_model, monkeypatch):
    from backends.llamacpp_backend import LANES_ENV, LlamaCppBackend

    monkeypatch.setenv(LANES_ENV, "1")  # what a benchmark sets to compare with one prompt after the other
    be = LlamaCppBackend(StackDesc.of("llamacpp", "f16", "default"), str(tiny_model), 2)
    be.load()
    try:
        assert be.lanes() == 1 and be.settings()["lanes"] is None
    finally:
        be.close()


def test_lanes_are_the_cpus_and_the_variable_is_checked(monkeypatch):
    from backends.llamacpp_backend import LANES_ENV, _lanes
    from common.errors import UserError

    monkeypatch.delenv(LANES_ENV, raising=False)
    assert (_lanes(2, "cpu"), _lanes(16, "cpu"), _lanes(1, "cpu"), _lanes(8, "cuda"), _lanes(8, "mps")) == (
        2,
        2,
        1,
        1,
        1,
    )
    monkeypatch.setenv(LANES_ENV, "1")
    assert _lanes(2, "cpu") == 1
    for bad in ("0", "two", "1.5", "-1"):
        monkeypatch.setenv(LANES_ENV, bad)
        with pytest.raises(UserError, match=f"{LANES_ENV}='{re.escape(bad)}': a whole number of lanes, 1 or more"):
            _lanes(2, "cpu")


def test_a_second_lanes_failure_goes_on_the_firsts_notes():
    ahead = Ahead(FakeLanes(2), 2)

    def work(k: int):
        time.sleep(0.05 * k)  # the prompt on lane 1 is still running when lane 0's failure is taken
        raise RuntimeError(f"decode failed on p{k}")

    with pytest.raises(RuntimeError, match="decode failed on p0") as got:
        try:
            for _ in ahead.map(work, range(4)):
                pass
        except BaseException as e:
            ahead.settle(e)
            raise
    ahead.close()
    assert got.value.__notes__ == ["a forward on another lane failed too: RuntimeError: decode failed on p1"]
