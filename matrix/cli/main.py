"""The `matrix` command line (also `python -m matrix`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from common.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from matrix.cli import attribute, cache, docs, kld, models, spec, sweep, warehouse
    from matrix.cli import layers as cli_layers
    from matrix.cli import quant as cli_quant

    p = argparse.ArgumentParser(prog="matrix", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sweep.add_parsers(sub)
    models.add_parsers(sub)
    cache.add_parsers(sub)
    warehouse.add_parsers(sub)
    cli_quant.add_parsers(sub)
    kld.add_parser(sub)
    attribute.add_parser(sub)
    cli_layers.add_parser(sub)
    spec.add_parser(sub)
    docs.add_parser(sub, build_parser)
    return p


def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `matrix sql ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LOGIT_MATRIX_DEBUG") == "1"
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        return args.func(args)
    except UserError as e:
        if debug:
            raise
        # An error raised inside a Ray actor arrives wrapped; report the original.
        from common.errors import redact

        cause = getattr(e, "cause", None) or e
        print(redact(f"matrix: error: {(str(cause).splitlines() or [type(cause).__name__])[0]}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("matrix: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as e:  # an operational failure: one line, exit 1; --debug shows where
        if debug:
            raise
        from common.errors import first_line, redact
        from matrix.run.failures import StorageError, storage_error, storage_line

        full = storage_error(e)
        cause = getattr(e, "cause", None) or e
        line = (
            storage_line(full, "")
            if full is not None
            else str(e)
            if isinstance(e, StorageError)
            else f"{type(cause).__name__}: {first_line(str(cause))}"
        )
        print(redact(f"matrix: error: {line} (--debug for the traceback)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
