"""The schema's versions: every one from 2 to the current has an entry that says what it changed,
and an older warehouse is brought up version by version, the steps that change data run and the
others only move the marker."""

from __future__ import annotations

import json

import extras  # noqa: F401  (the plug-ins declare their tables)
from store.migrations import MIGRATIONS
from store.schema import SCHEMA_VERSION
from store.warehouse import MARKER, Warehouse


def test_every_version_says_what_it_changed():
    assert sorted(MIGRATIONS) == list(range(2, SCHEMA_VERSION + 1))
    assert all(m.changed.strip() and m.name for m in MIGRATIONS.values())
    assert {v for v, m in MIGRATIONS.items() if m.step} == {
        2,
        9,
        16,
        17,
        19,
    }  # new tables' directories; the rest add columns


def test_an_old_warehouse_is_brought_up_one_version_at_a_time(tmp_path):
    (tmp_path / MARKER).write_text(json.dumps({"format": "logit-matrix-warehouse", "schema_version": 1}))
    wh = Warehouse(tmp_path)
    assert wh.check() and wh.version == 1
    said = []
    wh.migrate(said.append)
    assert json.loads((tmp_path / MARKER).read_text())["schema_version"] == SCHEMA_VERSION
    assert len(said) == SCHEMA_VERSION - 1
    assert said[-1].endswith(f"schema_version {SCHEMA_VERSION} ({MIGRATIONS[SCHEMA_VERSION].name})")
    assert all(
        (tmp_path / t).is_dir()
        for t in (
            "tokenizer_parity",
            "layer_states",
            "layer_metrics",
            "decode_metrics",
            "batch_metrics",
            "kv_cache_metrics",
        )
    )
    assert Warehouse(tmp_path).check()
