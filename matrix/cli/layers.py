"""`matrix layers CELL`: where divergence starts. The
per-layer table of a `layers:` cell against its reference, and the first layer failing the
cosine / norm-ratio gates of its quant class (two gates: cosine misses a dropped scale factor;
NVIDIA TensorRT-Edge-LLM's few-layer numeric validation guide). Exit 0 pass, 1 fail, 2 error."""

from __future__ import annotations

import extras
from common.output import emit_json, fmt_number, human, table
from matrix.api.gates import GATES
from matrix.cli.quant import CELL_HELP

LAYER_COLUMNS = [
    "layer",
    "rows",
    "cosine min",
    "cosine mean",
    "worst (prompt@pos)",
    "|ratio-1| max",
    "worst (prompt@pos)",
    "rel L2 max",
    "max |Δ|",
    "allclose",
]


def cmd_layers(args) -> int:
    from matrix import api

    result = api.layers(args.warehouse, args.cell, args.gates, args.quant_class)
    if args.json:
        emit_json(result.to_dict())
    else:
        g = result.thresholds
        print(
            f"{result.cell_id} vs {result.reference_cell_id}: class {result.quant_class} ({result.gates_file}): "
            f"cosine >= {g['cosine_min']}, |norm ratio - 1| <= {g['norm_ratio_tol']}"
        )
        _print_layers(result.layers, result.verdict)
    return 0 if result.ok else 1


def _print_layers(rows: list[dict], v: dict) -> None:
    """The per-layer table, then the verdict: pass, or the first layer failing a gate."""
    print(
        table(
            LAYER_COLUMNS,
            [
                [
                    r["layer"],
                    r["rows"],
                    f"{r['cosine_min']:.6f}",
                    f"{r['cosine_mean']:.6f}",
                    "@".join(map(str, r["cosine_worst_at"])),
                    fmt_number(r["norm_ratio_dev_max"]),
                    "@".join(map(str, r["norm_ratio_worst_at"])),
                    fmt_number(r["rel_l2_max"]),
                    fmt_number(r["max_abs_diff"]),
                    f"{r['allclose_share']:.0%}",
                ]
                for r in rows
            ],
        )
    )
    if v["pass"]:
        print(f"\nPASS: every layer within the gates ({len(rows)} states)")
    else:
        print(f"\nFAIL: first failing layer {v['first_failing_layer']} ({', '.join(v['failed'])})")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "layers",
        help="per-layer agreement of a layers: cell with its reference, and the "
        "first failing layer (exit 0 pass, 1 fail, 2 error)",
    )
    p.add_argument("cell", help=CELL_HELP)
    p.add_argument("--warehouse", default="warehouse")
    p.add_argument("--gates", default=str(GATES))
    p.add_argument("--class", dest="quant_class", default=None, help="quant class (default: from the cell's dtype)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_layers)


# What `matrix cells` prints of a cell's extras (layer states, rows off the plain prefill).
def off_prefill(c: dict) -> str:
    """What a cell records beside its prefill rows (the extras that write paths of its d<repeat> file)."""
    parts = [w for x in extras.registered() if x.paths and c.get(x.key) is not None for w in x.brief(c[x.key])]
    return "; ".join(parts) or "-"


def layer_brief(size: dict | None) -> str:
    if not size:
        return "-"
    return f"{size['states_per_row']} x {size['hidden']} x {size['rows']} rows ~ {human(size['bytes_estimate'])}"
