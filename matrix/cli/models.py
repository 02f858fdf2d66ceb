"""`matrix models`: the catalog, fetching a model, cutting one to its first layers."""

from __future__ import annotations

from common.errors import UserError
from common.output import emit_json, log, table


def cmd_models(args) -> int:
    from matrix.spec import models

    if args.action == "list":
        return _list(args)
    from matrix.spec.parse import ModelRef

    if args.name not in models.CATALOG:
        raise UserError(f"models fetch: unknown catalog model {args.name!r} (known: {', '.join(models.CATALOG)})")
    resolved = models.fetch(ModelRef(args.name, "catalog", args.name), log=log)
    if args.action == "cut":
        return _cut(args, resolved)
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


def _list(args) -> int:
    """`matrix models list`: one row per catalog model."""
    from matrix.spec import models

    rows = [models.catalog_row(m) for m in models.CATALOG.values()]
    if args.json:
        emit_json(rows)
    else:
        print(table(list(rows[0]), [list(r.values()) for r in rows]))
    return 0


def _cut(args, resolved) -> int:
    """`matrix models cut`: the fetched model (resolved) with only its first --layers layers, as
    an HF checkpoint or, with --gguf, a GGUF file in the source's own quantisation."""
    from pathlib import Path

    from matrix.spec import models

    if args.layers < 1:
        raise UserError(f"models cut: --layers must be at least 1, got {args.layers}")
    out = Path(args.out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise UserError(f"models cut: {out} exists{'' if out.is_file() else ' and is not empty'}")
    if args.gguf and args.bf16:
        raise UserError("models cut: --gguf keeps the source's own quantisation; --bf16 does not apply")
    if args.gguf:
        from store.gguf_cut import cut_gguf

        if not resolved.gguf_path:
            raise UserError(f"models cut: {args.name} has no source GGUF to cut")
        cut_gguf(Path(resolved.gguf_path), out, args.layers)
        size = out.stat().st_size
    else:
        models.cut_layers(Path(resolved.hf_dir), out, args.layers, bf16=args.bf16)
        size = sum(f.stat().st_size for f in out.iterdir())
    info = {
        "name": args.name,
        "layers": args.layers,
        "bf16": args.bf16,
        "gguf": args.gguf,
        "path": str(out),
        "bytes": size,
    }
    if args.json:
        emit_json(info)
    else:
        print(f"{args.name} cut to {args.layers} layer(s): {out} ({info['bytes'] / 2**20:.1f} MiB)")
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
