"""A calibration text must not be the evaluation: an imatrix computed on the very passages the
KL is then measured on makes the quant look better than it is on anything else.

The check is on token n-grams of the model's own tokenizer: the share of the evaluation corpus's
8-grams that also occur in the calibration text. Independent texts share almost none (a few
stock phrases); a text that quotes the corpus shares whole passages. Above `max_overlap`
(default 2%) the spec is refused, naming the text and the prompt it overlaps most.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from common.errors import UserError

N = 8  # long enough that unrelated English shares almost none, short enough to catch a quoted sentence
KEYS = ("corpus", "chunks", "ctx", "max_overlap")
MAX_OVERLAP = 0.02  # share of the evaluation corpus's token 8-grams a calibration text may contain


def parse_option(v: Any, fld: str, base: Path, error: Callable[..., Exception]) -> dict:
    """`imatrix: {corpus: builtin | FILE, chunks: N, ctx: 512, max_overlap: 0.02}` -> the text's label,
    path, sha256 and the settings (the cell id hashes the text's sha256, never its path).
    error(field, message, value): the spec's one-line error for a field."""
    from common.files import sha256_file
    from matrix.spec.corpus import BUILTIN_CALIBRATION

    if not isinstance(v, dict) or "corpus" not in v:
        raise error(fld, "must be a mapping with corpus (builtin or a text file), chunks, ctx", v)
    for k in v:
        if k not in KEYS:
            raise error(f"{fld}.{k}", f"unknown key; expected one of {', '.join(KEYS)}")
    corpus = v["corpus"]
    if corpus == "builtin":
        text_path = BUILTIN_CALIBRATION
    elif isinstance(corpus, str) and corpus:
        text_path = (base / os.path.expanduser(corpus)).resolve()
        if not text_path.is_file():
            raise error(f"{fld}.corpus", "no such file", corpus)
    else:
        raise error(f"{fld}.corpus", "must be 'builtin' or a path to a text file", corpus)
    try:
        text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{fld}.corpus", "is not UTF-8 text", corpus) from None
    out = {
        "corpus": "builtin" if corpus == "builtin" else text_path.name,
        "path": str(text_path),
        "sha256": sha256_file(text_path),
        "ctx": v.get("ctx", 512),
        "chunks": v.get("chunks"),
        "max_overlap": v.get("max_overlap", MAX_OVERLAP),
    }
    for k in ("ctx", "chunks"):
        if out[k] is not None and (isinstance(out[k], bool) or not isinstance(out[k], int) or out[k] < 1):
            raise error(f"{fld}.{k}", "must be a positive integer", out[k])
    mo = out["max_overlap"]
    if isinstance(mo, bool) or not isinstance(mo, (int, float)) or not 0 <= mo <= 1:
        raise error(f"{fld}.max_overlap", "must be a fraction between 0 and 1", mo)
    return out


def option_identity(opts: dict) -> dict:
    """What of a cell's options changes its rows: an imatrix's text counts by hash, not by where
    it lies or how much overlap the check allows."""
    if "imatrix" not in opts:
        return opts
    return {**opts, "imatrix": {k: v for k, v in opts["imatrix"].items() if k not in ("path", "max_overlap")}}


def grams(ids: list[int], n: int = N) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def overlap(calibration_ids: list[int], prompts) -> tuple[float, str | None, float]:
    """(share of all the prompts' n-grams found in the calibration text, the prompt that shares
    most, its own share)."""
    cal = grams(calibration_ids)
    total = hit = 0
    worst, worst_share = None, 0.0
    for p in prompts:
        g = grams(p.token_ids)
        h = len(g & cal)
        total, hit = total + len(g), hit + h
        if g and h / len(g) > worst_share:
            worst, worst_share = p.name, h / len(g)
    return (hit / total if total else 0.0), worst, worst_share


def check(spec, cells, prompts, tokenizer) -> None:
    """Refuse (exit 2) any imatrix text of these cells that overlaps the evaluation corpus too much."""
    seen = set()
    for cell in cells:
        im = cell.opts.get("imatrix")
        if not im or im["sha256"] in seen:
            continue
        seen.add(im["sha256"])
        with open(im["path"], encoding="utf-8") as f:
            ids = list(tokenizer(f.read(), add_special_tokens=False).input_ids)
        share, worst, worst_share = overlap(ids, prompts)
        if share > im["max_overlap"]:
            raise UserError(
                f"{spec.path}: imatrix.corpus: the calibration text {im['path']} contains {share:.1%} of the "
                f"evaluation corpus's token {N}-grams ({worst_share:.0%} of prompt {worst}); the limit is "
                f"{im['max_overlap']:.1%} (imatrix.max_overlap). Calibrate on text the evaluation does not use"
            )
