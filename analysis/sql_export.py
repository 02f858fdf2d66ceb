"""`matrix sql --export-views`: the warehouse's views as a SQL script any DuckDB client opens."""

from __future__ import annotations

import os
from pathlib import Path

from analysis.sql import all_views, connect, readable
from store import TABLES, Warehouse
from store.schema import SCHEMA_VERSION


def export_views(warehouse: str, out: str) -> dict:
    """A SQL script that gives any DuckDB client (the CLI: `duckdb -init FILE`, or `.read FILE`)
    the warehouse's table views and derived views, over the Parquet files themselves.

    Table views read a glob, so cells captured later show up without exporting again; a table
    with a damaged file at export time lists its readable files instead (named in a comment).
    The row functions (kld, js, top1, ...) are Python: analysis.sql.connect() registers them."""
    wh = Warehouse(warehouse).require()
    con = connect(warehouse)  # for the column types DuckDB gives each table
    lines = [
        f"-- logit-matrix views over {wh.where} (schema v{getattr(wh, 'version', SCHEMA_VERSION)}); "
        "made by `matrix sql --export-views`.",
        "-- Open with: duckdb -init THIS_FILE   (or .read THIS_FILE in a DuckDB session).",
    ]
    if wh.remote:
        lines.append("-- An object-store warehouse: load DuckDB's httpfs and give it the store's credentials first.")
    damaged = {}
    for table in TABLES:
        cols = con.execute(f"DESCRIBE {table}").fetchall()  # (name, type, ...)
        empty = "SELECT " + ", ".join(f"NULL::{c[1]} AS {c[0]}" for c in cols) + " WHERE false"
        files = wh.table_files(table)
        ok = files if wh.remote else readable(files, table)
        if len(ok) < len(files):
            damaged[table] = sorted(set(files) - set(ok))
            lines.append(f"-- {table}: left out (damaged): " + ", ".join(damaged[table]))
        if not ok:
            src = empty
        else:
            # a local warehouse by its absolute path: the script works from any directory
            if damaged.get(table):
                paths = "[" + ", ".join(_lit(f if wh.remote else os.path.abspath(f)) for f in ok) + "]"
            else:
                glob = f"{table}/*/*.parquet" if table in ("logits", "layer_states") else f"{table}/*.parquet"
                paths = _lit(f"{wh.where.rstrip('/')}/{glob}" if wh.remote else os.path.abspath(wh.loc.path(glob)))
            src = f"SELECT * FROM ({empty}) UNION ALL BY NAME SELECT * FROM read_parquet({paths}, union_by_name = true)"
        lines.append(f"CREATE OR REPLACE VIEW {table} AS SELECT {', '.join(c[0] for c in cols)} FROM ({src});")
    views = all_views()
    for name, body in views.items():
        lines.append(f"CREATE OR REPLACE VIEW {name} AS {body.strip()};")
    con.close()
    text = "\n".join(lines) + "\n"
    Path(out).write_text(text)
    return {"file": str(out), "tables": len(TABLES), "views": len(views), "damaged": damaged}


def _lit(path: str) -> str:
    return "'" + str(path).replace("'", "''") + "'"
