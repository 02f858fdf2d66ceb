"""`matrix sql`, `analyze`, `report`, `verify`, `status`: what a warehouse holds and how it compares."""

from __future__ import annotations

import csv
import io
import sys

from common.errors import UserError
from common.output import emit_json, log, table


def cmd_sql(args) -> int:
    from matrix import api

    if args.export_views:
        if args.query:
            raise UserError("matrix sql: give a query or --export-views, not both")
        out = api.export_views(args.warehouse, args.export_views)
        log(
            f"wrote {out.file}: {out.tables} table views and {out.views} derived views; "
            f"open it with `duckdb -init {out.file}`"
        )
        return 0
    if not args.query:
        raise UserError("matrix sql: give a query (or --export-views FILE.sql)")
    result = api.sql(args.warehouse, args.query)
    cols, rows = list(result.columns), result.rows
    if args.format == "json":
        emit_json(result.to_dict())
    elif args.format == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        w.writerows(rows)
        sys.stdout.write(buf.getvalue())
    else:
        print(table(cols, [list(r) for r in rows]))
    return 0


def cmd_analyze(args) -> int:
    from matrix import api

    ranges = [int(x) for x in args.ranges.split(",") if x.strip()] if args.ranges else None
    result = api.analyze(
        args.warehouse,
        reference=args.reference,
        centroid=args.centroid,
        ranges=ranges,
        force=args.force,
        skip_damaged=args.skip_damaged,
        workers=args.workers,
        address=args.address,
        log=log,
    )
    if args.json:
        emit_json(result.to_dict())
    return 0


def cmd_report(args) -> int:
    from matrix import api

    result = api.report(args.warehouse, args.out)
    if args.json:
        emit_json(result.to_dict())
        return 0
    print(result.terminal())
    print(f"\nHTML report: {result.html}")
    return 0


def cmd_verify(args) -> int:
    from matrix import api
    from store.verify import Damage

    report = api.verify(args.warehouse, args.cells, log=log).report
    for path in report["damaged_files"]:
        hits = [d for d in report["damage"] if d["path"] == path]
        log(f"DAMAGED {path}: {len(hits)} problem(s); first: " + Damage(**hits[0]).detail())
    log(
        f"verified {report['shards']} shard(s), {report['rows']} rows, {report['bytes'] / 2**20:.1f} MiB in "
        f"{report['seconds']}s ({report['mib_per_s']} MiB/s): "
        + (f"{len(report['damaged_files'])} damaged file(s)" if report["damage"] else "no damage")
    )
    if args.json:
        emit_json(report)
    return 1 if report["damage"] else 0


def cmd_merge(args) -> int:
    from matrix import api

    result = api.merge(args.sources, args.into, log)
    for s in result.sources:
        log(
            f"{s.source}: {len(s.merged)} cell(s) merged, {len(s.already_present)} already in "
            f"{result.into}, {len(s.left_out)} left out"
        )
    if args.json:
        emit_json(result.to_dict())
    if result.damaged:
        log(f"{len(result.damaged)} cell(s) NOT merged (damaged shards; capture them again or copy them again):")
        for cid, why in result.damaged.items():
            log(f"  {cid}: {why}")
        return 1
    return 0


def cmd_status(args) -> int:
    from matrix import api

    result = api.status(args.warehouse)
    if args.json:
        emit_json(result.to_dict())
        return 0
    cells = [list(c.values()) for c in result.cells]
    runs = [list(r.values()) for r in result.runs]
    print(
        table(
            ["cell_id", "status", "repeats", "rows/repeat", "bit_reproducible", "reference", "why"],
            [list(r) for r in cells],
        )
    )
    print()
    print(
        table(["run_id", "status", "started_at", "cells_done", "cells_total", "rows_written"], [list(r) for r in runs])
    )
    return 0


def cmd_stacks(args) -> int:
    """Each stack's readable name (what card, admit, fixture and layers accept) and its latest cell."""
    from matrix import api

    result = api.stacks(args.warehouse)
    if args.json:
        emit_json(result.to_dict())
        return 0
    rows = result.stacks
    print(
        table(
            ["name", "status", "cells", "reference", "latest cell"],
            [[r["name"], r["status"], r["cells"], "yes" if r["is_reference"] else "", r["cell_id"]] for r in rows],
        )
    )
    return 0


def add_parsers(sub) -> None:
    _sql_parser(sub)
    _analyze_parser(sub)
    _report_parser(sub)
    _verify_parser(sub)
    _merge_parser(sub)
    _status_parser(sub)
    _stacks_parser(sub)


def _sql_parser(sub) -> None:
    """`matrix sql`: a read-only query over the views, or the views as a script."""
    q = sub.add_parser("sql", help="run a read-only DuckDB query over the warehouse views")
    q.add_argument("query", nargs="?")
    q.add_argument("--warehouse", default="warehouse")
    q.add_argument(
        "--export-views",
        metavar="FILE.sql",
        default=None,
        help="write the views as a SQL script for any DuckDB client (duckdb -init FILE.sql) and exit",
    )
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.set_defaults(func=cmd_sql)


def _analyze_parser(sub) -> None:
    """`matrix analyze`: where to compare against, what to recompute, where to compute it."""
    a = sub.add_parser("analyze", help="metrics of every stack vs its reference and vs the centroid")
    a.add_argument("--warehouse", default="warehouse")
    a.add_argument("--reference", default=None, help="cell_id to compare against (default: each model's reference)")
    a.add_argument("--ranges", default=None, help="position bucket edges, e.g. 512,2048,8192")
    a.add_argument(
        "--centroid",
        choices=["mean_prob", "mean_logprob", "none"],
        default=None,
        help="centroid definition (default: the spec's centroid.definition, else mean_prob; "
        "none: no centroid or pairwise tables)",
    )
    a.add_argument(
        "--skip-damaged",
        action="store_true",
        help="leave out shards that fail their row hashes or do not parse (default: refuse them)",
    )
    a.add_argument(
        "--force",
        action="store_true",
        help="recompute every output (default: only those whose inputs or metric kernel changed)",
    )
    a.add_argument(
        "--workers",
        type=int,
        default=None,
        help="pieces computed at once as Ray tasks (1: in this process; 0: one per CPU of the cluster; "
        "default: on the cluster the last run used if it is reachable, else 1)",
    )
    a.add_argument(
        "--address",
        default=None,
        help="Ray cluster to spread the pieces over (an object-store warehouse is read from every node)",
    )
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_analyze)


def _report_parser(sub) -> None:
    """`matrix report`: the terminal tables and the HTML report."""
    rp = sub.add_parser("report", help="terminal tables and a self-contained HTML report")
    rp.add_argument("--warehouse", default="warehouse")
    rp.add_argument("--out", default=None, help="directory for report.html (default: WAREHOUSE/report)")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_report)


def _verify_parser(sub) -> None:
    """`matrix verify`: every row against its hash, every file against its table."""
    v = sub.add_parser(
        "verify",
        help="check every row against its row_hash, every shard's row count and "
        "every table file; exit 1 on damage (reads only)",
    )
    v.add_argument("--warehouse", default="warehouse")
    v.add_argument(
        "--cells",
        nargs="+",
        default=None,
        metavar="CELL",
        help="only these cells' shards (a cell id, or the start of one, e.g. a stack id)",
    )
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)


def _merge_parser(sub) -> None:
    """`matrix merge`: warehouses captured elsewhere brought into one."""
    m = sub.add_parser("merge", help="bring warehouses captured elsewhere into one (every incoming row checked first)")
    m.add_argument("sources", nargs="+", metavar="SRC", help="a warehouse directory or object-store URI")
    m.add_argument("--into", required=True, metavar="WAREHOUSE", help="the destination (made when missing)")
    m.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    m.set_defaults(func=cmd_merge)


def _status_parser(sub) -> None:
    """`matrix status`: the cells and runs of a warehouse."""
    s = sub.add_parser("status", help="cells and runs recorded in a warehouse")
    s.add_argument("--warehouse", default="warehouse")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)


def _stacks_parser(sub) -> None:
    """`matrix stacks`: each stack's readable name and latest cell."""
    st = sub.add_parser(
        "stacks", help="each stack's readable name (card, admit, fixture and layers take it) and its latest cell"
    )
    st.add_argument("--warehouse", default="warehouse")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_stacks)
