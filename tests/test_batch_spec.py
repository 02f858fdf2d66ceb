"""The `batch:` axis as a spec names it: which sequences share a prompt's forward under each fill
policy, the cells a sweep expands into (batch-free ids unchanged, each batch cell pointing at its
batch-1 stack), and bad values refused in one line that names the field and value, exit 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from backends.base import LengthRefused, SkipCell
from common.batching import Batch
from common.errors import UserError
from common.stack import StackDesc
from extras.batch import Batched
from matrix.spec.cells import load_spec
from tests.conftest import REPO, run_cli


def test_corpus_fill_takes_the_next_prompts_in_corpus_order_cycled():
    assert Batch(4).others(3, 5) == [4, 0, 1]
    assert Batch(8).others(0, 5) == [1, 2, 3, 4, 0, 1, 2]  # past the corpus's end: from its start again
    assert Batch(1).others(2, 5) == []


def test_repeat_fill_batches_the_prompt_with_itself():
    assert Batch(3, "repeat").others(2, 5) == [2, 2]


def test_random_fill_is_seeded_per_prompt_and_never_the_prompt_itself():
    a = Batch(16, "random", seed=7)
    assert a.others(1, 5) == Batch(16, "random", seed=7).others(1, 5)  # the same draw every time
    assert a.others(1, 5) != Batch(16, "random", seed=8).others(1, 5)
    assert 1 not in a.others(1, 5) and set(a.others(1, 5)) <= {0, 2, 3, 4}


def test_the_policy_counts_in_a_cell_id_only_above_batch_1():
    assert Batch(1, "random", 3).id_part() == Batch(1).id_part() == {"size": 1}
    assert Batch(8, "random", 3).id_part() == {"size": 8, "fill": "random", "seed": 3}
    assert Batch(8, "repeat", 3).id_part() == {"size": 8, "fill": "repeat"}  # a seed draws nothing here


def _spec(tmp_path: Path, **over) -> Path:
    body = {
        "models": ["smollm2-135m"],
        "engines": ["hf"],
        "dtypes": ["fp32"],
        "attention": ["eager", "sdpa"],
        "reference": {"engine": "hf", "dtype": "fp32", "attention": "eager"},
        **over,
    }
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


def test_sizes_expand_each_stack_and_batch_free_ids_stay(tmp_path):
    free = {c.attention: c.stack_id for c in load_spec(_spec(tmp_path)).cells}
    m = load_spec(_spec(tmp_path, batch={"sizes": [1, 4], "fill": "repeat"}))
    got = {(c.attention, c.extra("batch").size): c for c in m.cells}
    assert sorted(got) == [("eager", 1), ("eager", 4), ("sdpa", 1), ("sdpa", 4)]
    assert not set(free.values()) & {c.stack_id for c in m.cells}  # a batch cell is another capture
    for (att, size), c in got.items():
        assert c.extra("batch") == Batch(size, "repeat") and c.partners == (("batch", got[(att, 1)].stack_id),)
    assert m.reference_stacks["smollm2-135m"] == got[("eager", 1)].stack_id  # the reference at batch 1
    again = load_spec(_spec(tmp_path, batch={"sizes": [1, 4], "fill": "repeat"}))
    assert [c.stack_id for c in again.cells] == [c.stack_id for c in m.cells]
    assert free == {c.attention: c.stack_id for c in load_spec(_spec(tmp_path)).cells}


def test_an_include_with_its_own_batch_adds_cells_beside_the_batch_free_ones(tmp_path):
    m = load_spec(_spec(tmp_path, include=[{"engine": "hf", "dtype": "fp32", "attention": "sdpa", "batch": [1, 8]}]))
    got = sorted((c.attention, c.extra("batch").size if c.extra("batch") else 0) for c in m.cells)  # 0: batch-free
    assert got == [("eager", 0), ("sdpa", 0), ("sdpa", 1), ("sdpa", 8)]


def test_a_cell_that_cannot_batch_skips_with_the_reason(tmp_path):
    from backends import backend_class

    m = load_spec(
        _spec(tmp_path, include=[{"engine": "hf", "dtype": "fp32", "attention": "sdpa", "layers": "first-2"}])
    )
    assert [c.extra("batch") for c in m.cells] == [None, None]  # batch-free: a layers cell runs
    m = load_spec(_spec(tmp_path, batch=[1, 4], include=[{"engine": "hf", "attention": "sdpa", "layers": "first-2"}]))
    reasons = {s["reason"] for s in m.skipped}
    assert reasons == {"per-cell extras (layers) record a sequence evaluated alone; a batch cell takes none"}, reasons
    cell = m.cells[0].with_stack(engine="trtllm", device="h200")
    assert (
        backend_class("trtllm").batch_unsupported(cell) == "engine trtllm does not evaluate a batch of sequences here"
    )


@pytest.mark.parametrize(
    "batch, line",
    [
        (0, "spec.yaml: batch: a batch size must be an integer >= 1 (got 0)"),
        ([1, -2], "spec.yaml: batch[1]: a batch size must be an integer >= 1 (got -2)"),
        (
            {"sizes": [1, 8], "fill": "shuffle"},
            "batch.fill: unknown fill policy; expected one of corpus, repeat, random",
        ),
        ({"sizes": [1, 1]}, "batch.sizes: has duplicate batch sizes"),
        ({"fill": "repeat"}, "batch: needs sizes"),
        ({"sizes": 2, "order": 1}, "batch.order: unknown key"),
    ],
)
def test_a_bad_batch_is_one_line_naming_the_field_and_value(tmp_path, batch, line):
    with pytest.raises(UserError) as e:
        load_spec(_spec(tmp_path, batch=batch))
    assert len(str(e.value).splitlines()) == 1 and line in str(e.value), e.value


def test_a_batch_past_the_engines_limit_exits_2_naming_the_limit(tmp_path):
    spec = _spec(tmp_path, include=[{"engine": "llamacpp", "dtype": "f16", "attention": "default", "batch": [1, 300]}])
    r = run_cli("cells", str(spec))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "include[0].batch: engine llamacpp takes at most 256 sequences in one batch on cpu" in err[0], err
    assert "LLAMA_MAX_SEQ" in err[0] and "(got 300)" in err[0]


def test_deterministic_is_true_or_false(tmp_path):
    with pytest.raises(UserError) as e:
        load_spec(_spec(tmp_path, options={"deterministic": "yes"}))
    assert "options.deterministic: must be true or false (got 'yes')" in str(e.value)
    ref = {"engine": "hf", "dtype": "fp32", "attention": "eager", "deterministic": False}
    m = load_spec(_spec(tmp_path, options={"deterministic": [False, True]}, reference=ref))
    assert sorted((c.attention, c.opts["deterministic"]) for c in m.cells) == [
        ("eager", False),
        ("eager", True),
        ("sdpa", False),
        ("sdpa", True),
    ]


def test_batch_free_cells_keep_the_ids_they_had():
    """The demo's HF fp32 eager stack, as `matrix cells` named it before the batch axis existed."""
    (c,) = [
        c for c in load_spec(REPO / "configs" / "smoke.yaml").cells if c.extra("batch") is None and c.dtype == "fp32"
    ][:1]
    assert c.stack_id == "smollm2-135m.hf.fp32.eager.tp1.cpu-c1f2d80e90"


class _Seen:
    """An engine that records what each batched forward was given, and refuses one width."""

    def __init__(self, batch: Batch, refuse: int | None = None):
        self.stack, self.seen, self.refuse = StackDesc.of("hf", "fp32", "eager", extras=(("batch", batch),)), [], refuse

    def forward_batch(self, token_ids, positions, others):
        self.seen.append((token_ids, others))
        if self.refuse and max(map(len, [token_ids, *others])) == self.refuse:
            raise LengthRefused("no kernel at this width", self.refuse)
        return np.zeros((len(positions), 4), np.float32)


PROMPTS = [("a", [1, 2, 3, 4, 5]), ("b", [6, 7]), ("c", [8, 9, 10])]


def _batched(eng: _Seen, max_tokens: int | None) -> Batched:
    """The batch plug-in's capturer, started as a capture starts it."""
    got = Batched(eng, eng.stack.extra("batch"))
    got.start(PROMPTS, max_tokens)
    return got


def test_the_others_are_fed_as_a_batch_free_cell_feeds_them():
    eng = _Seen(Batch(3))
    _batched(eng, 2).forward("a", [1, 2], [0, 1])
    assert eng.seen == [([1, 2], [[6, 7], [8, 9]])]  # the next prompts, each cut at max_tokens


def test_repeat_fill_feeds_identical_sequences():
    eng = _Seen(Batch(3, "repeat"))
    _batched(eng, None).forward("a", [1, 2, 3], [0, 2])
    assert eng.seen == [([1, 2, 3], [[1, 2, 3], [1, 2, 3]])]  # the measured prefix, not the whole prompt


def test_a_refused_batch_skips_the_cell_rather_than_feed_a_longer_prefix():
    eng = _Seen(Batch(2), refuse=5)
    with pytest.raises(SkipCell) as e:
        _batched(eng, None).forward("c", [8, 9, 10], [0])
    assert not isinstance(e.value, LengthRefused) and str(e.value) == "batch 2: no kernel at this width"
