"""The rows of the small tables: one builder per table, a key the schema lacks is refused."""

from __future__ import annotations

import pytest

from common import ids
from store import rows as R
from store.schema import TABLES


def test_a_misspelt_column_is_refused_not_dropped():
    with pytest.raises(KeyError, match="table cells has no column 'rows_per_repeet'"):
        R.cell_row("c", "r", "done", rows_per_repeet=3)
    with pytest.raises(KeyError, match="table runs has no column 'cell_total'"):
        R.run_row("r", "running", cell_total=1)


def test_rows_carry_their_columns_and_a_finish_time():
    row = R.cell_row("m.hf.fp32.eager.tp1.cpu-0123456789", "run-1", "skipped", skip_reason="why", host=None)
    assert set(row) <= set(TABLES["cells"].names)
    assert row["status"] == "skipped" and row["host"] is None and row["finished_at"].tzinfo is not None
    run = R.run_row("run-1", "running", started_at=R.now(), cells_total=2)
    done = R.run_finished(run, "done", cells_done=2)
    assert run["status"] == "running" and done["status"] == "done" and done["finished_at"] >= run["started_at"]


def test_ids_are_minted_in_one_place_and_are_stable():
    coords = {"model": "m", "engine": "hf", "dtype": "fp32", "attention": "eager", "tp": 1, "device": "cpu"}
    a = ids.stack_id(coords, {"stride": 32, "corpus": "x"})
    assert a == ids.stack_id(coords, {"corpus": "x", "stride": 32})  # key order does not matter
    assert a.startswith("m.hf.fp32.eager.tp1.cpu-") and len(a.rsplit("-", 1)[1]) == 10
    assert a != ids.stack_id(coords, {"stride": 16, "corpus": "x"})
    assert ids.prompt_id("cold", "ab" * 32) == "cold-" + "ab" * 6
    assert ids.run_id() != ids.run_id() and ids.run_id("import").startswith("import-")
