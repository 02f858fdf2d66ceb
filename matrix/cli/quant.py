"""Quant-author commands: `matrix card`, `matrix admit`, `matrix fixture`, `matrix kld-base`."""

from __future__ import annotations

from common.errors import UserError
from common.output import emit_json, fmt_number, log, table
from matrix.spec.corpus import CONFIGS

GATES = CONFIGS / "gates.yaml"
CELL_HELP = "a cell id, or a stack's name or part of it (llamacpp/q4_k_m; `matrix stacks` lists them)"


def cell_arg(args, what: str, cells: list[dict] | None = None) -> str:
    """args.cell as a cell id: given as one, or a stack's readable name (analysis/stack_names.py);
    cells: the warehouse's cells rows where the caller has read them already."""
    from analysis.stack_names import resolve
    from store import Warehouse

    if cells is None:
        cells = Warehouse(args.warehouse).require().read_all("cells")
    return resolve(cells, args.cell, f"{what}: warehouse {args.warehouse}")


def cmd_card(args) -> int:
    from matrix import api

    result = api.card(args.warehouse, args.cell, allow_undisclosed=args.allow_undisclosed)
    if args.json or args.format == "json":
        emit_json(result.to_dict())
    else:
        print(result.markdown(), end="")
    return 0


def print_gates(rows: list[dict], title: str, upper: bool = False) -> None:
    """One line per gate; upper: also the upper bound a fixture's truncated KL allows."""
    print(title)
    cols = ["gate", "threshold", "measured (lower bound)" if upper else "measured"] + (["upper bound"] if upper else [])
    print(
        table(
            cols + ["result"],
            [
                [r["gate"], f"{r['comparison']} {fmt_number(r['threshold'])}", fmt_number(r["measured"])]
                + ([fmt_number(r["upper_bound"])] if upper else [])
                + ["pass" if r["pass"] else "FAIL"]
                for r in rows
            ],
        )
    )


def cmd_admit(args) -> int:
    from analysis.gates import evaluate, load_gates, measured_from_warehouse, parity_gate, pick_class, worst_rows
    from analysis.sql import connect

    gates = load_gates(args.gates)
    args.cell = cell_arg(args, "admit")
    con = connect(args.warehouse)
    try:
        cell = con.execute(
            "SELECT dtype, status, tokenizer_parity FROM cells WHERE cell_id = ?", [args.cell]
        ).fetchone()
        if cell is None:
            raise UserError(f"admit: no cell {args.cell} in {args.warehouse}")
        measured, nonfinite, ref = measured_from_warehouse(con, args.cell)
        cls = pick_class(gates, cell[0], args.quant_class)
        rows = evaluate(measured, gates["classes"][cls], nonfinite)
        rows.insert(1, parity_gate(cell[2], args.allow_tokenizer_mismatch))
        worst_rows(con, args.cell, rows)
    finally:
        con.close()
    ok = all(r["pass"] for r in rows)
    if args.json:
        emit_json(
            {
                "cell_id": args.cell,
                "reference_cell_id": ref,
                "class": cls,
                "gates_file": gates["path"],
                "rows": measured["rows"],
                "pass": ok,
                "gates": rows,
            }
        )
    else:
        print_gates(rows, f"{args.cell} vs {ref}: class {cls} ({gates['path']}), {measured['rows']} rows")
        for r in rows:
            if not r["pass"] and r.get("worst"):
                w = r["worst"]
                print(
                    f"  {r['gate']}: worst row prompt {w['prompt_id']} position {w['position']} "
                    f"({fmt_number(w['value'])})"
                )
        print(f"\n{'ADMITTED' if ok else 'REJECTED'}: {sum(r['pass'] for r in rows)}/{len(rows)} gates pass")
    return 0 if ok else 1


def _check(args) -> dict:
    """In this process, or, given --address or a --device other than cpu, in a cell actor placed
    on the cluster the way `matrix run` places one (a local cluster of this machine without --address)."""
    from matrix.run.fixture_check import check_fixture

    if not args.address and args.device == "cpu":
        return check_fixture(args.fixture, args.engine, args.model, args.dtype, args.attention, args.threads, log=log)
    from matrix.run import cluster, placement

    ray = cluster.init_ray(args.address)
    try:
        nodes = placement.known_nodes(placement.cluster_nodes(), placement.default_cluster_config(args.address))
        return check_fixture(
            args.fixture,
            args.engine,
            args.model,
            args.dtype,
            args.attention,
            args.threads,
            log=log,
            device=args.device,
            nodes=nodes,
        )
    finally:
        ray.shutdown()


def _same_weights_gate(res: dict, allow_other_weights: bool) -> dict:
    """The gate row that says whether the stack was built from the weights the fixture was made from."""
    weights = next((d for d in res["differences"] if d["what"] in ("weights_sha256", "source_sha256")), None)
    return {
        "gate": "same_weights",
        "comparison": "==",
        "threshold": "the fixture's",
        "measured": f"other weights: {weights['stack']} (fixture: {weights['fixture']})" if weights else "same",
        "pass": weights is None or allow_other_weights,
        "meaning": "the stack is built from the weights the fixture was made from"
        + (" (other weights allowed)" if weights and allow_other_weights else ""),
    }


def _print_fixture_check(args, res: dict, rows: list[dict], cls: str, trunc: dict, ok: bool) -> None:
    """`matrix fixture check`'s text report: where it ran, what differs, the gates, the truncation."""
    ran = res["ran_on"]
    print(
        f"ran on {ran['host']}"
        + (
            f" (Ray node {ran['node_id'][:12]}, weights {ran['model_via']})"
            if ran["where"] == "ray"
            else " (this process)"
        )
    )
    for d in res["differences"]:
        print(f"differs from the fixture's producer: {d['what']}: fixture {d['fixture']}, this stack {d['stack']}")
    print_gates(
        rows,
        f"{args.engine} {args.dtype} {args.attention} vs fixture {args.fixture} "
        f"(from {res['header']['produced_by']['cell_id']}): class {cls}, {res['rows']} rows",
        upper=True,
    )
    print(
        f"\ntop-{trunc['k']} of {trunc['vocab_size']}: reference tail mass mean {trunc['tail_mass_mean']:.3g}, "
        f"max {trunc['tail_mass_max']:.3g}; KL is quoted as [lower, upper] because of that tail"
    )
    print(f"{'ADMITTED' if ok else 'REJECTED'}: {sum(r['pass'] for r in rows)}/{len(rows)} gates pass")


def _fixture_export(args) -> int:
    from analysis.fixture_export import export_fixture

    out = export_fixture(args.warehouse, cell_arg(args, "fixture export"), args.out, k=args.k, log=log)
    if args.json:
        emit_json(out)
    return 0


def cmd_fixture(args) -> int:
    if args.action == "export":
        return _fixture_export(args)
    from analysis.gates import evaluate, load_gates, pick_class
    from analysis.truncated import NOTE, gate_values

    gates = load_gates(args.gates)  # a bad gates file fails before any model loads
    cls = pick_class(gates, args.dtype, args.quant_class)
    res = _check(args)
    measured, upper, tail = gate_values(res["metrics"])
    rows = evaluate(measured, gates["classes"][cls], res["nonfinite"])
    rows.insert(1, _same_weights_gate(res, args.allow_other_weights))
    for r in rows:
        r["upper_bound"] = upper.get(r["gate"])
    ok = all(r["pass"] for r in rows)
    trunc = {"k": res["header"]["k"], "vocab_size": res["header"]["vocab_size"], **tail, "note": NOTE}
    if not args.json:
        _print_fixture_check(args, res, rows, cls, trunc, ok)
        return 0 if ok else 1
    emit_json(
        {
            "fixture": args.fixture,
            "engine": args.engine,
            "model": args.model,
            "dtype": args.dtype,
            "class": cls,
            "rows": res["rows"],
            "pass": ok,
            "truncation": trunc,
            "gates": rows,
            "differences": res["differences"],
            "header_checked": res["header"]["header_checked"],
            "ran_on": res["ran_on"],
        }
    )
    return 0 if ok else 1


def cmd_kld_base(args) -> int:
    from store import llamacpp_import as interop

    if args.action == "export":
        out = interop.export_kld_base(args.warehouse, cell_arg(args, "kld-base export"), args.n_ctx, args.out, log=log)
    else:
        out = interop.import_kld_base(args.warehouse, args.file, args.model, log=log)
    if args.json:
        emit_json(out)
    return 0


def _add_card(sub) -> None:
    c = sub.add_parser("card", help="a model-card KLD block with every disclosure field")
    c.add_argument("cell", help=CELL_HELP)
    c.add_argument("--warehouse", default="warehouse")
    c.add_argument("--format", choices=["md", "json"], default="md")
    c.add_argument("--json", action="store_true", help="the card as JSON (same as --format json)")
    c.add_argument(
        "--allow-undisclosed", action="store_true", help="print unknown fields as 'undisclosed' instead of failing"
    )
    c.set_defaults(func=cmd_card)


def _add_admit(sub) -> None:
    a = sub.add_parser("admit", help="gate a cell against its reference (exit 0 pass, 1 fail, 2 error)")
    a.add_argument("cell", help=CELL_HELP)
    a.add_argument("--gates", default=str(GATES))
    a.add_argument("--class", dest="quant_class", default=None, help="quant class (default: from the cell's dtype)")
    a.add_argument("--warehouse", default="warehouse")
    a.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="admit a stack whose own tokenizer disagrees with the canonical ids (the gate says so)",
    )
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_admit)


def _add_fixture_check(fsub) -> None:
    fc = fsub.add_parser("check", help="run a stack on the fixture's ids and gate it (exit 0 pass, 1 fail, 2 error)")
    fc.add_argument("fixture")
    fc.add_argument("--engine", required=True)
    fc.add_argument("--model", required=True, help="catalog name or a model directory")
    fc.add_argument("--dtype", default="bf16")
    fc.add_argument("--attention", default="default")
    fc.add_argument("--threads", type=int, default=2)
    fc.add_argument(
        "--device",
        default="cpu",
        help="run the stack on a node of this device class (h200, b200, "
        "mi300x, apple-m3, ...) through matrix run's placement",
    )
    fc.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to run it on (default: in this process for cpu, else a local cluster of this machine)",
    )
    fc.add_argument("--gates", default=str(GATES))
    fc.add_argument("--class", dest="quant_class", default=None)
    fc.add_argument(
        "--allow-other-weights",
        action="store_true",
        help="check a stack built from other weights than the fixture's (the gate row says so)",
    )
    fc.add_argument("--json", action="store_true")


def _add_fixture(sub) -> None:
    fx = sub.add_parser("fixture", help="reference-output fixtures: export from a cell, check a stack against one")
    fsub = fx.add_subparsers(dest="action", required=True)
    fe = fsub.add_parser("export", help="write a standalone fixture (.json readable, .parquet dense)")
    fe.add_argument("cell", help=CELL_HELP)
    fe.add_argument("--out", required=True, help="FILE.json or FILE.parquet")
    fe.add_argument("--k", type=int, default=64, help="top-k ids and logits kept per row (default 64)")
    fe.add_argument("--warehouse", default="warehouse")
    fe.add_argument("--json", action="store_true")
    _add_fixture_check(fsub)
    fx.set_defaults(func=cmd_fixture)


def _add_kld_base(sub) -> None:
    kb = sub.add_parser("kld-base", help="llama.cpp --kl-divergence-base files: export a cell, import a file")
    ksub = kb.add_subparsers(dest="action", required=True)
    ke = ksub.add_parser("export")
    ke.add_argument("cell", help=CELL_HELP)
    ke.add_argument("--n-ctx", type=int, required=True, help="llama-perplexity's -c: chunk length in tokens")
    ke.add_argument("--out", required=True)
    ke.add_argument("--warehouse", default="warehouse")
    ke.add_argument("--json", action="store_true")
    ki = ksub.add_parser("import")
    ki.add_argument("file")
    ki.add_argument("--model", required=True, help="the warehouse model the file was made from (it carries no hash)")
    ki.add_argument("--warehouse", default="warehouse")
    ki.add_argument("--json", action="store_true")
    kb.set_defaults(func=cmd_kld_base)


def add_parsers(sub) -> None:
    _add_card(sub)
    _add_admit(sub)
    _add_fixture(sub)
    _add_kld_base(sub)
