"""DuckDB views over the warehouse tables, for `matrix sql` and for analysis code."""

from __future__ import annotations

import os
import re
import time

import duckdb
import pyarrow as pa

from analysis import frontier as F
from analysis.aggregates import agg, bucket_values, position_bucket_values, select_sql
from common import metric_defs as D
from common import plugins
from common.errors import UserError, first_line
from common.files import SETTLED_S
from store import TABLES, Warehouse
from store.warehouse import logits_matrix

READ_ONLY = {"SELECT", "EXPLAIN"}


def dict_rows(con: duckdb.DuckDBPyConnection, sql: str, params=()) -> list[dict]:
    """One query's rows as {column: value} dicts."""
    rel = con.execute(sql, list(params))
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r)) for r in rel.fetchall()]


def connect(warehouse: str, names: set[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table, named like the table, and the derived views;
    names: only those tables and views (`referenced`), None: all of them."""
    wh = Warehouse(warehouse).require()
    con = duckdb.connect(":memory:")
    for table, schema in TABLES.items():
        if names is not None and table not in names:
            continue
        files = wh.table_files(table) if wh.remote else readable(wh.table_files(table), table)
        # The empty table carries every column of the current schema: an empty table still has its
        # columns, and files written before a migration added a column read as null there.
        con.register(f"_empty_{table}", pa.table({f.name: pa.array([], f.type) for f in schema}))
        cols = ", ".join(f.name for f in schema)
        if files and wh.remote:
            # DuckDB reads the object store through Arrow (pyarrow's filesystem, the AWS chain):
            # no DuckDB extension to download, the same credentials as the writer's
            import pyarrow.dataset as ds

            con.register(f"_files_{table}", ds.dataset(files, schema=schema, format="parquet", filesystem=wh.loc.fs))
            con.execute(f"CREATE VIEW {table} AS SELECT {cols} FROM _files_{table}")
        elif files:
            paths = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
            con.execute(
                f"CREATE VIEW {table} AS SELECT {cols} FROM (SELECT * FROM _empty_{table} UNION ALL BY NAME "
                f"SELECT * FROM read_parquet([{paths}], union_by_name = true))"
            )
        else:
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
    register_functions(con)
    for name, body in all_views().items():  # in an order where a view comes after those it reads
        if names is None or name in names:
            con.execute(f"CREATE VIEW {name} AS {body}")
    return con


# Words that read DuckDB's catalog: a statement with one of them sees every table and view.
_CATALOG = re.compile(r"\b(information_schema|duckdb_\w+|pg_\w+|pragma_\w+|sqlite_\w+|show|describe|summarize)\b", re.I)


def referenced(sql: str) -> set[str] | None:
    """The tables and derived views a statement names, with those its views read (None: all, for
    a statement that lists the catalog). Creating a view binds it, which reads the footers of its
    tables' files: a query pays only for what it reads."""
    if _CATALOG.search(sql):
        return None
    views = all_views()
    known, found, texts = set(TABLES) | set(views), set(), [sql]
    while texts:
        text = texts.pop()
        for name in known - found:
            if re.search(rf"\b{name}\b", text, re.I):
                found.add(name)
                texts.append(views.get(name, ""))
    return found


def readable(files: list[str], table: str) -> list[str]:
    """The files whose Parquet footer reads; each other one is named on stderr and left out of its
    view, so one damaged file never takes every query down (`matrix verify` says what is wrong)."""
    import sys

    import pyarrow.parquet as pq

    ok = []
    for f in files:
        try:
            st = os.stat(f)
            if _FOOTER_READ.get(f) == (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                ok.append(f)
                continue
            pq.read_metadata(f)
        except Exception as e:
            why = first_line(str(e), type(e).__name__)
            print(
                f"matrix: warning: {f}: damaged ({why}); left out of the {table} view (run `matrix verify`)",
                file=sys.stderr,
            )
            continue
        if time.time() - st.st_ctime_ns / 1e9 > SETTLED_S:  # as file_sha256: never a file changed just now
            _FOOTER_READ[f] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        ok.append(f)
    return ok


# Files whose footer read, by inode, size, mtime and ctime (any write or rename moves one), once they
# have settled: a process that queries again (the API, a notebook) reads only the footers of new or
# changed files.
_FOOTER_READ: dict[str, tuple[int, int, int, int]] = {}


# Derived views over the analysis tables (`matrix analyze` fills them). Repeat 0 is the capture;
# other repeats only feed the resolution floor (the reference's repeat-to-repeat KL).
VIEWS = {
    "summary": f"""
        WITH m AS (SELECT * FROM metrics WHERE repeat = 0),
        floor AS (SELECT reference_cell_id, {agg("mean", "kld")} AS reference_repeat_kld FROM metrics
                  WHERE cell_id = reference_cell_id AND repeat > 0 GROUP BY ALL)
        SELECT c.model, m.cell_id, c.engine, c.dtype, c.attention, m.reference_cell_id,
               m.cell_id = m.reference_cell_id AS is_reference, count(*) AS rows,
               -- the registry's aggregates (common/metric_defs.py, analysis/aggregates.py)
               {select_sql(D.SUMMARY)},
               count(m.nonfinite) AS nonfinite_rows,  -- flagged rows: null metrics, left out of every mean
               -- perplexity over the rows that have a next token, as llama-perplexity reports it
               {agg("exp_mean", "m.nll_stack")} AS ppl, {agg("exp_mean", "m.nll_ref")} AS ppl_ref,
               {agg("exp_mean", "m.nll_stack - m.nll_ref")} AS ppl_ratio,
               corr(m.nll_stack, m.nll_ref) AS nll_correlation,
               coalesce(any_value(f.reference_repeat_kld), 0) AS reference_repeat_kld,
               any_value(c.bit_reproducible) AS bit_reproducible,
               NOT (m.cell_id = m.reference_cell_id) AND {agg("mean", "m.kld")} <= 3 * greatest(
                   {agg("mean", "m.storage_floor")}, coalesce(any_value(f.reference_repeat_kld), 0))
                   AS below_resolution
        FROM m JOIN cells c ON c.cell_id = m.cell_id LEFT JOIN floor f ON f.reference_cell_id = m.reference_cell_id
        GROUP BY c.model, m.cell_id, c.engine, c.dtype, c.attention, m.reference_cell_id
        UNION ALL BY NAME  -- the reference itself: its repeat 0 is the yardstick (zero by definition, not measured)
        SELECT c.model, c.cell_id, c.engine, c.dtype, c.attention, c.cell_id AS reference_cell_id,
               true AS is_reference, c.rows_per_repeat AS rows,
               {select_sql(D.SUMMARY, reference=True)},
               0 AS nonfinite_rows, ref_ppl.ppl, ref_ppl.ppl AS ppl_ref, 1.0 AS ppl_ratio, 1.0 AS nll_correlation,
               coalesce(f.reference_repeat_kld, 0) AS reference_repeat_kld,
               c.bit_reproducible, false AS below_resolution
        FROM cells c LEFT JOIN floor f ON f.reference_cell_id = c.cell_id
        -- its own rows, each once: every cell measured against it gives a row's nll_ref, the same
        -- up to the rounding of its own comparison's sums (a stored bf16 pair sums in another order)
        LEFT JOIN (SELECT reference_cell_id, {agg("exp_mean", "nll_ref")} AS ppl FROM (
                       SELECT reference_cell_id, prompt_id, position, min(nll_ref) AS nll_ref FROM metrics
                       WHERE nll_ref IS NOT NULL GROUP BY ALL) GROUP BY ALL) ref_ppl
                  ON ref_ppl.reference_cell_id = c.cell_id
        WHERE c.cell_id IN (SELECT DISTINCT reference_cell_id FROM metrics)
          AND c.cell_id NOT IN (SELECT cell_id FROM m)""",
    "summary_by_range": f"""
        SELECT m.cell_id, r.range, r.lo, p.category, count(*) AS rows, count(m.nonfinite) AS nonfinite_rows,
               {select_sql(D.BY_RANGE)}
        FROM metrics m JOIN metrics_ranges r ON m.position >= r.lo AND m.position < r.hi
        JOIN prompts p USING (prompt_id)
        WHERE m.repeat = 0
        GROUP BY GROUPING SETS ((m.cell_id, r.range, r.lo), (m.cell_id, r.range, r.lo, p.category))""",
    # KL by how sure the reference was: rows bucketed by the reference's top-1 probability
    # (metrics.p_top1_ref; common/metric_defs.py CONFIDENCE_EDGES: [lo, hi), the last bucket [0.9, 1.0]).
    # A row without it (a flagged NaN/Inf row, a metrics file older than the column) is in no bucket.
    "kld_by_confidence": f"""
        WITH b AS (SELECT * FROM (VALUES {bucket_values()}) e(lo, hi))
        SELECT m.cell_id, m.reference_cell_id, b.lo, b.hi, count(*) AS rows, {select_sql(D.BY_CONFIDENCE)}
        FROM metrics m JOIN b ON m.p_top1_ref >= b.lo AND (m.p_top1_ref < b.hi OR b.hi = 1.0)
        WHERE m.repeat = 0
        GROUP BY m.cell_id, m.reference_cell_id, b.lo, b.hi""",
    # KL by how far into its prompt a row is: repeat-0 rows bucketed by position (common/metric_defs.py
    # POSITION_BUCKETS: [lo, hi), hi null for the open last bucket), per model, cell and reference.
    # A flagged (NaN/Inf) row counts in rows and nonfinite_rows; its null metrics are in no mean.
    "position_buckets": f"""
        WITH b AS (SELECT * FROM (VALUES {position_bucket_values()}) e(bucket, lo, hi))
        SELECT c.model, m.cell_id, m.reference_cell_id, b.bucket, b.lo, b.hi, count(*) AS rows,
               count(m.nonfinite) AS nonfinite_rows, {select_sql(D.BY_POSITION)}
        FROM metrics m JOIN b ON m.position >= b.lo AND (b.hi IS NULL OR m.position < b.hi)
        JOIN cells c ON c.cell_id = m.cell_id
        WHERE m.repeat = 0
        GROUP BY c.model, m.cell_id, m.reference_cell_id, b.bucket, b.lo, b.hi""",
    "disagreement_clusters": """
        WITH m AS (SELECT cell_id, prompt_id, position, top1_match,
                          row_number() OVER (PARTITION BY cell_id, prompt_id ORDER BY position) AS rn
                   FROM metrics WHERE repeat = 0),
        d AS (SELECT *, rn - row_number() OVER (PARTITION BY cell_id, prompt_id ORDER BY position) AS grp
              FROM m WHERE NOT top1_match)  -- a flagged (NaN) row has top1_match null: not a disagreement
        SELECT cell_id, prompt_id, min(position) AS start_position, max(position) AS end_position,
               count(*) AS sampled_positions
        FROM d GROUP BY cell_id, prompt_id, grp""",
    "centroid_summary": f"""
        SELECT c.model, coalesce(m.centroid_group, c.model) AS centroid_group, m.cell_id,
               any_value(m.is_reference) AS is_reference, count(*) AS rows,
               count(*) FILTER (WHERE m.nonfinite) AS nonfinite_rows,
               {agg("mean", "m.kld_centroid_stack")} AS kld_centroid_stack,
               {agg("mean", "m.kld_stack_centroid")} AS kld_stack_centroid,
               {agg("mean", "m.js_centroid")} AS js_centroid,
               rank() OVER (PARTITION BY c.model, coalesce(m.centroid_group, c.model)
                            ORDER BY {agg("mean", "m.kld_centroid_stack")}) AS rank_closest
        FROM centroid_metrics m JOIN cells c USING (cell_id)
        GROUP BY c.model, coalesce(m.centroid_group, c.model), m.cell_id""",
    # Per-layer agreement: one row per (cell, layer) of repeat 0, shallowest first, with
    # the row where each of the two gates (cosine, norm ratio) is worst; `matrix layers CELL --gates` gives the verdict.
    "layer_summary": f"""
        SELECT c.model, m.cell_id, c.engine, c.dtype, m.reference_cell_id, m.layer, m.layer_index,
               count(*) AS rows, {agg("min", "m.cosine")} AS cosine_min, {agg("mean", "m.cosine")} AS cosine_mean,
               arg_min(m.prompt_id || '@' || m.position, m.cosine) AS cosine_worst_at,
               {agg("min", "m.norm_ratio")} AS norm_ratio_min, {agg("max", "m.norm_ratio")} AS norm_ratio_max,
               {agg("max_dev1", "m.norm_ratio")} AS norm_ratio_dev_max,
               arg_max(m.prompt_id || '@' || m.position, abs(m.norm_ratio - 1)) AS norm_ratio_worst_at,
               {agg("mean", "m.rel_l2")} AS rel_l2_mean, {agg("max", "m.rel_l2")} AS rel_l2_max,
               {agg("max", "m.max_abs_diff")} AS max_abs_diff, {agg("share", "m.allclose")} AS allclose_share
        FROM layer_metrics m JOIN cells c USING (cell_id)
        WHERE m.repeat = 0
        GROUP BY ALL""",
    # Off the plain prefill: per cell, the rows a per-cell extra wrote to its d<repeat> file (rows_of:
    # decoded from a KV cache, recomputed from a warm cache, ...). path 'prefill': the cell's own
    # prefill rows there vs the reference's; path = rows_of: those rows vs the reference's prefill
    # rows, with their consistency with the same cell's prefill row (kld / max |diff| / identical).
    "ppl_by_prompt": f"""
        SELECT m.cell_id, m.reference_cell_id, m.prompt_id, p.name, count(m.nll_stack) AS rows,
               {agg("exp_mean", "m.nll_stack")} AS ppl, {agg("exp_mean", "m.nll_ref")} AS ppl_ref
        FROM metrics m JOIN prompts p USING (prompt_id) WHERE m.repeat = 0 GROUP BY ALL""",
    "summary_by_path": f"""
        WITH d AS (SELECT *, coalesce(path, 'decode') AS rows_of FROM decode_metrics WHERE repeat = 0)
        SELECT c.model, d.cell_id, c.engine, c.dtype, d.reference_cell_id, d.rows_of, d.path, count(*) AS rows,
               CASE WHEN d.path = 'prefill' THEN {agg("mean", "d.kld_prefill")} ELSE {agg("mean", "d.kld")} END
                   AS kld_mean,
               CASE WHEN d.path = 'prefill' THEN {agg("max", "d.kld_prefill")} ELSE {agg("max", "d.kld")} END
                   AS kld_max,
               CASE WHEN d.path <> 'prefill' THEN {agg("share", "d.top1_match")} END AS top1_agreement,
               CASE WHEN d.path <> 'prefill' THEN {agg("mean", "d.kld_vs_prefill")} END AS kld_vs_prefill_mean,
               CASE WHEN d.path <> 'prefill' THEN {agg("max", "d.max_abs_diff_vs_prefill")} END
                   AS max_abs_diff_vs_prefill,
               CASE WHEN d.path <> 'prefill' THEN {agg("share", "d.identical_to_prefill")} END AS identical_share,
               CASE WHEN d.path <> 'prefill' THEN {agg("share", "d.top1_match_prefill")} END AS top1_agreement_prefill,
               CASE WHEN d.path <> 'prefill' THEN {agg("mean", "d.cached_tokens")} END AS cached_tokens_mean
        FROM (SELECT d.* EXCLUDE (path), CASE WHEN q.own THEN 'prefill' ELSE d.rows_of END AS path
              FROM d CROSS JOIN (VALUES (true), (false)) q(own)) d
             JOIN cells c USING (cell_id)
        GROUP BY c.model, d.cell_id, c.engine, c.dtype, d.reference_cell_id, d.rows_of, d.path""",
    # Byte identity of one stack across hosts (replicas) and engine builds: every pair of its
    # captured cells, compared row by row on the row hashes of repeat 0 (no logits are read).
    "stack_identity": """
        WITH s AS (SELECT cell_id, coalesce(stack_id, regexp_replace(split_part(cell_id, '@', 1),
                                                                     '\\.r[0-9]+$', '')) AS stack_id,
                          coalesce(replica, 0) AS replica, build, host, node_id
                   FROM cells WHERE status = 'done'),
        h AS (SELECT cell_id, prompt_id, position, row_hash FROM logits WHERE repeat = 0 AND path IS NULL)
        SELECT a.stack_id, a.cell_id AS cell_a, b.cell_id AS cell_b, a.host AS host_a, b.host AS host_b,
               a.node_id AS node_a, b.node_id AS node_b, a.build AS build_a, b.build AS build_b,
               a.replica AS replica_a, b.replica AS replica_b, count(*) AS rows,
               count(*) FILTER (WHERE ha.row_hash = hb.row_hash) AS identical_rows,
               bool_and(ha.row_hash = hb.row_hash) AS identical
        FROM s a JOIN s b ON a.stack_id = b.stack_id AND a.cell_id < b.cell_id
        JOIN h ha ON ha.cell_id = a.cell_id
        JOIN h hb ON hb.cell_id = b.cell_id AND hb.prompt_id = ha.prompt_id AND hb.position = ha.position
        GROUP BY ALL""",
    F.VIEW: F.VIEW_SQL,  # after summary, which it reads
}


# What each view answers, one line each (docs/warehouse.md is generated from these and the views' columns).
VIEW_ABOUT = {
    "summary": "one row per measured cell against its reference: KL (mean, s.e., median, p90-p99.9, max), reverse "
    "KL, JS, top-1 agreement, NMSE, max |Δlogit|, Spearman, perplexity of both and their ratio, the "
    "storage floor, flagged rows, and the reference's repeat-to-repeat KL (its resolution)",
    "summary_by_range": "the summary's KL figures per position range (`--ranges`), and per range and prompt category",
    "kld_by_confidence": "each measured cell's KL and top-1 agreement by how sure its reference was: rows bucketed by "
    "the reference's top-1 probability, in tenths",
    "position_buckets": "each measured cell's KL (mean, s.e.), top-1 agreement and mean Δp of the next token by "
    f"how far into its prompt a row is: positions {', '.join(b[0] for b in D.POSITION_BUCKETS)} "
    "(`hi` null: no upper bound)",
    "disagreement_clusters": (
        "runs of consecutive sampled positions where a cell's top-1 token differs from its reference's"
    ),
    "centroid_summary": "each cell against the centroid of its group: KL both ways, JS, and its rank by closeness",
    "layer_summary": "per (cell, layer) of a `layers:` cell: cosine and norm ratio against the reference's hidden "
    "states, with the rows where each is worst",
    "ppl_by_prompt": "perplexity of each cell and of its reference over each prompt's scored rows",
    "summary_by_path": "rows off the plain prefill (decoded a token at a time, served by a prefix cache) against "
    "the reference's prefill rows and against the same cell's own prefill rows",
    "stack_identity": "every pair of captured cells of one stack (replicas, builds): how many rows are byte-identical",
    F.VIEW: F.VIEW_ABOUT,
}


def all_views() -> dict[str, str]:
    """{view: SQL}: the core's, then those the plug-ins declare (extras.Extra.views, through
    common/plugins.py)."""
    return {**VIEWS, **{name: body for name, (body, _) in plugins.provider.views().items()}}


def view_about() -> dict[str, str]:
    """{view: what it answers, in one line}, the plug-ins' included."""
    return {**VIEW_ABOUT, **{name: about for name, (_, about) in plugins.provider.views().items()}}


def view_columns() -> dict[str, list[tuple[str, str]]]:
    """{view: [(column, DuckDB type)]} of every derived view, from an empty warehouse of this schema."""
    con = duckdb.connect(":memory:")
    views = all_views()
    try:
        for table, schema in TABLES.items():
            con.register(f"_empty_{table}", pa.table({f.name: pa.array([], f.type) for f in schema}))
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
        for name, body in views.items():
            con.execute(f"CREATE VIEW {name} AS {body}")
        return {name: [(c[0], c[1]) for c in con.execute(f"DESCRIBE {name}").fetchall()] for name in views}
    finally:
        con.close()


def _pair_udf(fn):
    def udf(a, b):
        ra, rb = logits_matrix(a), logits_matrix(b)
        if ra.shape != rb.shape:
            raise ValueError(f"logits of different shapes {ra.shape} vs {rb.shape}")
        return pa.array(fn(ra, rb))

    return udf


def register_functions(con: duckdb.DuckDBPyConnection) -> None:
    """kld(a, b) = KL(P_a || P_b), kld_reverse, js, top1(a, b) over two logits columns."""
    from duckdb.sqltypes import BOOLEAN, DOUBLE, FLOAT

    from analysis import metrics as M

    lst = duckdb.list_type(FLOAT)
    fns = {
        "kld": (lambda a, b: M.row_metrics(a, b)["kld"], DOUBLE),
        "kld_reverse": (lambda a, b: M.row_metrics(a, b)["kld_reverse"], DOUBLE),
        "js": (lambda a, b: M.row_metrics(a, b)["js"], DOUBLE),
        "top1": (lambda a, b: a.argmax(-1) == b.argmax(-1), BOOLEAN),
        "cosine": (lambda a, b: M.row_metrics(a, b)["cosine"], DOUBLE),
    }
    for name, (fn, ret) in fns.items():
        con.create_function(name, _pair_udf(fn), [lst, lst], ret, type="arrow")


def query(warehouse: str, sql: str):
    """Run one read-only statement; returns (column names, rows)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise UserError(f"SQL: {str(e).splitlines()[0]}") from None
    if not statements:
        raise UserError("SQL: empty query")
    for st in statements:
        kind = st.type.name
        if kind not in READ_ONLY:
            raise UserError(f"SQL: matrix sql is read-only; {kind} statements are not allowed")
    con = connect(warehouse, referenced(sql))
    try:
        rel = con.execute(sql)
        cols = [d[0] for d in rel.description]
        return cols, rel.fetchall()
    except duckdb.Error as e:
        raise UserError(f"SQL: {str(e).splitlines()[0]}") from None
    finally:
        con.close()
