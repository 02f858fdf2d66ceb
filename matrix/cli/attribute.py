"""`matrix attribute`: which tensors of a quant recipe cost the KL, ranked by KL removed per MiB
added, and the frontier of cumulative upgrades, each a real file measured (matrix/api/attribute.py)."""

from __future__ import annotations

from common.output import emit_json, log


def cmd_attribute(args) -> int:
    from analysis.attribution import table
    from matrix import api

    result = api.attribute(
        args.reference,
        args.quant,
        args.text,
        args.warehouse,
        imatrix=args.imatrix,
        raise_to=args.raise_to,
        lower_to=args.lower_to,
        groups=tuple(g for g in args.groups.split(",") if g) if args.groups else None,
        frontier=args.frontier,
        n_ctx=args.n_ctx,
        chunks=args.chunks,
        threads=args.threads,
        address=args.address,
        executor=args.executor,
        log=log,
    )
    if args.json:
        emit_json(result.to_dict())
    else:
        print("\n".join(table(result.to_dict())))
        last = result.frontier[-1]
        if last["lines"]:
            im = f" --imatrix {args.imatrix}" if args.imatrix else ""
            print(
                f"\nthe last step ({last['path']}) is llama-quantize{im} --tensor-type-file FILE REFERENCE OUT "
                f"{args.quant.upper()} with FILE:\n"
            )
            print(result.tensor_type_file(len(result.frontier) - 1), end="")
    return 1 if result.incomplete else 0


def add_parser(sub) -> None:
    a = sub.add_parser(
        "attribute",
        help="which tensors of a quant recipe cost the KL: each group raised (or lowered) alone, ranked by "
        "KL removed per MiB, then the cumulative frontier, each step a file measured",
    )
    a.add_argument(
        "--reference", required=True, help="an F16/BF16/F32 GGUF, an HF checkpoint directory or a catalog model"
    )
    a.add_argument("--quant", required=True, help="the recipe's quant type (q4_k_m, q3_k_m, ...)")
    a.add_argument("--imatrix", default=None, help="an imatrix GGUF the recipe is weighted by (llama-imatrix's format)")
    a.add_argument("--text", required=True, help="the evaluation text (UTF-8)")
    a.add_argument(
        "--raise-to", default="q8_0", help="the type a group is raised to: a ggml type or `reference` (default q8_0)"
    )
    a.add_argument("--lower-to", default=None, help="also lower each group to this cheaper ggml type (e.g. q2_k)")
    a.add_argument(
        "--groups",
        default=None,
        help="only these groups, comma-separated (token_embd, attn_v, ffn_down, first_third, ...; default: all)",
    )
    a.add_argument(
        "--frontier",
        type=int,
        default=None,
        help="at most this many cumulative steps (default: every raise that removes KL)",
    )
    a.add_argument("--n-ctx", type=int, default=512, help="llama-perplexity's -c (default 512)")
    a.add_argument("--chunks", type=int, default=None, help="only the text's first CHUNKS chunks")
    a.add_argument(
        "--threads", type=int, default=None, help="threads per cell and for quantising (default: every core)"
    )
    a.add_argument(
        "--warehouse", default="attribute-warehouse", help="where the rows go; the job's spec is written beside it"
    )
    a.add_argument("--address", default=None, help="a Ray cluster to run the cells on (default: this machine)")
    a.add_argument(
        "--executor",
        choices=("ray", "local"),
        default=None,
        help="where cells run (default: local, or ray with --address)",
    )
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_attribute)
