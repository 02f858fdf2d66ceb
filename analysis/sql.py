"""DuckDB views over the warehouse tables, for `matrix sql` and for analysis code."""

from __future__ import annotations

import duckdb
import pyarrow as pa

from matrix.errors import UserError
from store import TABLES, Warehouse

READ_ONLY = {"SELECT", "EXPLAIN"}


def connect(warehouse: str) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table, named like the table."""
    wh = Warehouse(warehouse).require()
    con = duckdb.connect(":memory:")
    for table, schema in TABLES.items():
        files = wh.table_files(table)
        if files:
            paths = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet([{paths}], union_by_name = true)")
        else:
            # An empty table still has its columns, so queries written in advance run.
            con.register(f"_empty_{table}", pa.table({f.name: pa.array([], f.type) for f in schema}))
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
    return con


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
    con = connect(warehouse)
    try:
        rel = con.execute(sql)
        cols = [d[0] for d in rel.description]
        return cols, rel.fetchall()
    except duckdb.Error as e:
        raise UserError(f"SQL: {str(e).splitlines()[0]}") from None
    finally:
        con.close()
