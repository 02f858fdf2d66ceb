"""`matrix attribute` on the 2-layer cut: each group raised and lowered alone through llama.cpp's
per-tensor types, the types its file really has, its ΔKL against two `kld()` results, a frontier
step rebuilt from its --tensor-type lines to the same bytes, and the job resumed by the verb."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest

from matrix import api
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # converts and quantises the model, then captures a dozen cells

GROUPS = ("attn_v", "ffn_down", "first_third")
QUIET = {"log": lambda line: None}


@pytest.fixture(scope="module")
def f16(tiny_model) -> str:
    from backends.gguf_build import build_for
    from common.files import weights_digest_cached

    return build_for("f16", str(tiny_model), weights_digest_cached(Path(tiny_model)), 2)["path"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    prose = (REPO / "configs/corpus/long_prose.txt").read_text()
    f = tmp_path_factory.mktemp("text") / "prose.txt"
    f.write_text(prose[: len(prose) // 12])  # 6 chunks of 64 tokens: 186 scored rows a file
    return f


@pytest.fixture(scope="module")
def job(f16, text, tmp_path_factory):
    wh = str(tmp_path_factory.mktemp("attr") / "wh")
    args = dict(groups=GROUPS, lower_to="q2_k", n_ctx=64, threads=2)
    return api.attribute(f16, "q4_k_m", text, wh, **args, **QUIET), args


@functools.cache
def _types(path: str) -> dict[str, str]:
    """Every tensor's type as the file holds it (the header reader, held to gguf-py's by
    tests/test_kld_parts.py)."""
    from gguf import GGMLQuantizationType

    from common.gguf_header import read_tensors

    return {name: GGMLQuantizationType(t).name for name, t, _ in read_tensors(path)}


def test_each_variant_records_the_types_its_file_really_has(job, f16):
    from backends.gguf_groups import groups

    r, _ = job
    members = {g.name: set(g.tensors) for g in groups(f16, GROUPS)}
    assert members["ffn_down"] == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    by = {(v["group"], v["direction"]): v for v in r.variants}
    assert set(by) == {(g, d) for g in members for d in ("raise", "lower")}
    base = _types(r.base["path"])
    for (group, _), v in by.items():
        types = _types(v["path"])
        want: dict[str, int] = {}
        for n in members[group]:
            want[types[n]] = want.get(types[n], 0) + 1
        assert v["types"] == want
        assert v["changed_outside"] == sorted(n for n in base if n not in members[group] and types[n] != base[n])
        assert v["delta_bytes"] == Path(v["path"]).stat().st_size - Path(r.base["path"]).stat().st_size
    # raised to Q8_0 as asked; attn_v lowered to Q2_K falls back, its 576-wide rows not dividing
    # into 256-blocks: the record says what the file holds, not what was asked
    assert by[("attn_v", "raise")]["types"] == {"Q8_0": 2}
    assert by[("attn_v", "lower")]["types"] == {"Q4_0": 2} and by[("attn_v", "lower")]["type"] == "q2_k"
    # overriding layer 0 takes it out of the Q4_K_M mixture's count of attn_v and ffn_down tensors,
    # so layer 1's (Q8_0 and Q6_K in the base) get the plainer types: outside the group, and recorded
    first = by[("first third", "raise")]
    assert first["changed_outside"] == ["blk.1.attn_v.weight", "blk.1.ffn_down.weight"]
    assert [_types(first["path"])[n] for n in first["changed_outside"]] == ["Q5_0", "Q4_K"]
    assert [base[n] for n in first["changed_outside"]] == ["Q8_0", "Q6_K"]


def test_each_variant_is_the_file_a_plain_quantisation_writes(job, f16, tmp_path):
    """Variants are quantised over the base (its tensors that keep their type spliced in, only the rest
    quantised): each is, byte for byte, what llama_model_quantize writes from the F16 alone."""
    from backends.gguf_build import quantize_file

    r, _ = job
    for i, v in enumerate(r.variants):
        out = tmp_path / f"plain-{i}.gguf"
        quantize_file(f16, "q4_k_m", out, 2, None, tuple(v["lines"]))
        assert hashlib.sha256(out.read_bytes()).hexdigest() == v["sha256"], v["lines"]


def test_llamas_dry_run_plans_the_types_each_file_holds(job, f16):
    from backends.gguf_build import planned_types

    r, _ = job
    for lines, path in [((), r.base["path"])] + [(tuple(v["lines"]), v["path"]) for v in r.variants]:
        assert planned_types(f16, "q4_k_m", None, lines) == {n: t.lower() for n, t in _types(path).items()}, lines


def test_the_ranking_orders_kl_removed_per_mib(job):
    r, _ = job
    raises = [v for v in r.variants if v["direction"] == "raise" and v["rank"] is not None]
    assert [v["rank"] for v in raises] == list(range(1, len(raises) + 1)) and len(raises) == 3
    scores = [v["score"] for v in raises]
    assert scores == sorted(scores, reverse=True)
    for v in raises:
        assert v["score"] == pytest.approx(v["delta_kl"][0] / (v["delta_bytes"] / 2**20), rel=1e-12)
        assert v["delta_bytes"] > 0 and v["delta_kl"][0] > 0  # every raise of a 4-bit base removes KL here
    lowers = [v for v in r.variants if v["direction"] == "lower"]
    assert [v["score"] for v in lowers] == sorted(v["score"] for v in lowers)
    assert all(v["delta_bytes"] < 0 and v["delta_kl"][0] < 0 for v in lowers)


def test_a_groups_delta_kl_is_the_difference_of_two_kld_results(job, f16, text, tmp_path):
    r, args = job
    v = next(v for v in r.variants if v["group"] == "ffn_down" and v["direction"] == "raise")
    alone = api.kld(f16, [r.base["path"], v["path"]], text, str(tmp_path / "kld"), n_ctx=64, threads=2, **QUIET)
    got = {c.candidate: c.statistics for c in alone.results}
    base, var = got[r.base["path"]], got[v["path"]]
    # the same files over the same text in a warehouse of their own: the same statistics, bit for bit
    assert base["kld"] == r.base["summary"]["kld"] and var["kld"] == v["summary"]["kld"]
    assert var["kld_percentiles"]["99.9%"] == v["summary"]["kld_p99_9"]
    # mean of the per-row differences against the difference of the means: equal up to rounding
    assert v["delta_kl"][0] == pytest.approx(base["kld"][0] - var["kld"][0], rel=1e-12, abs=1e-15)
    # paired: less noise than the two files' errors taken as independent
    assert 0 < v["delta_kl"][1] < (base["kld"][1] ** 2 + var["kld"][1] ** 2) ** 0.5


def test_a_frontier_step_rebuilds_from_its_lines_to_the_same_bytes(job, f16, tmp_path):
    from backends.gguf_build import quantize_file
    from backends.gguf_groups import read_lines

    r, _ = job
    assert [p["step"] for p in r.frontier] == list(range(len(r.frontier))) and len(r.frontier) == 4
    last = r.frontier[-1]
    assert len(last["lines"]) == 3 and last["groups"] == [
        v["group"] for v in r.variants if v["rank"] and v["direction"] == "raise"
    ]
    sizes = [p["size"]["file_bytes"] for p in r.frontier]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    kls = [p["summary"]["kld"][0] for p in r.frontier]
    assert kls[-1] < kls[0]
    tt = tmp_path / "tensor-types.txt"
    tt.write_text(r.tensor_type_file(len(r.frontier) - 1))
    out = tmp_path / "rebuilt.gguf"
    quantize_file(f16, "q4_k_m", out, 1, None, read_lines(tt.read_text()))
    assert hashlib.sha256(out.read_bytes()).hexdigest() == last["sha256"]


def test_the_card_gives_the_recipes_lines(job):
    r, _ = job
    last = r.frontier[-1]
    card = api.card(r.warehouse, last["cell_id"], allow_undisclosed=True)
    assert card.card["disclosure"]["candidate_artifact"]["tensor_type_lines"] == last["lines"]
    assert "The recipe's `--tensor-type-file`:" in card.markdown() and last["lines"][0] in card.markdown()


def test_the_verb_resumes_the_job_and_prints_the_calls_result(job, f16, text):
    r, args = job
    cli = run_cli(
        "attribute", "--reference", f16, "--quant", "q4_k_m", "--text", str(text), "--warehouse", r.warehouse,
        "--groups", ",".join(GROUPS), "--lower-to", "q2_k", "--n-ctx", "64", "--threads", "2", "--json",
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout) == json.loads(json.dumps(r.to_dict()))
    assert "nothing to do: all 10 cell(s) are complete" in cli.stderr  # nothing captured again


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--groups", "attn_z"], "--groups attn_z: no such group in "),
        (["--quant", "q9_k"], "--quant q9_k: not a quant type here"),
        (["--raise-to", "q9"], "--raise-to q9: not a type a group is quantised to here"),
        (["--raise-to", "i32"], "--raise-to i32: not a type a group is quantised to here"),
        (["--frontier", "-1"], "--frontier -1: must be >= 0"),
        (["--groups", "attn_v,attn_v"], "--groups attn_v,attn_v: name each group once"),
        (["--text", "/nonexistent/text.txt"], "--text /nonexistent/text.txt: no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(f16, text, tmp_path, flags, says):
    args = {"--reference": f16, "--quant": "q4_k_m", "--text": str(text), "--warehouse": str(tmp_path / "wh")}
    for k, v in zip(flags[::2], flags[1::2]):
        args[k] = v
    r = run_cli("attribute", *[x for kv in args.items() for x in kv])
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and says in r.stderr, r.stderr
    assert not (tmp_path / "wh").exists()


def test_a_quantised_reference_is_refused(job, text, tmp_path):
    r, _ = job
    cli = run_cli("attribute", "--reference", r.base["path"], "--quant", "q4_k_m", "--text", str(text),
                  "--warehouse", str(tmp_path / "wh"))  # fmt: skip
    assert cli.returncode == 2 and "declares q4_k_m; attribution quantises from an F16, BF16 or F32 file" in cli.stderr


def test_the_reports_frontier_chart_reads_in_chromium(job, tmp_path):
    """Every file of the job is a point; the Pareto front's names stand in a column beside the chart,
    apart from each other and inside the drawing, each one a stack of the warehouse."""
    from tests.test_report_browser import CHROMIUM, layout

    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine (.ci/run installs it)")
    r, _ = job
    rep = run_cli("report", "--warehouse", r.warehouse, "--out", str(tmp_path / "rep"))
    assert rep.returncode == 0, rep.stderr[-2000:]
    got = layout(tmp_path / "rep" / "report.html", tmp_path)
    assert not got["console"] and got["font"]
    chart = next(c for c in got["charts"] if c["id"] == "frontier-0")
    assert chart["series"] >= 2 and 400 < chart["w"] <= 1000 and chart["h"] > 150
    assert not [o for o in got["overlaps"] if o[0] == "frontier-0" or o[2] == "frontier-0"]
    stacks = {s["name"] for s in api.stacks(r.warehouse).to_dict()["stacks"]}
    named = [t for t in chart["labels"] if "/" in t]
    assert named and set(named) <= stacks and any("+attn_v=q8_0" in t for t in named), named


def test_an_imatrix_recipe_weights_every_file(job, f16, text, tmp_path):
    """--imatrix: the base and each variant quantised with it, as llama-quantize --imatrix writes
    them (the quantize.imatrix.* header keys), apart from the unweighted recipe's files."""
    from backends.gguf_imatrix import collect
    from common.files import file_sha256
    from store.gguf_meta import read_info

    plain, _ = job
    calib = text.read_text()[:4000]
    im = collect({"path": f16, "sha256": file_sha256(Path(f16))}, calib, "prose", "x" * 64, 2, 64, 2)
    r = api.attribute(
        f16, "q4_k_m", text, str(tmp_path / "wh"), imatrix=im["path"], groups=("attn_v",), frontier=0,
        n_ctx=64, threads=2, **QUIET,
    )  # fmt: skip
    assert r.recipe == "q4_k_m + imatrix imatrix.gguf" and len(r.frontier) == 1
    (v,) = r.variants
    for path in (r.base["path"], v["path"]):
        assert read_info(path).imatrix.get("dataset") == "prose", read_info(path).imatrix
    assert r.base["sha256"] != plain.base["sha256"] and v["types"] == {"Q8_0": 2}
    assert v["summary"]["rows"] == plain.base["summary"]["rows"] and v["delta_kl"][1] > 0 and v["rank"] == 1
    # quantised over the weighted base: the bytes llama_model_quantize writes with the imatrix from the F16 alone
    from backends.gguf_build import quantize_file
    from matrix.api.attribute import _imatrix

    quantize_file(f16, "q4_k_m", tmp_path / "plain.gguf", 2, _imatrix(im["path"]), tuple(v["lines"]))
    assert file_sha256(tmp_path / "plain.gguf") == v["sha256"]


def test_a_variant_that_changes_no_type_is_the_bases_file_not_quantised_again(job, f16, text, monkeypatch):
    """token_embd is Q8_0 in the base already (Q6_K's fallback at 576-wide rows): raised to Q8_0, llama.cpp's
    dry run plans the base's types, and the variant is the base's file, dropped from the ranking."""
    from analysis.attribution import SAME_AS_BASE
    from backends import gguf_build

    r, args = job
    asked, quantize = [], gguf_build.quantize
    monkeypatch.setattr(gguf_build, "quantize", lambda *a, **k: asked.append(k["tensor_types"]) or quantize(*a, **k))
    again = api.attribute(f16, "q4_k_m", text, r.warehouse, groups=("token_embd",), n_ctx=64, threads=2, **QUIET)
    (v,) = again.variants
    assert asked == [()]  # the base alone, found in the artifact cache
    assert (v["path"], v["sha256"], v["dropped"]) == (r.base["path"], r.base["sha256"], SAME_AS_BASE)
    assert v["lines"] == [r"^token_embd\.weight$=q8_0"] and v["types"] == {"Q8_0": 1} and v["delta_bytes"] == 0
