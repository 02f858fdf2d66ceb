"""`matrix kld`: llama-perplexity --kl-divergence's job in one command, each candidate's statistics
in llama-perplexity's layout, then its model card."""

from __future__ import annotations

import extras
from common.errors import UserError
from common.output import emit_json, log


def cmd_kld(args) -> int:
    from matrix import api
    from matrix.api.kld import exit_code

    result = api.kld(
        args.reference,
        args.candidate,
        args.text,
        args.warehouse,
        n_ctx=args.n_ctx,
        chunks=args.chunks,
        threads=args.threads,
        keep_rows=args.keep_rows,
        options={x.key: getattr(args, x.key) for x in extras.options() if x.flag},
        address=args.address,
        executor=args.executor,
        log=log,
    )
    if args.json:
        emit_json(result.to_dict())
    else:
        _print(result.results, args.n_ctx)
    if result.refused is not None:
        raise UserError(result.refused)
    return exit_code(result)


def _print(results, n_ctx: int) -> None:
    from analysis.card import markdown
    from analysis.kld_stats import text

    for r in results:
        print(
            f"\n### {r.label} against {r.reference}: {r.chunks} chunks of {n_ctx}, "
            f"{r.statistics['rows']} scored tokens (cell {r.cell_id})\n"
        )
        print("\n".join(text(r.statistics)))
        print()
        print(markdown(r.card, extras.registered()), end="")


def _option_flags(k) -> None:
    """Each flag a plug-in's engine option declares (extras.Extra.flag: --kv-cache)."""
    for x in extras.options():
        if x.flag:
            k.add_argument(x.flag, dest=x.key, default=None, metavar=x.flag_metavar, help=x.flag_help)


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
    k.add_argument(
        "--n-ctx",
        type=int,
        default=512,
        help="llama-perplexity's -c: chunk length in tokens, even, at most the reference's context length "
        "(default 512)",
    )
    k.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="llama-perplexity's --chunks: only the text's first CHUNKS chunks (default: every chunk)",
    )
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
    _option_flags(k)
    k.add_argument("--address", default=None, help="a Ray cluster to run the cells on (default: this machine, no Ray)")
    k.add_argument(
        "--executor",
        choices=("ray", "local"),
        default=None,
        help="where cells run (default: local, or ray with --address)",
    )
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kld)
