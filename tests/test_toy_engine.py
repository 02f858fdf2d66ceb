"""An engine is a plug-in: tests/toy_engine/ holds a Backend subclass and a distribution's metadata
whose entry point (group logit_matrix.backends) registers it as engine `toy`. With that directory
on the path and no other change, the spec's schema offers it, a spec naming it validates, and
`matrix run --executor local` captures its rows beside an HF reference on the 2-layer SmolLM2 cut."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO, run_cli, sql, write_spec

TOY = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "toy_engine"), str(REPO)])}


def _engine_values(env: dict | None) -> list[str]:
    r = run_cli("spec", "--schema", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["properties"]["engines"]["anyOf"][0]["enum"]


def test_the_schema_offers_an_engine_registered_by_its_entry_point():
    assert "toy" in _engine_values(TOY)
    assert "toy" not in _engine_values({"PYTHONPATH": str(REPO)})


def test_the_registry_reads_its_declarations(monkeypatch):
    import sys

    import backends

    monkeypatch.syspath_prepend(str(REPO / "tests" / "toy_engine"))
    backends.refresh()
    try:
        assert "toy" in backends.engines() and backends.backend_class("toy").engine == "toy"
        assert "fp32" in backends.dtypes() and backends.running("gguf") == ("llamacpp",)
    finally:
        monkeypatch.setattr(sys, "path", [p for p in sys.path if not p.endswith("toy_engine")])
        backends.refresh()
    assert "toy" not in backends.engines()


def test_an_engine_that_cannot_be_imported_is_its_own_problem(monkeypatch):
    """A registered engine whose module fails to import leaves every other engine's values as they
    are; a cell naming it is skipped with the reason."""
    import backends
    from common.stack import Cell, StackDesc

    monkeypatch.setattr(backends, "registry", lambda: {**backends.BUILTIN, "gone": "no_such_module:Gone"})
    backends._loaded.cache_clear()
    try:
        assert "gone" not in backends.declared() and "bf16" in backends.dtypes()
        assert "no_such_module" in backends.broken()["gone"]
        cell = Cell(StackDesc.of("gone", "bf16", "default"), "s")
        assert "engine 'gone' (no_such_module:Gone" in backends.unsupported_reason(cell)
    finally:
        monkeypatch.undo()
        backends.refresh()
    assert backends.broken() == {} and "llamacpp" in backends.declared()


@pytest.fixture(scope="module")
def toy_run(tiny_model, short_corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    spec = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        include=[{"model": "tiny", "engine": "toy", "dtype": "fp32", "attention": "default"}],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
    )
    return spec, d / "wh"


def test_a_spec_naming_it_is_refused_without_it_and_valid_with_it(toy_run):
    spec, _ = toy_run
    r = run_cli("cells", str(spec), "--json", env={"PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "unknown engine" in r.stderr, r.stderr
    r = run_cli("cells", str(spec), "--json", env=TOY)
    assert r.returncode == 0, r.stderr
    assert "tiny.toy.fp32.default" in r.stdout


def test_its_cells_rows_land_in_the_warehouse(toy_run):
    spec, wh = toy_run
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local", "--json", env=TOY)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = sql(wh, "select cell_id, engine, status, rows_per_repeat from cells order by engine")
    assert [(c["engine"], c["status"]) for c in cells] == [("hf", "done"), ("toy", "done")], cells
    toy = cells[1]
    got = sql(wh, f"select count(*) as n, min(len(logits)) as v from logits where cell_id = '{toy['cell_id']}'")
    assert got == [{"n": toy["rows_per_repeat"], "v": 49152}] and toy["rows_per_repeat"] > 0, got
