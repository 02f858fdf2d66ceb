"""The `matrix` command line (also `python -m matrix`)."""

from __future__ import annotations

import argparse
import csv
import io
import os
import signal
import sys

from common.errors import UserError
from common.output import emit_json, log, table
from matrix.corpus import CONFIGS

DEFAULT_SPEC = CONFIGS / "smoke.yaml"


def _brief(opts: dict) -> str:
    """Options in one cell of a table: an imatrix by its text and chunks."""
    def one(k, v):
        if k == "imatrix":
            return f"imatrix={v['corpus']}" + (f" x{v['chunks']}" if v.get("chunks") else "")
        return f"{k}={v}"
    return " ".join(one(k, v) for k, v in opts.items())


def cmd_cells(args) -> int:
    from matrix.cells import load_spec
    from matrix.cli_layers import human, layer_brief, layer_sizes, off_prefill
    from matrix.cli_builds import build_columns

    spec = load_spec(args.spec)
    sizes = layer_sizes(spec)
    cells = [{**c.axes(), "threads": c.threads, "options": c.opts, "max_tokens": c.max_tokens, "cell_id": c.cell_id,
              "layer_states": sizes.get(c.cell_id),
              "decode": None if c.decode is None else {"steps": c.decode[0], "at": list(c.decode[1])},
              "prefix_cache": "check" if c.prefix_cache else None,
              "replica": c.replica, "reference": c.cell_id in spec.reference_cells.values(),
              "candidate": None if c.artifact is None else {"file": c.artifact, "sha256": c.artifact_sha256,
                                                            "label": c.label}} for c in spec.cells]
    nodes, answers = _known_nodes(args.address, args.cluster_config, spec if args.warehouse else None)
    placed = None
    if nodes is not None:
        from matrix import placement

        placed = {c.cell_id: placement.where(c.device, c.tp, placement.cell_threads(c, nodes), nodes) for c in spec.cells}
    for c in cells:
        if placed:
            c["placement"] = str(placed[c["cell_id"]])
    builds = build_columns(spec, args.warehouse, answers) if args.warehouse else None
    for c in cells:
        if builds:
            c.update(builds[c["cell_id"]])
    if args.json:
        emit_json({"spec": str(spec.path), "cells": cells, "skipped": spec.skipped,
                   "stride": spec.stride, "positions": spec.positions.to_dict(), "repeats": spec.repeats,
                   "corpus": spec.corpus})
    else:
        decoding = any(c["decode"] or c["prefix_cache"] for c in cells)
        cols = ["cell_id", "role", "options"] + (["layer states"] if sizes else []) + (["off prefill"] if decoding else []) \
            + (["placement"] if placed else []) + (["build", "captured by", "a run"] if builds else [])
        print(table(cols, [[c["cell_id"], "reference" if c["reference"] else
                            f"candidate: {c['candidate']['label']}" if c["candidate"] else "", _brief(c["options"])]
                           + ([layer_brief(c["layer_states"])] if sizes else [])
                           + ([off_prefill(c)] if decoding else [])
                           + ([placed[c["cell_id"]].brief()] if placed else [])
                           + ([c["build"] or "?", ", ".join(b["build"] or "unrecorded" for b in c["captured"]) or "-",
                               c["action"]] if builds else []) for c in cells]))
        if spec.skipped:
            print(f"\nskipped ({len(spec.skipped)}):")
            print(table(["combination", "reason"], [[s["cell_id"], s["reason"]] for s in spec.skipped]))
        print(f"\n{len(cells)} cell(s), {len(spec.skipped)} skipped; {spec.positions.describe()} (stride {spec.stride}), "
              f"repeats {spec.repeats}")
        if sizes:
            total = sum(v["bytes_estimate"] for v in sizes.values())
            print(f"layer states: {human(total)} over {len(sizes)} cell(s) (states x hidden x rows at the "
                  "engine's native width; hidden states barely compress)")
    if nodes is not None:
        placement.check_placement(spec.cells, nodes, lambda msg: None)  # the same exit 2 as `matrix run`
    return 0


def _known_nodes(address: str | None, cluster_config: str | None, probe_spec=None) -> tuple[list | None, dict | None]:
    """Live nodes of --address plus the node types of the launcher config (None: neither given),
    and with probe_spec, the engine build of each node its cells can use (matrix/builds.py)."""
    from matrix import cluster, placement

    if not address and not cluster_config:
        return None, None
    config = cluster_config or placement.default_cluster_config(address)
    if not address:
        return placement.known_nodes([], config), None
    answers = None
    ray = cluster.init_ray(address)
    try:
        known = placement.known_nodes(placement.cluster_nodes(), config)
        if probe_spec is not None:
            from matrix import builds
            from matrix.models import fetch

            placement.check_placement(probe_spec.cells, known, lambda msg: None)
            models = {n: fetch(ref, log=log) for n, ref in probe_spec.models.items()}
            answers = builds.probe(probe_spec.cells, models, known, log)
    finally:
        ray.shutdown()
    return known, answers


def cmd_models(args) -> int:
    from matrix import models

    if args.action == "list":
        rows = [models.catalog_row(m) for m in models.CATALOG.values()]
        if args.json:
            emit_json(rows)
        else:
            print(table(list(rows[0]), [list(r.values()) for r in rows]))
        return 0
    from matrix.spec import ModelRef

    if args.name not in models.CATALOG:
        raise UserError(f"models fetch: unknown catalog model {args.name!r} (known: {', '.join(models.CATALOG)})")
    resolved = models.fetch(ModelRef(args.name, "catalog", args.name), log=log)
    if args.action == "cut":
        from pathlib import Path

        if args.layers < 1:
            raise UserError(f"models cut: --layers must be at least 1, got {args.layers}")
        out = Path(args.out)
        if out.is_file() or (out.is_dir() and any(out.iterdir())):
            raise UserError(f"models cut: {out} exists{'' if out.is_file() else ' and is not empty'}")
        if args.gguf and args.bf16:
            raise UserError("models cut: --gguf keeps the source's own quantisation; --bf16 does not apply")
        if args.gguf:
            from store.gguf_cut import cut_gguf

            if not resolved.gguf_path:
                raise UserError(f"models cut: {args.name} has no source GGUF to cut")
            cut_gguf(Path(resolved.gguf_path), out, args.layers)
            size = out.stat().st_size
        else:
            models.cut_layers(Path(resolved.hf_dir), out, args.layers, bf16=args.bf16)
            size = sum(f.stat().st_size for f in out.iterdir())
        info = {"name": args.name, "layers": args.layers, "bf16": args.bf16, "gguf": args.gguf,
                "path": str(out), "bytes": size}
        if args.json:
            emit_json(info)
        else:
            print(f"{args.name} cut to {args.layers} layer(s): {out} ({info['bytes'] / 2**20:.1f} MiB)")
        return 0
    if args.json:
        emit_json(resolved.to_dict())
    else:
        print(f"{resolved.name}: {resolved.hf_dir}\n  source {resolved.source}\n"
              f"  source sha256 {resolved.source_sha256}\n  weights sha256 {resolved.weights_sha256}"
              + (f"\n  license {resolved.license}" if resolved.license else "")
              + "".join(f"\n  notice {n}" for n in resolved.notices))
    return 0


def cmd_run(args) -> int:
    from matrix import cluster, placement, runner
    from matrix.cells import load_spec
    from store import Warehouse

    spec = load_spec(args.spec)
    if args.cluster_config:
        placement.node_types(args.cluster_config)  # a bad file fails here, before any work
    wh = Warehouse(args.warehouse)
    wh.check()  # an incompatible warehouse fails here, before anything is written
    for s in spec.skipped:
        log(f"skipping {s['cell_id']}: {s['reason']}")
    plan = runner.prepare(spec, wh, log)
    summary = None
    config = args.cluster_config or placement.default_cluster_config(args.address)
    wh.create()
    with wh.lock():
        wh.migrate(log)
        runner.mark_interrupted_runs(wh, log)  # even when nothing is left to do
        ray = cluster.init_ray(args.address)
        try:
            nodes = placement.known_nodes(placement.cluster_nodes(), config)
            if config:
                log(f"node types from {config}: " + ", ".join(n.node_type for n in nodes if n.node_type))
            placement.check_placement(spec.cells, nodes, log)
            runner.bind(plan, wh, nodes, log, runner.Resume(args.reuse_cells_from_other_builds, args.skip_failed,
                                                            args.recapture_damaged, own_cluster=not args.address))
            runner.regroup_complete_cells(plan, wh, log)
            if plan.todo:
                summary = runner.execute(plan, wh, sys.argv, args.address, log, config)
        finally:
            ray.shutdown()
    if summary is not None:
        log(f"run {summary['run_id']}: {summary['cells_done']}/{summary['cells_total']} cells complete, "
            f"{summary['rows_written']} rows in {summary['seconds']}s ({summary['rows_per_second']} rows/s)")
    else:
        summary = {"cells_total": len(plan.cells), "cells_done": len(plan.complete), "cells_run": 0,
                   "rows_written": 0, "skipped": spec.skipped, "left_out": plan.left_out, "reused": plan.reused}
        log(f"nothing to do: all {len(plan.cells)} cell(s) are complete in {wh.where}"
            + (f" ({len(plan.left_out)} left out this time)" if plan.left_out else ""))
    if args.json:
        emit_json(summary)
    if summary.get("failed"):
        log(f"{len(summary['failed'])} cell(s) FAILED (run again to retry them, or --skip-failed):")
        for cid, why in summary["failed"].items():
            log(f"  {cid}: {why}")
        if summary.get("bad_input"):  # the input is at fault (e.g. a node's weights): exit 2, said last
            raise UserError(summary["bad_input"])
        return 1
    return 0


def cmd_sql(args) -> int:
    from analysis.sql import export_views, query

    if args.export_views:
        if args.query:
            raise UserError("matrix sql: give a query or --export-views, not both")
        out = export_views(args.warehouse, args.export_views)
        log(f"wrote {out['file']}: {out['tables']} table views and {out['views']} derived views; "
            f"open it with `duckdb -init {out['file']}`")
        return 0
    if not args.query:
        raise UserError("matrix sql: give a query (or --export-views FILE.sql)")
    cols, rows = query(args.warehouse, args.query)
    if args.format == "json":
        emit_json([dict(zip(cols, r)) for r in rows])
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
    from analysis.analyze import analyze

    ranges = [0] + sorted({int(x) for x in args.ranges.split(",") if x.strip()} - {0}) if args.ranges else None
    kw = {"ranges": tuple(ranges)} if ranges else {}
    address = args.address or (_last_cluster(args.warehouse, log) if args.workers is None else None)
    if address or (args.workers or 1) != 1:
        from matrix.analyze_ray import ray_runner

        kw["run_units"] = ray_runner(address, args.workers or 0, log)
    summary = analyze(args.warehouse, args.reference, centroid=args.centroid, log=log,
                      skip_damaged=args.skip_damaged, force=args.force, **kw)
    log(f"analyzed {summary['cells']} cell(s), {summary['metric_rows']} rows in {summary['seconds']}s")
    if summary.get("layers"):
        la = summary["layers"]
        log(f"layer metrics: {la['cells']} cell(s), {la['rows']} layer rows ({la['reused']} up to date); "
            "`matrix layers CELL` for the table and the first failing layer")
    if summary.get("decode"):
        dc = summary["decode"]
        log(f"decode metrics: {dc['cells']} cell(s), {dc['rows']} decode / prefix-cached rows ({dc['reused']} up to date); "
            "the summary_by_path view compares them with the prefill")
    if args.json:
        emit_json(summary)
    return 0


def _last_cluster(warehouse: str, log) -> str | None:
    """The cluster the newest `matrix run` ran on, when it is still there: analyze runs on it by
    default. None for a local run, or a cluster that is gone (then analyze stays in this process)."""
    from matrix.cluster import check_reachable
    from store import Warehouse

    runs = [r for r in Warehouse(warehouse).require().read_all("runs") if r.get("started_at") and r.get("ray_address")]
    last = max(runs, key=lambda r: r["started_at"], default=None)
    if last is None or last["ray_address"] == "local":
        return None
    try:
        check_reachable(last["ray_address"], timeout=2.0)
    except UserError as e:
        log(f"the last run's cluster is not reachable ({e}); analyzing in this process")
        return None
    log(f"the last run ran on {last['ray_address']}: analyzing there (--workers 1 keeps it in this process)")
    return last["ray_address"]


def cmd_report(args) -> int:
    from pathlib import Path

    from analysis.report import gather, terminal_table, write_html
    from store import Warehouse

    wh = Warehouse(args.warehouse).require()
    if not wh.table_files("metrics"):
        raise UserError(f"{wh.where}: no metrics yet; run `matrix analyze --warehouse {wh.where}` first")
    data = gather(args.warehouse)
    out = Path(args.out) if args.out else Path("report") if wh.remote else Path(wh.where) / "report"
    path = write_html(data, out, args.warehouse)
    if args.json:
        emit_json({"html": str(path), **data})
        return 0
    print(terminal_table(data))
    print(f"\nHTML report: {path}")
    return 0


def cmd_verify(args) -> int:
    from store import Warehouse
    from store.verify import Damage, verify

    wh = Warehouse(args.warehouse).require()
    report = verify(wh, args.cells, log=log)
    for path in report["damaged_files"]:
        hits = [d for d in report["damage"] if d["path"] == path]
        log(f"DAMAGED {path}: {len(hits)} problem(s); first: " + Damage(**hits[0]).detail())
    log(f"verified {report['shards']} shard(s), {report['rows']} rows, {report['bytes'] / 2**20:.1f} MiB in "
        f"{report['seconds']}s ({report['mib_per_s']} MiB/s): "
        + (f"{len(report['damaged_files'])} damaged file(s)" if report["damage"] else "no damage"))
    if args.json:
        emit_json(report)
    return 1 if report["damage"] else 0


def cmd_status(args) -> int:
    from analysis.sql import query

    _, cells = query(args.warehouse, """
        select c.cell_id, c.status, c.repeats, c.rows_per_repeat, c.bit_reproducible, c.is_reference,
               coalesce(c.error_class || ': ' || c.error, c.skip_reason) as why
        from cells c order by c.cell_id""")
    _, runs = query(args.warehouse, """
        select run_id, status, started_at, cells_done, cells_total, rows_written from runs order by started_at""")
    if args.json:
        keys_c = ["cell_id", "status", "repeats", "rows_per_repeat", "bit_reproducible", "is_reference", "why"]
        keys_r = ["run_id", "status", "started_at", "cells_done", "cells_total", "rows_written"]
        emit_json({"cells": [dict(zip(keys_c, r)) for r in cells], "runs": [dict(zip(keys_r, r)) for r in runs]})
        return 0
    print(table(["cell_id", "status", "repeats", "rows/repeat", "bit_reproducible", "reference", "why"],
                [list(r) for r in cells]))
    print()
    print(table(["run_id", "status", "started_at", "cells_done", "cells_total", "rows_written"],
                [list(r) for r in runs]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from matrix import cli_layers, cli_quant

    p = argparse.ArgumentParser(prog="matrix", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _add_sweep_parsers(sub)
    _add_model_parsers(sub)
    _add_warehouse_parsers(sub)
    cli_quant.add_parsers(sub)
    cli_layers.add_parser(sub)
    return p


def _add_sweep_parsers(sub) -> None:
    r = sub.add_parser("run", help="run a sweep spec into a warehouse (resumes)")
    r.add_argument("spec", nargs="?", default=str(DEFAULT_SPEC))
    r.add_argument("--warehouse", default="warehouse")
    r.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    r.add_argument("--cluster-config", default=None, metavar="YAML",
                   help="Ray launcher config whose node types count as hosts the autoscaler can start "
                        "(default with --address: ~/ray_bootstrap_config.yaml where it exists)")
    r.add_argument("--reuse-cells-from-other-builds", action="store_true",
                   help="count a stack captured by another engine build (or before builds were recorded) "
                        "as done instead of capturing it again with this cluster's build")
    r.add_argument("--recapture-damaged", action="store_true",
                   help="check every row of the spec's shards against its hash; move a damaged shard aside "
                        "(WAREHOUSE/damaged/...) and capture it again (default: refuse to resume over one)")
    r.add_argument("--skip-failed", action="store_true",
                   help="leave cells an earlier run recorded as failed alone (default: try them again)")
    r.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("cells", help="list the cells a spec expands to, and the skipped combinations")
    c.add_argument("spec")
    c.add_argument("--address", default=None,
                   help="also say where each cell would run on this Ray cluster (exit 2 if one cannot)")
    c.add_argument("--cluster-config", default=None, metavar="YAML",
                   help="also say where each cell would run on the node types of this launcher config")
    c.add_argument("--warehouse", default=None,
                   help="also say which engine builds captured each stack there, and whether a run "
                        "would capture it again (the build: this machine's, or --address's nodes')")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_cells)


def _add_model_parsers(sub) -> None:
    m = sub.add_parser("models", help="the model catalog")
    msub = m.add_subparsers(dest="action", required=True)
    ml = msub.add_parser("list")
    ml.add_argument("--json", action="store_true")
    mf = msub.add_parser("fetch", help="download and dequantise a catalog model into the cache")
    mf.add_argument("name")
    mf.add_argument("--json", action="store_true")
    mc = msub.add_parser("cut", help="a catalog model with only its first N layers (real weights; "
                                     "small enough to carry to a GPU box without a model hub)")
    mc.add_argument("name")
    mc.add_argument("--layers", type=int, required=True)
    mc.add_argument("--out", required=True)
    mc.add_argument("--bf16", action="store_true", help="store the weights in bf16 (half the bytes)")
    mc.add_argument("--gguf", action="store_true",
                    help="write OUT as a GGUF holding the source GGUF's own quantised tensors of those layers "
                         "(no requantisation; a spec names it with {gguf: OUT})")
    mc.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)


def _add_warehouse_parsers(sub) -> None:
    q = sub.add_parser("sql", help="run a read-only DuckDB query over the warehouse views")
    q.add_argument("query", nargs="?")
    q.add_argument("--warehouse", default="warehouse")
    q.add_argument("--export-views", metavar="FILE.sql", default=None,
                   help="write the views as a SQL script for any DuckDB client (duckdb -init FILE.sql) and exit")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.set_defaults(func=cmd_sql)

    a = sub.add_parser("analyze", help="metrics of every stack vs its reference and vs the centroid")
    a.add_argument("--warehouse", default="warehouse")
    a.add_argument("--reference", default=None, help="cell_id to compare against (default: each model's reference)")
    a.add_argument("--ranges", default=None, help="position bucket edges, e.g. 512,2048,8192")
    a.add_argument("--centroid", choices=["mean_prob", "mean_logprob", "none"], default=None,
                   help="centroid definition (default: the spec's centroid.definition, else mean_prob; "
                        "none: no centroid or pairwise tables)")
    a.add_argument("--skip-damaged", action="store_true",
                   help="leave out shards that fail their row hashes or do not parse (default: refuse them)")
    a.add_argument("--force", action="store_true",
                   help="recompute every output (default: only those whose inputs or metric kernel changed)")
    a.add_argument("--workers", type=int, default=None,
                   help="pieces computed at once as Ray tasks (1: in this process; 0: one per CPU of the cluster; "
                        "default: on the cluster the last run used if it is reachable, else 1)")
    a.add_argument("--address", default=None,
                   help="Ray cluster to spread the pieces over (an object-store warehouse is read from every node)")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_analyze)

    rp = sub.add_parser("report", help="terminal tables and a self-contained HTML report")
    rp.add_argument("--warehouse", default="warehouse")
    rp.add_argument("--out", default=None, help="directory for report.html (default: WAREHOUSE/report)")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_report)

    v = sub.add_parser("verify", help="check every row against its row_hash, every shard's row count and "
                                      "every table file; exit 1 on damage (reads only)")
    v.add_argument("--warehouse", default="warehouse")
    v.add_argument("--cells", nargs="+", default=None, metavar="CELL",
                   help="only these cells' shards (a cell id, or the start of one, e.g. a stack id)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)

    s = sub.add_parser("status", help="cells and runs recorded in a warehouse")
    s.add_argument("--warehouse", default="warehouse")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)


def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `matrix sql ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LOGIT_MATRIX_DEBUG") == "1"
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        return args.func(args)
    except UserError as e:
        if debug:
            raise
        # An error raised inside a Ray actor arrives wrapped; report the original.
        from common.errors import redact

        cause = getattr(e, "cause", None) or e
        print(redact(f"matrix: error: {(str(cause).splitlines() or [type(cause).__name__])[0]}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("matrix: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as e:  # an operational failure: one line, exit 1; --debug shows where
        if debug:
            raise
        from common.errors import first_line, redact
        from matrix.failures import StorageError, storage_error, storage_line

        full = storage_error(e)
        cause = getattr(e, "cause", None) or e
        line = storage_line(full, "") if full is not None else \
            str(e) if isinstance(e, StorageError) else f"{type(cause).__name__}: {first_line(str(cause))}"
        print(redact(f"matrix: error: {line} (--debug for the traceback)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
