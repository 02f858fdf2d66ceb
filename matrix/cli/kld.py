"""`matrix kld`: llama-perplexity --kl-divergence's job in one command, each candidate's statistics
in llama-perplexity's layout, then its model card."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import extras
from common.errors import UserError
from common.output import emit_json, log


def _run(spec_path: Path, args) -> int:
    """`matrix run` on the job's spec: the local executor unless a cluster is named."""
    from matrix.cli.sweep import cmd_run

    executor = args.executor or ("ray" if args.address else "local")
    return cmd_run(
        argparse.Namespace(
            spec=str(spec_path),
            warehouse=args.warehouse,
            address=args.address,
            executor=executor,
            cluster_config=None,
            reuse_cells_from_other_builds=False,
            recapture_damaged=False,
            skip_failed=False,
            json=False,
        )
    )


def _candidate_stacks(spec_path: Path, asked: list[dict]) -> list[tuple[dict, str]]:
    """(candidate entry, its stack id) for each candidate asked for, in the order given."""
    from matrix.spec.cells import load_spec
    from matrix.spec.kld import file_of

    spec = load_spec(spec_path)
    by_file = {c.artifact: c.stack_id for c in spec.cells if c.artifact is not None}
    return [(a, by_file[file_of(a)]) for a in asked]


def _done_cells(warehouse: str, stacks: list[tuple[dict, str]]) -> tuple[list[tuple[dict, str]], bool]:
    """((entry, the cell of its stack this warehouse captured last) for each candidate that
    completed (a stack captured by several engine builds has a cell per build), whether any cell
    of the warehouse is complete)."""
    from store import Warehouse

    wh = Warehouse(warehouse)
    rows = [c for c in (wh.read_all("cells") if wh.check() else []) if c["status"] == "done"]
    out = []
    for a, stack in stacks:
        done = sorted((c for c in rows if c["stack_id"] == stack), key=lambda c: c["finished_at"])
        if done:
            out.append((a, done[-1]["cell_id"]))
    return out, bool(rows)


def _measured(warehouse: str, cells: list[tuple[dict, str]]) -> None:
    """Metrics for a completed candidate that has none: its capturing process could not measure it
    (it says why in its cells row); `matrix analyze` does, here."""
    from analysis.analyze import analyze
    from analysis.sql import connect

    con = connect(warehouse)
    try:
        have = {r[0] for r in con.execute("SELECT DISTINCT cell_id FROM metrics").fetchall()}
    finally:
        con.close()
    if any(cid not in have for _, cid in cells):
        log("measuring the candidates their capture did not measure (matrix analyze)")
        analyze(warehouse, log=log, side=[s[:2] for s in extras.analyses()])


def _results(warehouse: str, cells: list[tuple[dict, str]], ref_label: str) -> list[dict]:
    from analysis.card import build_card
    from analysis.kld_stats import cell_stats
    from analysis.sql import connect
    from matrix.spec.kld import file_of

    con = connect(warehouse)
    try:
        out = []
        for a, cid in cells:
            chunks = con.execute("SELECT count(DISTINCT prompt_id) FROM metrics WHERE cell_id = ?", [cid]).fetchone()[0]
            out.append(
                {
                    "candidate": file_of(a),
                    "label": a["name"],
                    "reference": ref_label,
                    "cell_id": cid,
                    "chunks": chunks,
                    "statistics": cell_stats(con, cid),
                }
            )
    finally:
        con.close()
    return [
        {**r, "card": build_card(warehouse, r["cell_id"], allow_undisclosed=True, extras=extras.registered())}
        for r in out
    ]


def _threads(args) -> int:
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: must be >= 1")
    if args.threads is None and args.address:
        raise UserError(
            "--threads: give the threads each cell takes on the cluster's nodes (this machine's core "
            "count says nothing of theirs)"
        )
    return args.threads or os.cpu_count() or 1


def cmd_kld(args) -> int:
    from matrix.spec import kld

    threads = _threads(args)
    ref = kld.classify(args.reference, "--reference")
    cands = [kld.classify(c, "--candidate") for c in args.candidate]
    text_file = Path(os.path.expanduser(args.text)).resolve()
    if not text_file.is_file():
        raise UserError(f"--text {args.text}: no such file")
    spec_path, asked, new = kld.write_job(
        ref, cands, text_file, args.n_ctx, threads, args.warehouse, log, args.keep_rows
    )
    log(f"the job's spec: {spec_path} (`matrix run {spec_path} --warehouse {args.warehouse}` repeats it)")
    bad = None
    try:  # one candidate's failure is its own: the others are still reported
        code = _run(spec_path, args)
    except UserError as e:  # refused before anything ran, or a file refused where it ran: exit 2
        bad, code = e, 2
    try:
        stacks = _candidate_stacks(spec_path, asked)
    except UserError:
        if bad is None:
            raise
        stacks = []  # the spec itself was refused, as bad says: raised below
    done, anything = _done_cells(args.warehouse, stacks)
    failed = {kld.file_of(a) for a in asked} - {kld.file_of(a) for a, _ in done}
    kld.forget(args.warehouse, failed, drop_job=new and not anything)
    if bad is not None and not done:
        raise bad
    if done:
        _measured(args.warehouse, done)
    results = _results(args.warehouse, done, ref.label) if done else []
    if failed:
        log(
            f"no statistics for {', '.join(a['name'] for a in asked if kld.file_of(a) in failed)}: its cell did not "
            "complete (the run says why above), and it is left out of the job's spec"
        )
    if args.json:
        emit_json(
            {
                "spec": str(spec_path),
                "warehouse": args.warehouse,
                "n_ctx": args.n_ctx,
                "results": results,
                "incomplete": sorted(failed),
            }
        )
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
        print(
            f"\n### {r['label']} against {r['reference']}: {r['chunks']} chunks of {n_ctx}, "
            f"{r['statistics']['rows']} scored tokens (cell {r['cell_id']})\n"
        )
        print("\n".join(text(r["statistics"])))
        print()
        print(markdown(r["card"], extras.registered()), end="")


def add_parser(sub) -> None:
    k = sub.add_parser(
        "kld",
        help="llama-perplexity --kl-divergence's job: each candidate file against a "
        "reference over one text, with its model card",
    )
    k.add_argument(
        "--reference", required=True, help="a GGUF file, a Hugging Face checkpoint directory or a catalog model"
    )
    k.add_argument(
        "--candidate",
        action="append",
        required=True,
        help="a GGUF file, an HF checkpoint directory or a catalog model (repeat for several)",
    )
    k.add_argument("--text", required=True, help="the evaluation text (UTF-8)")
    k.add_argument("--n-ctx", type=int, default=512, help="llama-perplexity's -c: chunk length in tokens (default 512)")
    k.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per cell (default: every core of this machine; required with --address)",
    )
    k.add_argument(
        "--warehouse",
        default="kld-warehouse",
        help="where the rows go; the job's spec is written beside it as WAREHOUSE.kld.yaml",
    )
    k.add_argument(
        "--keep-rows",
        action="store_true",
        help="keep the candidates' rows too (default: only the reference's, as llama-perplexity keeps only "
        "its base logits; a candidate's rows are measured and hashed as they are captured)",
    )
    k.add_argument("--address", default=None, help="a Ray cluster to run the cells on (default: this machine, no Ray)")
    k.add_argument(
        "--executor",
        choices=("ray", "local"),
        default=None,
        help="where cells run (default: local, or ray with --address)",
    )
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kld)
