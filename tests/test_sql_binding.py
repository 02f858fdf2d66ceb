"""Which tables and views `matrix sql` binds for a statement (analysis.sql.referenced): the ones it
names and those they read, every one for a statement that lists the catalog."""

from __future__ import annotations

import pytest

from analysis.sql import VIEWS, referenced


def test_a_view_brings_the_tables_and_views_it_reads():
    got = referenced("SELECT cell_id, kld_mean FROM Summary WHERE kld_mean > 0.01")
    assert {"summary", "metrics", "cells"} <= got
    assert "logits" not in got and "batch_drift" not in got
    assert referenced("select 1 as x") == set()


def test_a_name_inside_a_longer_one_is_not_a_reference():
    got = referenced("select * from batch_metrics")
    assert "batch_metrics" in got and "metrics" not in got
    assert referenced("select count(*) from metrics_ranges") == {"metrics_ranges"}


@pytest.mark.parametrize(
    "statement",
    [
        "SHOW TABLES",
        "describe cells",
        "SUMMARIZE logits",
        "select table_name from information_schema.tables",
        "select * from duckdb_views()",
        "select * from pg_tables",
        "select * from pragma_table_info('cells')",
        "select name from sqlite_master",
    ],
)
def test_a_statement_that_lists_the_catalog_gets_every_view(statement):
    assert referenced(statement) is None


def test_each_view_comes_after_the_views_it_reads():
    seen: set[str] = set()
    for name, body in VIEWS.items():
        reads = (referenced(body) or set()) & set(VIEWS)
        assert reads <= seen, (name, reads - seen)
        seen.add(name)
