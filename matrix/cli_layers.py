"""`matrix layers CELL`: where divergence starts (issue 17; seed 003_0a72f8c17495d068.txt). The
per-layer table of a `layers:` cell against its reference, and the first layer failing the
cosine / norm-ratio gates of its quant class. Exit 0 pass, 1 fail, 2 error."""

from __future__ import annotations

from common.errors import UserError
from common.output import emit_json, fmt_number, table
from matrix.cli_quant import GATES


def cmd_layers(args) -> int:
    from analysis.gates import load_gates, pick_class
    from analysis.layer_analysis import layer_table
    from analysis.layer_metrics import verdict
    from store import Warehouse

    wh = Warehouse(args.warehouse).require()
    cells = {c["cell_id"]: c for c in wh.read_all("cells")}
    if args.cell not in cells:
        raise UserError(f"layers: no cell {args.cell} in {wh.where}")
    gates = load_gates(args.gates)
    cls = pick_class(gates, cells[args.cell]["dtype"], args.quant_class)
    if cls not in gates["layers"]:
        raise UserError(f"{gates['path']}: layers: no gate for class {cls} (has: {', '.join(gates['layers'])})")
    g = gates["layers"][cls]
    rows, ref = layer_table(wh, args.cell)
    v = verdict(rows, g["cosine_min"], g["norm_ratio_tol"])
    if args.json:
        emit_json({"cell_id": args.cell, "reference_cell_id": ref, "class": cls, "gates_file": gates["path"],
                   "gates": g, "layers": rows, **v})
    else:
        print(f"{args.cell} vs {ref}: class {cls} ({gates['path']}): cosine >= {g['cosine_min']}, "
              f"|norm ratio - 1| <= {g['norm_ratio_tol']}")
        print(table(["layer", "rows", "cosine min", "cosine mean", "worst (prompt@pos)", "|ratio-1| max",
                     "worst (prompt@pos)", "rel L2 max", "max |Δ|", "allclose"],
                    [[r["layer"], r["rows"], f"{r['cosine_min']:.6f}", f"{r['cosine_mean']:.6f}",
                      "@".join(map(str, r["cosine_worst_at"])), fmt_number(r["norm_ratio_dev_max"]),
                      "@".join(map(str, r["norm_ratio_worst_at"])), fmt_number(r["rel_l2_max"]),
                      fmt_number(r["max_abs_diff"]), f"{r['allclose_share']:.0%}"] for r in rows]))
        if v["pass"]:
            print(f"\nPASS: every layer within the gates ({len(rows)} states)")
        else:
            print(f"\nFAIL: first failing layer {v['first_failing_layer']} ({', '.join(v['failed'])})")
    return 0 if v["pass"] else 1


def add_parser(sub) -> None:
    p = sub.add_parser("layers", help="per-layer agreement of a layers: cell with its reference, and the "
                                      "first failing layer (exit 0 pass, 1 fail, 2 error)")
    p.add_argument("cell")
    p.add_argument("--warehouse", default="warehouse")
    p.add_argument("--gates", default=str(GATES))
    p.add_argument("--class", dest="quant_class", default=None, help="quant class (default: from the cell's dtype)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_layers)


# What `matrix cells` prints of a cell's extras (layer states, rows off the plain prefill).
def off_prefill(c: dict) -> str:
    """What a cell records beside its prefill rows: decode steps, a prefix-cache check."""
    parts = ([f"decode {c['decode']['steps']} steps from {c['decode']['at']}"] if c["decode"] else []) \
        + (["prefix cache check"] if c["prefix_cache"] else [])
    return "; ".join(parts) or "-"


def layer_sizes(spec) -> dict[str, dict]:
    """cell id -> the bytes its layer states will take (matrix.runner.layer_bytes); resolving the
    models and tokenising the corpus only when a cell asks for layers (a bad index: exit 2 here too)."""
    if not any(c.layers for c in spec.cells):
        return {}
    from matrix.runner import layer_bytes, prepare

    plan = prepare(spec, None, lambda m: None)
    return {c.cell_id: layer_bytes(plan, c) for c in spec.cells if c.layers}


def layer_brief(size: dict | None) -> str:
    if not size:
        return "-"
    return f"{size['states_per_row']} x {size['hidden']} x {size['rows']} rows ~ {human(size['bytes_estimate'])}"


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
