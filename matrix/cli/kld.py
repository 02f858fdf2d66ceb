"""`matrix kld`: llama-perplexity --kl-divergence's job in one command, each candidate's statistics
in llama-perplexity's layout, then its model card."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common.errors import UserError
from common.output import emit_json, log


def _run(spec_path: Path, args) -> int:
    """`matrix run` on the job's spec: the local executor unless a cluster is named."""
    from matrix.cli.sweep import cmd_run

    executor = args.executor or ("ray" if args.address else "local")
    return cmd_run(argparse.Namespace(
        spec=str(spec_path), warehouse=args.warehouse, address=args.address, executor=executor, cluster_config=None,
        reuse_cells_from_other_builds=False, recapture_damaged=False, skip_failed=False, json=False))


def _candidate_stacks(spec_path: Path, asked: list[dict]) -> list[tuple[dict, str]]:
    """(candidate entry, its stack id) for each candidate asked for, in the order given."""
    from matrix.spec.cells import load_spec

    spec = load_spec(spec_path)
    by_file = {c.artifact: c.stack_id for c in spec.cells if c.artifact is not None}
    return [(a, by_file[a.get("gguf") or a.get("path")]) for a in asked]


def _results(warehouse: str, stacks: list[tuple[dict, str]], ref_label: str) -> list[dict]:
    """Each candidate's statistics and card, from the cell of its stack this warehouse captured
    last (a stack captured by several engine builds has a cell per build)."""
    import extras
    from analysis.card import build_card
    from analysis.kld_stats import cell_stats
    from analysis.sql import connect

    con = connect(warehouse)
    try:
        out = []
        for a, stack in stacks:
            got = con.execute("SELECT cell_id FROM cells WHERE stack_id = ? AND status = 'done' "
                              "ORDER BY finished_at DESC LIMIT 1", [stack]).fetchone()
            if got is None:  # its cell failed this time (the run said why): the others still print
                continue
            cid = got[0]
            chunks = con.execute("SELECT count(DISTINCT prompt_id) FROM metrics WHERE cell_id = ?", [cid]).fetchone()[0]
            out.append({"candidate": a.get("gguf") or a.get("path"), "label": a["name"], "reference": ref_label,
                        "cell_id": cid, "chunks": chunks, "statistics": cell_stats(con, cid)})
    finally:
        con.close()
    return [{**r, "card": build_card(warehouse, r["cell_id"], allow_undisclosed=True, extras=extras.registered())}
            for r in out]


def cmd_kld(args) -> int:
    from matrix.spec import kld

    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: must be >= 1")
    ref = kld.classify(args.reference, "--reference")
    cands = [kld.classify(c, "--candidate") for c in args.candidate]
    text_file = Path(os.path.expanduser(args.text)).resolve()
    if not text_file.is_file():
        raise UserError(f"--text {args.text}: no such file")
    spec_path, asked = kld.write_job(ref, cands, text_file, args.n_ctx, args.threads or os.cpu_count() or 1,
                                     args.warehouse, log)
    log(f"the job's spec: {spec_path} (`matrix run {spec_path} --warehouse {args.warehouse}` repeats it)")
    bad = None
    try:  # one candidate's failure is its own: the others are still reported
        code = _run(spec_path, args)
    except UserError as e:  # a candidate's file refused where it ran: exit 2, after the others
        from store import Warehouse

        if not Warehouse(args.warehouse).check():  # refused before anything ran
            raise
        bad, code = e, 2
    results = _results(args.warehouse, _candidate_stacks(spec_path, asked), ref.label)
    missing = [a["name"] for a in asked if (a.get("gguf") or a.get("path")) not in {r["candidate"] for r in results}]
    if missing:
        log(f"no statistics for {', '.join(missing)}: its cell did not complete (the run says why above)")
    if args.json:
        emit_json({"spec": str(spec_path), "warehouse": args.warehouse, "n_ctx": args.n_ctx, "results": results,
                   "incomplete": missing})
    else:
        _print(results, args.n_ctx)
    if bad is not None:
        raise bad
    return code


def _print(results: list[dict], n_ctx: int) -> None:
    import extras
    from analysis.card import markdown
    from analysis.kld_stats import text

    for r in results:
        print(f"\n### {r['label']} against {r['reference']}: {r['chunks']} chunks of {n_ctx}, "
              f"{r['statistics']['rows']} scored tokens (cell {r['cell_id']})\n")
        print("\n".join(text(r["statistics"])))
        print()
        print(markdown(r["card"], extras.registered()), end="")


def add_parser(sub) -> None:
    k = sub.add_parser("kld", help="llama-perplexity --kl-divergence's job: each candidate file against a "
                                   "reference over one text, with its model card")
    k.add_argument("--reference", required=True, help="a GGUF file, a Hugging Face checkpoint directory or a catalog model")
    k.add_argument("--candidate", action="append", required=True,
                   help="a GGUF file, an HF checkpoint directory or a catalog model (repeat for several)")
    k.add_argument("--text", required=True, help="the evaluation text (UTF-8)")
    k.add_argument("--n-ctx", type=int, default=512, help="llama-perplexity's -c: chunk length in tokens (default 512)")
    k.add_argument("--threads", type=int, default=None, help="threads per cell (default: every core)")
    k.add_argument("--warehouse", default="kld-warehouse",
                   help="where the rows go; the job's spec is written beside it as WAREHOUSE.kld.yaml")
    k.add_argument("--address", default=None, help="a Ray cluster to run the cells on (default: this machine, no Ray)")
    k.add_argument("--executor", choices=("ray", "local"), default=None,
                   help="where cells run (default: local, or ray with --address)")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kld)
