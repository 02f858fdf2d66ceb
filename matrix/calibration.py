"""A calibration text must not be the evaluation: an imatrix computed on the very passages the
KL is then measured on makes the quant look better than it is on anything else.

The check is on token n-grams of the model's own tokenizer: the share of the evaluation corpus's
8-grams that also occur in the calibration text. Independent texts share almost none (a few
stock phrases); a text that quotes the corpus shares whole passages. Above `max_overlap`
(default 2%) the spec is refused, naming the text and the prompt it overlaps most.
"""

from __future__ import annotations

from common.errors import UserError

N = 8  # long enough that unrelated English shares almost none, short enough to catch a quoted sentence


def grams(ids: list[int], n: int = N) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


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
                f"{im['max_overlap']:.1%} (imatrix.max_overlap). Calibrate on text the evaluation does not use")
