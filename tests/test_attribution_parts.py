"""The parts of `matrix attribute` that need no model: the ranking's order, the frontier's steps,
the groups of a GGUF's tensors, llama-quantize's --tensor-type lines, a built file's recipe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis import attribution as A
from common.errors import UserError

MIB = 1 << 20


def _v(group, delta_bytes, delta_kl, sha=None, direction="raise"):
    d = None if delta_kl is None else [delta_kl, 1e-4]
    score = None if d is None else A.score(delta_kl, delta_bytes)
    return {"group": group, "direction": direction, "sha256": sha or group, "delta_bytes": delta_bytes,
            "delta_kl": d, "score": score}  # fmt: skip


def test_raises_rank_free_first_then_kl_per_mib_then_the_rest():
    got = A.rank(
        [
            _v("cheap", 1 * MIB, 0.02),  # 0.02 per MiB
            _v("dear", 10 * MIB, 0.05),  # 0.005 per MiB
            _v("free", 0, 0.001),  # KL removed, no byte added: first
            _v("worse", 2 * MIB, -0.01),  # adds KL: below every raise that removes some
            _v("same", 0, None, sha="BASE"),  # the base's own file
            _v("failed", 3 * MIB, None),  # its cell did not complete
            _v("nothing", -MIB, -0.001),  # smaller and worse: after every raise that helps
        ],
        "raise",
        "BASE",
    )
    assert [(v["group"], v["rank"]) for v in got] == [
        ("free", 1), ("cheap", 2), ("dear", 3), ("worse", 4), ("nothing", 5), ("same", None), ("failed", None)
    ]  # fmt: skip
    assert got[-2]["dropped"] == A.SAME_AS_BASE and got[-1]["dropped"] == A.NOT_MEASURED
    assert got[1]["score"] == pytest.approx(0.02) and got[0]["score"] is None
    assert [v["group"] for v in A.frontier_order(got)] == ["free", "cheap", "dear"]


def test_lowers_rank_the_cheapest_bytes_first():
    got = A.rank(
        [_v("a", -4 * MIB, -0.4, direction="lower"), _v("b", -8 * MIB, -0.08, direction="lower"),
         _v("c", 0, -0.1, direction="lower")],
        "lower",
        "BASE",
    )  # fmt: skip
    # KL added per MiB saved: b 0.01, a 0.1; c saves nothing
    assert [v["group"] for v in got] == ["b", "a", "c"] and got[0]["score"] == pytest.approx(0.01)


def _gguf(path, layers: int, names=("attn_v", "ffn_down")) -> str:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for i in range(layers):
        for n in names:
            w.add_tensor(f"blk.{i}.{n}.weight", np.zeros((4, 32), np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.zeros(32, np.float32))  # 1-D: never quantised
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(
    "layers, thirds",
    [(1, {"first third": [0]}), (2, {"first third": [0], "middle third": [1]}),
     (4, {"first third": [0, 1], "middle third": [2], "last third": [3]}),
     (30, {"first third": list(range(10)), "middle third": list(range(10, 20)), "last third": list(range(20, 30))})],
)  # fmt: skip
def test_groups_by_kind_then_thirds_of_the_layers(tmp_path, layers, thirds):
    from backends.gguf_groups import groups

    got = groups(_gguf(tmp_path / "m.gguf", layers))
    assert [g.name for g in got] == ["token_embd", "attn_v", "ffn_down", *thirds]
    by = {g.name: g for g in got}
    assert by["attn_v"].tensors == tuple(f"blk.{i}.attn_v.weight" for i in range(layers))
    for name, ids in thirds.items():  # each third names its layers' weights, never a norm
        want = {f"blk.{i}.{n}.weight" for i in ids for n in ("attn_v", "ffn_down")}
        assert set(by[name].tensors) == want
    assert by["attn_v"].line("Q8_0") == r"^blk\.\d+\.attn_v\.weight$=q8_0"


def test_a_group_asked_for_that_the_file_lacks_is_one_line(tmp_path):
    from backends.gguf_groups import groups

    path = _gguf(tmp_path / "m.gguf", 3)
    assert [g.name for g in groups(path, ("ffn_down", "first_third"))] == ["ffn_down", "first third"]
    with pytest.raises(UserError, match=r"^--groups attn_q: no such group in .* \(it has token_embd, attn_v, "):
        groups(path, ("attn_q",))


def test_tensors_no_kind_names_are_listed(tmp_path):
    from backends.gguf_groups import groups, uncovered

    path = _gguf(tmp_path / "m.gguf", 2, names=("attn_v", "ffn_down_exps"))
    assert uncovered(path, groups(path)) == ["blk.0.ffn_down_exps.weight", "blk.1.ffn_down_exps.weight"]


def test_tensor_type_lines_read_as_llama_quantize_reads_them():
    from backends.gguf_groups import overrides, parse_line, read_lines

    assert parse_line(r"^BLK\.\d+\.ATTN_V\.weight$=Q8_0") == (r"^blk\.\d+\.attn_v\.weight$", "q8_0")
    assert read_lines("a=q8_0\n  b=F16 \n") == ("a=q8_0", "b=f16")
    for bad, says in (("noequals", "not PATTERN=TYPE"), ("a=", "not PATTERN=TYPE"), ("a=q9_z", "q9_z is no ggml type")):
        with pytest.raises(UserError, match=says):
            parse_line(bad)
    arr, keep = overrides(("a=q8_0", "b=f16"))
    assert [(arr[i].pattern, arr[i].type) for i in range(2)] == [(b"a", 8), (b"b", 1)] and arr[2].pattern is None
    assert keep


def test_a_built_files_recipe_is_read_only_where_this_cache_built_it(tmp_path, monkeypatch):
    from backends import artifacts

    monkeypatch.setenv("LOGIT_MATRIX_CACHE", str(tmp_path / "cache"))

    def build(p):
        p.write_bytes(b"GGUF" + b"\0" * 60)

    art = artifacts.ensure("gguf", "m.gguf", {"tool": "t", "tensor_types": ["a=q8_0"]}, build)
    assert artifacts.recipe_of(art["path"])["tensor_types"] == ["a=q8_0"]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "m.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (outside / "recipe.json").write_text(json.dumps({"file": "m.gguf", "tensor_types": ["x=f16"]}))
    assert artifacts.recipe_of(outside / "m.gguf") is None  # a recipe.json beside a user's file says nothing
    with open(art["path"], "ab") as f:  # the cached file changed since it was built
        f.write(b"x")
    assert artifacts.recipe_of(art["path"]) is None
