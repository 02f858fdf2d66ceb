"""Quant-author commands: `matrix card`, `matrix admit`, `matrix fixture`, `matrix kld-base`."""

from __future__ import annotations

from common.output import emit_json, fmt_number, log, table
from matrix.api.gates import GATES

CELL_HELP = "a cell id, or a stack's name or part of it (llamacpp/q4_k_m; `matrix stacks` lists them)"


def cmd_card(args) -> int:
    from matrix import api

    result = api.card(args.warehouse, args.cell, allow_undisclosed=args.allow_undisclosed)
    if args.json or args.format == "json":
        emit_json(result.to_dict())
    elif args.format == "model-index":
        print(result.model_index_yaml(), end="")
    else:
        print(result.markdown(), end="")
    return 0


def print_gates(rows, title: str, upper: bool = False) -> None:
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
    from matrix import api

    result = api.admit(args.warehouse, args.cell, args.gates, args.quant_class, args.allow_tokenizer_mismatch)
    if args.json:
        emit_json(result.to_dict())
        return 0 if result.ok else 1
    rows = result.gates
    print_gates(
        rows,
        f"{result.cell_id} vs {result.reference_cell_id}: class {result.quant_class} ({result.gates_file}), "
        f"{result.rows} rows",
    )
    for r in rows:
        if not r["pass"] and r.get("worst"):
            w = r["worst"]
            print(
                f"  {r['gate']}: worst row prompt {w['prompt_id']} position {w['position']} ({fmt_number(w['value'])})"
            )
    print(f"\n{'ADMITTED' if result.ok else 'REJECTED'}: {sum(r['pass'] for r in rows)}/{len(rows)} gates pass")
    return 0 if result.ok else 1


def _print_fixture_check(args, res) -> None:
    """`matrix fixture check`'s text report: where it ran, what differs, the gates, the truncation."""
    ran = res.ran_on
    print(
        f"ran on {ran['host']}"
        + (
            f" (Ray node {ran['node_id'][:12]}, weights {ran['model_via']})"
            if ran["where"] == "ray"
            else " (this process)"
        )
    )
    for d in res.differences:
        print(f"differs from the fixture's producer: {d['what']}: fixture {d['fixture']}, this stack {d['stack']}")
    print_gates(
        res.gates,
        f"{args.engine} {args.dtype} {args.attention} vs fixture {args.fixture} "
        f"(from {res.header['produced_by']['cell_id']}): class {res.quant_class}, {res.rows} rows",
        upper=True,
    )
    trunc = res.truncation
    print(
        f"\ntop-{trunc['k']} of {trunc['vocab_size']}: reference tail mass mean {trunc['tail_mass_mean']:.3g}, "
        f"max {trunc['tail_mass_max']:.3g}; KL is quoted as [lower, upper] because of that tail"
    )
    print(f"{'ADMITTED' if res.ok else 'REJECTED'}: {sum(r['pass'] for r in res.gates)}/{len(res.gates)} gates pass")


def cmd_fixture(args) -> int:
    from matrix import api

    if args.action == "export":
        out = api.fixture_export(args.warehouse, args.cell, args.out, k=args.k, log=log)
        if args.json:
            emit_json(out.to_dict())
        return 0
    res = api.fixture_check(
        args.fixture,
        args.engine,
        args.model,
        dtype=args.dtype,
        attention=args.attention,
        threads=args.threads,
        device=args.device,
        address=args.address,
        gates=args.gates,
        quant_class=args.quant_class,
        allow_other_weights=args.allow_other_weights,
        log=log,
    )
    if args.json:
        emit_json(res.to_dict())
    else:
        _print_fixture_check(args, res)
    return 0 if res.ok else 1


def cmd_kld_base(args) -> int:
    from matrix import api

    if args.action == "export":
        out = api.kld_base_export(args.warehouse, args.cell, args.n_ctx, args.out, log=log)
    else:
        out = api.kld_base_import(args.warehouse, args.file, args.model, log=log)
    if args.json:
        emit_json(out.to_dict())
    return 0


def _add_card(sub) -> None:
    c = sub.add_parser("card", help="a model-card KLD block with every disclosure field")
    c.add_argument("cell", help=CELL_HELP)
    c.add_argument("--warehouse", default="warehouse")
    c.add_argument(
        "--format",
        choices=["md", "json", "model-index"],
        default="md",
        help="md: the card; json: the card as data; model-index: its figures as the model-index YAML of a "
        "Hugging Face model card's front matter",
    )
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
