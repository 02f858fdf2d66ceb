"""`matrix run` and `matrix cells`: a spec run into a warehouse, and the cells it expands to."""

from __future__ import annotations

import extras
from common.errors import UserError
from common.output import emit_json, log, table
from matrix.spec.corpus import CONFIGS

DEFAULT_SPEC = CONFIGS / "smoke.yaml"


def _brief(opts: dict) -> str:
    """Options in one cell of a table: an imatrix by its text and chunks."""

    def one(k, v):
        if k == "imatrix":
            return f"imatrix={v['corpus']}" + (f" x{v['chunks']}" if v.get("chunks") else "")
        return f"{k}={v}"

    return " ".join(one(k, v) for k, v in opts.items())


def cmd_cells(args) -> int:
    from matrix import api

    result = api.cells(args.spec, args.address, args.cluster_config, args.warehouse, log=log)
    if args.json:
        emit_json(result.to_dict())
    else:
        _print_cells(result)
    if result.unplaceable:  # the same exit 2 as `matrix run`, after the cells are shown
        raise UserError(result.unplaceable)
    return 0


def _print_cells(result) -> None:
    from common.output import human
    from matrix.cli.layers import layer_brief, off_prefill

    cells, sizes, placed = result.cells, result.layer_states, result.placements
    decoding = any(off_prefill(c) != "-" for c in cells)
    # a column for each axis a plug-in sweeps (batch) that some cell has: its words (Extra.brief)
    axes = [x for x in extras.cell_extras() if x.sweeps and any(c.get(x.key) for c in cells)]
    cols = (
        ["stack_id", "role", "options"]
        + [x.key for x in axes]
        + (["layer states"] if sizes else [])
        + (["off prefill"] if decoding else [])
        + (["placement"] if placed else [])
        + (["build", "captured by", "a run"] if result.builds else [])
    )
    rows = []
    for c in cells:
        role = "reference" if c["reference"] else f"candidate: {c['candidate']['label']}" if c["candidate"] else ""
        row = [c["stack_id"], role, _brief(c["options"])]
        row += [" ".join(x.brief(c[x.key])) if c.get(x.key) else "-" for x in axes]
        row += [layer_brief(c["layer_states"])] if sizes else []
        row += [off_prefill(c)] if decoding else []
        row += [placed[c["stack_id"]].brief()] if placed else []
        if result.builds:
            captured = ", ".join(b["build"] or "unrecorded" for b in c["captured"]) or "-"
            row += [c["build"] or "?", captured, c["action"]]
        rows.append(row)
    print(table(cols, rows))
    if result.skipped:
        print(f"\nskipped ({len(result.skipped)}):")
        print(table(["combination", "reason"], [[s["stack_id"], s["reason"]] for s in result.skipped]))
    print(
        f"\n{len(cells)} cell(s), {len(result.skipped)} skipped; "
        f"{result.positions_text} (stride {result.stride}), repeats {result.repeats}"
    )
    if sizes:
        total = sum(v["bytes_estimate"] for v in sizes.values())
        print(
            f"layer states: {human(total)} over {len(sizes)} cell(s) (states x hidden x rows at the "
            "engine's native width; hidden states barely compress)"
        )


def cmd_run(args) -> int:
    from matrix import api

    result = api.run(
        args.spec,
        args.warehouse,
        executor=args.executor,
        address=args.address,
        cluster_config=args.cluster_config,
        reuse_cells_from_other_builds=args.reuse_cells_from_other_builds,
        skip_failed=args.skip_failed,
        recapture_damaged=args.recapture_damaged,
        log=log,
    )
    if args.json:
        emit_json(result.to_dict())
    if result.bad_input:  # the input is at fault (e.g. a node's weights): exit 2, said last
        raise UserError(result.bad_input)
    return 0 if result.ok else 1


def add_parsers(sub) -> None:
    _run_parser(sub)
    _cells_parser(sub)


def _run_parser(sub) -> None:
    """`matrix run`: a spec into a warehouse, on Ray or this machine's worker processes."""
    r = sub.add_parser("run", help="run a sweep spec into a warehouse (resumes)")
    r.add_argument("spec", nargs="?", default=str(DEFAULT_SPEC))
    r.add_argument("--warehouse", default="warehouse")
    r.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    r.add_argument(
        "--executor",
        choices=("ray", "local"),
        default=None,
        help="where cells run: ray (a cluster: --address's, or one started here) or local "
        "(worker processes of this machine, no Ray); default ray, local when ray is not installed",
    )
    r.add_argument(
        "--cluster-config",
        default=None,
        metavar="YAML",
        help="Ray launcher config whose node types count as hosts the autoscaler can start "
        "(default with --address: ~/ray_bootstrap_config.yaml where it exists)",
    )
    r.add_argument(
        "--reuse-cells-from-other-builds",
        action="store_true",
        help="count a stack captured by another engine build (or before builds were recorded) "
        "as done instead of capturing it again with this cluster's build",
    )
    r.add_argument(
        "--recapture-damaged",
        action="store_true",
        help="check every row of the spec's shards against its hash; move a damaged shard aside "
        "(WAREHOUSE/damaged/...) and capture it again (default: refuse to resume over one)",
    )
    r.add_argument(
        "--skip-failed",
        action="store_true",
        help="leave cells an earlier run recorded as failed alone (default: try them again)",
    )
    r.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    r.set_defaults(func=cmd_run)


def _cells_parser(sub) -> None:
    """`matrix cells`: what a spec expands to, and where and by which build each cell would run."""
    c = sub.add_parser("cells", help="list the cells a spec expands to, and the skipped combinations")
    c.add_argument("spec")
    c.add_argument(
        "--address", default=None, help="also say where each cell would run on this Ray cluster (exit 2 if one cannot)"
    )
    c.add_argument(
        "--cluster-config",
        default=None,
        metavar="YAML",
        help="also say where each cell would run on the node types of this launcher config",
    )
    c.add_argument(
        "--warehouse",
        default=None,
        help="also say which engine builds captured each stack there, and whether a run "
        "would capture it again (the build: this machine's, or --address's nodes')",
    )
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_cells)
