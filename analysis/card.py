"""`matrix card CELL`: a model-card KLD block that discloses what makes the number interpretable.

A KLD is meaningless without its reference checkpoint, both runtimes, the evaluation text,
calibration data, context lengths, sampled positions, KL direction, vocabulary truncation,
aggregation, storage floor and reproducibility (analysis/disclosure.py). Every field is read from the
warehouse; one that is unknown fails the card (naming the field) unless the caller allows
it to be printed as "undisclosed".
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from analysis import confidence as C
from analysis import frontier as F
from analysis import position_card as PC
from analysis.disclosure import disclosure as _disclosure
from analysis.sql import connect, dict_rows, referenced
from common import metric_defs as D
from common.errors import UserError

UNDISCLOSED = "undisclosed"


def query_rows(db, sql: str, params=()) -> list[dict]:
    """One query's rows as dicts. db: an open DuckDB connection of the warehouse (a card's, which
    runs every query of the card), or a warehouse, then on a connection of its own with the views
    the query names."""
    if not isinstance(db, (str, os.PathLike)):
        return dict_rows(db, sql, params)
    con = connect(db, referenced(sql))
    try:
        return dict_rows(con, sql, params)
    finally:
        con.close()


def _query(con, warehouse: str, cell_id: str) -> tuple[dict, dict, dict, list, list, dict]:
    """-> (cell, its reference, its summary row, ranges, prompts, sampled positions)."""
    cells = {c["cell_id"]: c for c in dict_rows(con, "SELECT * FROM cells")}
    if cell_id not in cells:
        raise UserError(f"card: no cell {cell_id} in {warehouse} (see `matrix status --json`)")
    cell = cells[cell_id]
    if cell["status"] != "done":
        raise UserError(f"card: cell {cell_id} was not captured ({cell['status']}: {cell.get('skip_reason')})")
    summ = dict_rows(con, "SELECT * FROM summary WHERE cell_id = ?", [cell_id])
    if not summ:
        raise UserError(f"card: cell {cell_id} has no metrics yet; run `matrix analyze --warehouse {warehouse}`")
    s = summ[0]
    if s["is_reference"]:
        raise UserError(
            f"card: cell {cell_id} is the reference its model's stacks are measured against; "
            "a card measures a candidate against it"
        )
    ref = cells[s["reference_cell_id"]]
    ranges = dict_rows(
        con,
        """SELECT range, lo, rows, kld_mean, kld_stderr, kld_p99, kld_max, top1_agreement
                           FROM summary_by_range WHERE cell_id = ? AND category IS NULL ORDER BY lo""",
        [cell_id],
    )
    prompts = dict_rows(
        con,
        """SELECT DISTINCT p.prompt_id, p.name, p.category, p.n_tokens, p.ids_sha256, p.bos_policy,
                           p.bos_added, p.corpus, p.source, p.source_sha256
                           FROM prompts p JOIN metrics m USING (prompt_id)
                           WHERE m.cell_id = ? AND m.repeat = 0 ORDER BY p.prompt_id""",
        [cell_id],
    )
    pos = dict_rows(
        con,
        """SELECT count(*) AS n, min(position) AS first, max(position) AS last
                        FROM metrics WHERE cell_id = ? AND repeat = 0""",
        [cell_id],
    )[0]
    return cell, ref, s, ranges, prompts, pos


# the summary's numbers a card gives: the registry's (common/metric_defs.py, shown on the card), then these
NUMBERS = tuple(a.alias for _, a in D.aggregates(D.CARD)) + tuple(
    "rows nonfinite_rows below_resolution ppl ppl_ref ppl_ratio nll_correlation".split()
)


def build_card(
    warehouse: str, cell_id: str, allow_undisclosed: bool = False, *, extras, as_is: Collection[str], con=None
) -> dict:
    """extras: the per-cell extras (key, card(db, cell)); each adds its block (null without).
    as_is: the engines whose cells without a weights recipe run the reference checkpoint's own
    weights at their dtype (backends.as_is(): Backend.checkpoint_as_is). con: a connection of
    analysis.sql.connect(warehouse) with every view, kept open by the caller (None: one of its own).

    Every query of the card, the extras' too, runs on one connection with every view bound: one
    connection costs about what two of the views a query names do (binding reads the footers of
    its tables' files), and the extras' blocks read views over the rows themselves (batch_drift
    reads logits), which their own connections bound as well."""
    if con is not None:
        return _card(con, warehouse, cell_id, allow_undisclosed, extras, as_is)
    con = connect(warehouse)
    try:
        return _card(con, warehouse, cell_id, allow_undisclosed, extras, as_is)
    finally:
        con.close()


def _card(con, warehouse: str, cell_id: str, allow_undisclosed: bool, extras, as_is: Collection[str]) -> dict:
    cell, ref, s, ranges, prompts, pos = _query(con, warehouse, cell_id)
    numbers = {k: s[k] for k in NUMBERS}
    disclosure = _disclosure(cell, ref, s, prompts, pos, as_is)
    missing = sorted(_unknown(disclosure))
    if missing and not allow_undisclosed:
        raise UserError(
            f"card: {missing[0]} is unknown for cell {cell_id}"
            + (f" (and {len(missing) - 1} more: {', '.join(missing[1:4])})" if len(missing) > 1 else "")
            + "; capture again with this version (older cells lack some fields), declare it in the spec "
            "where it is declarable (`calibration:` in an include entry), or pass --allow-undisclosed"
        )
    _fill(disclosure)
    return {
        "cell_id": cell_id,
        "reference_cell_id": ref["cell_id"],
        "model": cell["model"],
        "numbers": numbers,
        "ranges": ranges,
        "by_confidence": query_rows(con, C.CARD_SQL, [cell_id]),
        "position_buckets": query_rows(con, PC.CARD_SQL, [cell_id]),
        "frontier": query_rows(con, F.CARD_SQL, [cell["model"]]),
        "disclosure": disclosure,
        "undisclosed": missing,
        **{x.key: x.card(con, cell) for x in extras},
    }


def _unknown(d: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields that are None."""
    if isinstance(d, dict):
        return [m for k, v in d.items() for m in _unknown(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if d is None else []


def _fill(d: dict) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _fill(v)
        elif v is None:
            d[k] = UNDISCLOSED


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {fmt_value(x)}" for k, x in v.items())
    return str(v)


def markdown(card: dict, extras) -> str:
    n = card["numbers"]
    out = [
        f"### KL divergence: `{card['cell_id']}` vs reference `{card['reference_cell_id']}`",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean KLD ± s.e. | {n['kld_mean']:.4g} ± {n['kld_stderr'] or 0:.2g} nats |",
        f"| median / p99 / max KLD | {n['kld_median']:.4g} / {n['kld_p99']:.4g} / {n['kld_max']:.4g} |",
        f"| mean reverse KLD / mean JS | {n['kld_reverse_mean']:.4g} / {n['js_mean']:.4g} |",
        f"| top-1 agreement | {n['top1_agreement']:.4f} |",
        f"| perplexity: candidate / reference (ratio; correlation of ln p) | {fmt_value(n['ppl'])} / "
        f"{fmt_value(n['ppl_ref'])} ({fmt_value(n['ppl_ratio'])}; {fmt_value(n['nll_correlation'])}) |",
        f"| raw logits: mean NMSE / max abs diff / mean Spearman (top-10) | {fmt_value(n['nmse_mean'])} / "
        f"{fmt_value(n['max_abs_diff'])} / {fmt_value(n['spearman_mean'])} |",
        f"| rows (NaN/Inf excluded) | {n['rows']} ({n['nonfinite_rows']}) |",
        f"| context | {card['disclosure']['context_lengths']['measured']} |",
        f"| below measurement resolution | {fmt_value(n['below_resolution'])} |",
        "",
        "| output range | rows | mean KLD ± s.e. | p99 | max | top-1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in card["ranges"]:
        out.append(
            f"| {r['range']} | {r['rows']} | {r['kld_mean']:.4g} ± {r['kld_stderr'] or 0:.2g} | "
            f"{r['kld_p99']:.4g} | {r['kld_max']:.4g} | {r['top1_agreement']:.4f} |"
        )
    out += PC.card_lines(card.get("position_buckets") or [])
    out += C.card_lines(card.get("by_confidence") or [])
    out += F.card_lines(card.get("frontier") or [], card["cell_id"])
    out += ["", "| disclosure | value |", "|---|---|"]
    for k, v in card["disclosure"].items():
        if isinstance(v, dict) and k.endswith("runtime"):
            for kk, vv in v.items():
                out.append(f"| {k}.{kk} | {fmt_value(vv).replace('|', '/')} |")
        else:
            out.append(f"| {k} | {fmt_value(v).replace('|', '/')} |")
    lines = (card["disclosure"].get("candidate_artifact") or {}).get("tensor_type_lines")
    if isinstance(lines, list):  # the recipe, as llama-quantize --tensor-type-file takes it
        out += ["", "The recipe's `--tensor-type-file`:", "", "```", *lines, "```"]
    for x in extras:  # each per-cell extra's block (extras: Extra.card_lines)
        if card.get(x.key):
            out += x.card_lines(card[x.key])
    if card["undisclosed"]:
        out += ["", f"Undisclosed: {', '.join(card['undisclosed'])}."]
    return "\n".join(out) + "\n"
