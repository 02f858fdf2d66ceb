"""Readable stack names (analysis/stack_names.py): what tells a warehouse's stacks apart, and a
name, part of one or a cell id resolved to one cell."""

from __future__ import annotations

import json

import pytest

from analysis.stack_names import names, resolve
from common.errors import UserError


def cell(
    stack: str,
    engine: str,
    dtype: str,
    attention: str = "default",
    build: str = "b1",
    status: str = "done",
    finished: str = "2026-01-01",
    opts: dict | None = None,
    label: str | None = None,
    model: str = "m",
):
    recipe = {"tool": "published artifact", "label": label} if label else {"tool": "llama-quantize"}
    return {
        "stack_id": stack,
        "cell_id": f"{stack}@{build}",
        "engine": engine,
        "dtype": dtype,
        "attention": attention,
        "tp": 1,
        "device": "cpu",
        "model": model,
        "status": status,
        "finished_at": finished,
        "is_reference": False,
        "options": json.dumps(opts or {}),
        "artifact_recipe": json.dumps(recipe),
    }


DEMO = [
    cell("m.hf.bf16.eager.tp1.cpu-aa", "hf", "bf16", "eager"),
    cell("m.hf.bf16.sdpa.tp1.cpu-ab", "hf", "bf16", "sdpa"),
    cell("m.mlx.q8_g64.default.tp1.cpu-ba", "mlx", "q8_g64", opts={"max_tokens": 1}),
    cell("m.mlx.q8_g64.default.tp1.cpu-bb", "mlx", "q8_g64", opts={"max_tokens": 1, "activations": "fp32"}),
    cell("m.llamacpp.q4_1.default.tp1.cpu-ca", "llamacpp", "q4_1"),
    cell("m.llamacpp.q4_1.default.tp1.cpu-cb", "llamacpp", "q4_1", label="Q4_1.gguf (PyPI)"),
    cell("m.llamacpp.f16.default.tp1.cpu-da", "llamacpp", "f16"),
    cell("m.llamacpp.f16.default.tp1.cpu-da", "llamacpp", "f16", build="b2", finished="2026-02-01"),
    cell("m.llamacpp.f16.default.tp1.cpu-da", "llamacpp", "f16", build="b3", finished="2026-03-01", status="failed"),
]


def test_names_say_what_differs_and_nothing_more():
    got = names(DEMO)
    assert got == {
        "m.hf.bf16.eager.tp1.cpu-aa": "hf/bf16/eager",
        "m.hf.bf16.sdpa.tp1.cpu-ab": "hf/bf16/sdpa",
        "m.mlx.q8_g64.default.tp1.cpu-ba": "mlx/q8_g64",
        "m.mlx.q8_g64.default.tp1.cpu-bb": "mlx/q8_g64/activations=fp32",
        "m.llamacpp.q4_1.default.tp1.cpu-ca": "llamacpp/q4_1",
        "m.llamacpp.q4_1.default.tp1.cpu-cb": "llamacpp/q4_1/Q4_1.gguf (PyPI)",
        "m.llamacpp.f16.default.tp1.cpu-da": "llamacpp/f16",
    }
    two = DEMO + [cell("n.hf.bf16.eager.tp1.cpu-ea", "hf", "bf16", "eager", model="n")]
    assert names(two)["n.hf.bf16.eager.tp1.cpu-ea"] == "hf/bf16/eager/n"  # a second model: every name says which
    alike = [
        cell("m.hf.bf16.eager.tp1.cpu-f1", "hf", "bf16", "eager"),
        cell("m.hf.bf16.eager.tp1.cpu-f2", "hf", "bf16", "eager"),
    ]
    assert sorted(names(alike).values()) == ["hf/bf16/f1", "hf/bf16/f2"]  # nothing else apart: the hash


def test_a_name_a_part_of_one_or_a_cell_id_resolves_to_the_latest_completed_cell():
    assert resolve(DEMO, "llamacpp/f16") == "m.llamacpp.f16.default.tp1.cpu-da@b2"  # b3 failed, b2 is newer than b1
    assert resolve(DEMO, "m.llamacpp.f16.default.tp1.cpu-da@b1") == "m.llamacpp.f16.default.tp1.cpu-da@b1"
    assert resolve(DEMO, "activations=fp32") == "m.mlx.q8_g64.default.tp1.cpu-bb@b1"
    assert resolve(DEMO, "llamacpp/q4_1") == "m.llamacpp.q4_1.default.tp1.cpu-ca@b1"  # a whole name wins
    assert resolve(DEMO, "Q4_1.gguf (PyPI)") == "m.llamacpp.q4_1.default.tp1.cpu-cb@b1"
    assert resolve(DEMO, "sdpa") == "m.hf.bf16.sdpa.tp1.cpu-ab@b1"


@pytest.mark.parametrize(
    "asked, says",
    [
        ("mlx", "'mlx' matches 2 stacks: mlx/q8_g64, mlx/q8_g64/activations=fp32; name one of them"),
        ("q4_k_m", "'q4_k_m' is no cell id or stack name there"),
        ("", "'' is no cell id or stack name there"),
    ],
)
def test_no_stack_or_several_is_one_line_naming_them(asked, says):
    with pytest.raises(UserError) as e:
        resolve(DEMO, asked, "card: warehouse wh")
    assert str(e.value).startswith("card: warehouse wh: ") and says in str(e.value) and "\n" not in str(e.value)


def test_a_stack_without_a_completed_cell_says_so():
    with pytest.raises(UserError, match="stack llamacpp/f16 has no completed cell"):
        resolve([c for c in DEMO if c["status"] == "failed"] + DEMO[:2], "llamacpp/f16")


def test_the_reports_labels_are_unique_per_cell():
    """A stack of several cells (builds, replicas) labels each by what follows its stack id; a cell
    written before cells had a stack id is a stack of its own."""
    from analysis.report import labels

    replicas = [
        {**cell("m.hf.fp32.eager.tp1.cpu-ee", "hf", "fp32", "eager"), "cell_id": c}
        for c in (
            "m.hf.fp32.eager.tp1.cpu-ee@b1",
            "m.hf.fp32.eager.tp1.cpu-ee.r1@b1",
            "m.hf.fp32.eager.tp1.cpu-ee.r2@b1",
        )
    ]
    old = {**cell("x", "llamacpp", "q8_0"), "stack_id": None, "cell_id": "m.llamacpp.q8_0.default.tp1.cpu-ff"}
    got = labels(DEMO + replicas + [old])
    assert len(set(got.values())) == len(got) == len(DEMO) + 3 + 1, got  # every cell its own label
    assert got["m.hf.fp32.eager.tp1.cpu-ee.r2@b1"] == "hf/fp32/eager.r2@b1"
    assert got["m.hf.fp32.eager.tp1.cpu-ee@b1"] == "hf/fp32/eager@b1"
    assert {got[f"m.llamacpp.f16.default.tp1.cpu-da@{b}"] for b in ("b1", "b2", "b3")} == {
        "llamacpp/f16@b1",
        "llamacpp/f16@b2",
        "llamacpp/f16@b3",
    }
    assert got["m.llamacpp.q8_0.default.tp1.cpu-ff"] == "llamacpp/q8_0"
