"""`matrix models`: the catalog, fetching a model, cutting one to its first layers."""

from __future__ import annotations

from common.output import emit_json, log, table


def cmd_models(args) -> int:
    from matrix import api

    if args.action == "list":
        rows = api.models().to_dict()
        if args.json:
            emit_json(rows)
        else:
            print(table(list(rows[0]), [list(r.values()) for r in rows]))
        return 0
    if args.action == "cut":
        cut = api.cut_model(args.name, args.layers, args.out, bf16=args.bf16, gguf=args.gguf, log=log)
        if args.json:
            emit_json(cut.to_dict())
        else:
            print(f"{cut.name} cut to {cut.layers} layer(s): {cut.path} ({cut.bytes / 2**20:.1f} MiB)")
        return 0
    resolved = api.fetch_model(args.name, log=log)
    if args.json:
        emit_json(resolved.to_dict())
    else:
        print(
            f"{resolved.name}: {resolved.hf_dir}\n  source {resolved.source}\n"
            f"  source sha256 {resolved.source_sha256}\n  weights sha256 {resolved.weights_sha256}"
            + (f"\n  license {resolved.license}" if resolved.license else "")
            + "".join(f"\n  notice {n}" for n in resolved.notices)
        )
    return 0


def add_parsers(sub) -> None:
    m = sub.add_parser("models", help="the model catalog")
    msub = m.add_subparsers(dest="action", required=True)
    ml = msub.add_parser("list")
    ml.add_argument("--json", action="store_true")
    mf = msub.add_parser("fetch", help="download and dequantise a catalog model into the cache")
    mf.add_argument("name")
    mf.add_argument("--json", action="store_true")
    mc = msub.add_parser(
        "cut",
        help="a catalog model with only its first N layers (real weights; "
        "small enough to carry to a GPU box without a model hub)",
    )
    mc.add_argument("name")
    mc.add_argument("--layers", type=int, required=True)
    mc.add_argument("--out", required=True)
    mc.add_argument("--bf16", action="store_true", help="store the weights in bf16 (half the bytes)")
    mc.add_argument(
        "--gguf",
        action="store_true",
        help="write OUT as a GGUF holding the source GGUF's own quantised tensors of those layers "
        "(no requantisation; a spec names it with {gguf: OUT})",
    )
    mc.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)
