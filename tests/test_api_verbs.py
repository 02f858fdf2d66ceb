"""Every verb of the command is its matrix.api call: what the verb prints with --json (--format json
for sql) is that call's to_dict(), as JSON writes it. The session's dense capture (conftest DENSE:
every position of the first 40 tokens, so that llama-perplexity's chunks of 32 can be exported;
layer states on every cell) is analysed in a copy; each verb then runs once through the command and
once through the API, a verb that writes a file writing it under cli/ and api/ of its own folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from matrix import api
from tests.conftest import DENSE, analyzed_copy, run_cli, same_json

QUIET = {"log": lambda line: None}


@pytest.fixture(scope="module")
def w(capture, tiny_model, tmp_path_factory):
    spec, _ = captured = capture(**DENSE)  # the session's capture, analysed in a copy
    copy, _ = analyzed_copy(captured, tmp_path_factory, "verbs")
    d, wh = copy.parent, str(copy)
    for side in ("cli", "api"):
        (d / side).mkdir()
    fixture = api.fixture_export(wh, "hf/fp32", str(d / "ref.json"), k=16, **QUIET).report["path"]
    base = api.kld_base_export(wh, "hf/fp32", 32, str(d / "ref.kld"), **QUIET).report["path"]
    for side in ("cli", "api"):  # a copy of the warehouse each for the import (it knows the model)
        api.merge([wh], str(d / side / "imported"), **QUIET)
    return SimpleNamespace(d=d, spec=str(spec), wh=wh, model=str(tiny_model), fixture=fixture, base=base)


def _out(w, side: str, name: str) -> str:
    return str(w.d / side / name)


# verb -> (its argv given w and the side's out folder, the API call given w and the side, keys whose
# value is the call's own clock)
VERBS = {
    "run": (
        lambda w, o: ["run", w.spec, "--warehouse", w.wh, "--executor", "local"],
        lambda w, s: api.run(w.spec, w.wh, executor="local", **QUIET),
        {"wall_s"},
    ),
    "cells": (lambda w, o: ["cells", w.spec], lambda w, s: api.cells(w.spec), set()),
    "analyze": (
        lambda w, o: ["analyze", "--warehouse", w.wh, "--workers", "1"],
        lambda w, s: api.analyze(w.wh, workers=1, **QUIET),
        {"seconds"},
    ),
    "sql": (
        lambda w, o: ["sql", "select cell_id, dtype, rows_per_repeat from cells order by 1", "--warehouse", w.wh],
        lambda w, s: api.sql(w.wh, "select cell_id, dtype, rows_per_repeat from cells order by 1"),
        set(),
    ),
    "report": (
        lambda w, o: ["report", "--warehouse", w.wh, "--out", _out(w, o, "report")],
        lambda w, s: api.report(w.wh, _out(w, s, "report")),
        set(),
    ),
    "verify": (
        lambda w, o: ["verify", "--warehouse", w.wh],
        lambda w, s: api.verify(w.wh, **QUIET),
        {"seconds", "mib_per_s"},
    ),
    "merge": (
        lambda w, o: ["merge", w.wh, "--into", _out(w, o, "merged")],
        lambda w, s: api.merge([w.wh], _out(w, s, "merged"), **QUIET),
        set(),
    ),
    "status": (lambda w, o: ["status", "--warehouse", w.wh], lambda w, s: api.status(w.wh), set()),
    "stacks": (lambda w, o: ["stacks", "--warehouse", w.wh], lambda w, s: api.stacks(w.wh), set()),
    "card": (lambda w, o: ["card", "hf/bf16", "--warehouse", w.wh], lambda w, s: api.card(w.wh, "hf/bf16"), set()),
    "admit": (lambda w, o: ["admit", "hf/bf16", "--warehouse", w.wh], lambda w, s: api.admit(w.wh, "hf/bf16"), set()),
    "layers": (
        lambda w, o: ["layers", "hf/bf16", "--warehouse", w.wh],
        lambda w, s: api.layers(w.wh, "hf/bf16"),
        set(),
    ),
    "fixture export": (
        lambda w, o: ["fixture", "export", "hf/bf16", "--k", "8", "--out", _out(w, o, "fx.json"), "--warehouse", w.wh],
        lambda w, s: api.fixture_export(w.wh, "hf/bf16", _out(w, s, "fx.json"), k=8, **QUIET),
        set(),
    ),
    "fixture check": (
        lambda w, o: ["fixture", "check", w.fixture, "--engine", "hf", "--model", w.model, "--attention", "eager"],
        lambda w, s: api.fixture_check(w.fixture, "hf", w.model, attention="eager", **QUIET),
        set(),
    ),
    "kld-base export": (
        lambda w, o: (
            ["kld-base", "export", "hf/bf16", "--n-ctx", "32", "--out", _out(w, o, "b.kld")] + ["--warehouse", w.wh]
        ),
        lambda w, s: api.kld_base_export(w.wh, "hf/bf16", 32, _out(w, s, "b.kld"), **QUIET),
        set(),
    ),
    "kld-base import": (
        lambda w, o: ["kld-base", "import", w.base, "--model", "tiny", "--warehouse", _out(w, o, "imported")],
        lambda w, s: api.kld_base_import(_out(w, s, "imported"), w.base, "tiny", **QUIET),
        {"cell_id"},  # minted from the run that imports it
    ),
    "models list": (lambda w, o: ["models", "list"], lambda w, s: api.models(), set()),
    "spec": (lambda w, o: ["spec"], lambda w, s: api.spec(), set()),
    "docs": (lambda w, o: ["docs", "--check"], lambda w, s: _docs_check(), set()),
    "models fetch": (
        lambda w, o: ["models", "fetch", "smollm2-135m"],
        lambda w, s: api.fetch_model("smollm2-135m", **QUIET),
        set(),
    ),
    "models cut": (
        lambda w, o: ["models", "cut", "smollm2-135m", "--layers", "1", "--bf16", "--out", _out(w, o, "cut")],
        lambda w, s: api.cut_model("smollm2-135m", 1, _out(w, s, "cut"), bf16=True, **QUIET),
        set(),
    ),
}


def _docs_check():
    """api.docs with the page the command adds from its parsers, as `matrix docs --check` checks."""
    from matrix.cli.docs import cli_page
    from matrix.cli.main import build_parser

    return api.docs(check=True, pages={"cli.md": lambda: cli_page(build_parser)})


@pytest.mark.parametrize("verb", list(VERBS))
def test_each_verbs_json_is_its_api_calls_to_dict(w, verb):
    argv, call, clock = VERBS[verb]
    fmt = ["--format", "json"] if verb == "sql" else ["--json"]
    r = run_cli(*argv(w, "cli"), *fmt)
    got = call(w, "api")
    assert r.returncode == (0 if getattr(got, "ok", True) else 1), r.stderr[-2000:]
    printed = json.loads(r.stdout.replace(str(w.d / "cli"), str(w.d / "api")))
    expected = json.loads(json.dumps(got.to_dict(), default=str))
    drop = (lambda d: {k: v for k, v in d.items() if k not in clock}) if isinstance(expected, dict) else (lambda d: d)
    assert same_json(drop(printed), drop(expected))
    assert expected, f"{verb}: an empty result compares equal to anything"
    if verb == "docs":  # the command checks the same pages the call does, and they are fresh
        assert got.pages == () and got.check and got.ok


def test_the_results_hold_the_warehouses_values(w):
    """The calls above compare with each other; these hold a few of their values to the warehouse."""
    cells = {c["dtype"]: c for c in api.sql(w.wh, "select cell_id, dtype, rows_per_repeat from cells").to_dict()}
    admit = api.admit(w.wh, "hf/bf16")
    assert admit.cell_id == cells["bf16"]["cell_id"] and admit.reference_cell_id == cells["fp32"]["cell_id"]
    assert admit.rows == cells["bf16"]["rows_per_repeat"] > 0
    layers = api.layers(w.wh, "hf/bf16")
    assert [r["layer"] for r in layers.layers][-1] == "final_norm" and layers.ok == layers.verdict["pass"]
    listed = api.cells(w.spec)
    assert sorted(c["dtype"] for c in listed.cells) == ["bf16", "fp32"] and listed.unplaceable is None
    into = str(w.d / "merged-twice")
    first = api.merge([w.wh], into, **QUIET)
    assert len(first.sources[0].merged) == 2 and first.sources[0].already_present == () and first.ok
    again = api.merge([w.wh], into, **QUIET)  # nothing new the second time
    assert again.sources[0].merged == () and len(again.sources[0].already_present) == 2 and again.ok


def test_cache_list_and_prune(tmp_path, monkeypatch):
    """The artifacts cache through the command and the API: an artifact this process holds is listed,
    and a prune keeps it as in use."""
    from backends import artifacts

    monkeypatch.setenv("LOGIT_MATRIX_CACHE", str(tmp_path))
    made = artifacts.ensure("test", "a.bin", {"tool": "test"}, lambda p: p.write_bytes(b"logits"))
    for argv, call in (
        (["cache", "list"], lambda: api.cache()),
        (["cache", "prune"], lambda: api.prune_cache()),
    ):
        r = run_cli(*argv, "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout) == json.loads(json.dumps(call().to_dict(), default=str))
    listed = api.cache()
    held = [f for f in Path(made["path"]).parent.rglob("*") if f.is_file()]  # the file and its recipe
    assert listed.root == str(tmp_path / "artifacts") and listed.bytes == sum(f.stat().st_size for f in held) > 6
    assert [a["sha256"] for a in listed.artifacts] == [made["sha256"]]
    pruned = api.prune_cache()
    assert pruned.removed == () and [a.sha256 for a in pruned.in_use] == [made["sha256"]]


def test_the_api_page_lists_every_call():
    """docs/python-api.md has a row for each function of matrix.api."""
    import inspect

    from tests.conftest import REPO

    page = (REPO / "docs" / "python-api.md").read_text()
    calls = [n for n in api.__all__ if inspect.isfunction(getattr(api, n))]
    assert len(calls) >= 24 and [n for n in calls if f"| `{n}(" not in page] == []


def test_every_leaf_command_is_held_to_its_call():
    """A verb added to the command without its API call and a place above fails here (`kld`'s
    comparison is in tests/test_api.py, after its job; `attribute`'s in tests/test_attribute.py)."""
    from matrix.cli.docs import _parsers
    from matrix.cli.main import build_parser

    leaves = {line.removeprefix("matrix ") for line, _, _ in _parsers(build_parser())}
    assert len(leaves) == 25 and leaves == set(VERBS) | {"cache list", "cache prune", "kld", "attribute"}


def test_a_card_without_its_texts_hash_has_no_model_index():
    """A card whose prompts record no sha256 of their text (captured before prompts recorded one)
    is refused in one line: a model-index names the text it was measured on."""
    from analysis.model_index import model_index
    from common.errors import UserError

    card = {"cell_id": "c", "disclosure": {"evaluation_text": {"text_name": None, "text_sha256": None}}}
    with pytest.raises(UserError, match="^card c: its prompts record no sha256 of their text"):
        model_index(card, "logit-matrix")
