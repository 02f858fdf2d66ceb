"""Admission gates: per quant class thresholds a stack must meet against its reference.

    classes:
      8bit: {mean_kld: 0.02, p99_kld: 0.2, max_kld: 2.0, top1_agreement: 0.93,
             cosine_min: 0.998, norm_ratio_tol: 0.05}
    dtypes: {q8_0: 8bit, ...}        # optional: which class a cell dtype belongs to

Any NaN/Inf row rejects, always (it is not a threshold). An isolated KL spike rejects
through max_kld; cosine and the norm ratio are two gates because cosine is blind to a dropped
scale factor (as in NVIDIA TensorRT-Edge-LLM's few-layer numeric validation guide).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.aggregates import select_sql
from common import metric_defs as D
from common.errors import UserError, read_yaml_file

# gate -> (the aggregate it reads, comparison, description, the per-row SQL that ranks rows worst first),
# from the metric registry (common/metric_defs.py: an aggregate with `gate`)
GATES = {
    gate: (agg.alias, D.comparison(metric), agg.gate_about, metric.rank_sql())
    for gate, (metric, agg) in D.gates().items()
}
DEFAULT_CLASSES = {  # a cell dtype -> its quant class, unless the gates file says otherwise
    "fp32": "fp16",
    "bf16": "fp16",
    "f16": "fp16",
    "f32": "fp16",
    "fp16": "fp16",
    "q8_0": "8bit",
    "q8_g64": "8bit",
    "fp8": "8bit",
    "q6_k": "8bit",
    "q5_0": "4bit",
    "q5_1": "4bit",
    "q5_k_m": "4bit",
    "q4_0": "4bit",
    "q4_1": "4bit",
    "q4_k_m": "4bit",
    "q4_g64": "4bit",
    "q3_k_m": "2bit",
    "q2_k": "2bit",
}


def load_gates(path: str) -> dict[str, Any]:
    p = Path(path)
    data = read_yaml_file(p, "gates file")
    if not isinstance(data, dict) or not isinstance(data.get("classes"), dict) or not data["classes"]:
        raise UserError(f"{p}: classes: a mapping of quant class -> gates is required")
    for k in data:
        if k not in ("classes", "dtypes", "layers"):
            raise UserError(f"{p}: {k}: unknown key; expected classes, dtypes, layers")
    for cls, gates in data["classes"].items():
        if not isinstance(gates, dict) or not gates:
            raise UserError(f"{p}: classes.{cls}: must be a mapping of gate -> threshold (got {gates!r})")
        for g, v in gates.items():
            if g not in GATES:
                raise UserError(f"{p}: classes.{cls}.{g}: unknown gate; expected one of {', '.join(GATES)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UserError(f"{p}: classes.{cls}.{g}: threshold must be a number (got {v!r})")
    dtypes = data.get("dtypes") or {}
    if not isinstance(dtypes, dict):
        raise UserError(f"{p}: dtypes: must be a mapping of dtype -> class (got {dtypes!r})")
    for d, cls in dtypes.items():
        if cls not in data["classes"]:
            raise UserError(f"{p}: dtypes.{d}: unknown class {cls!r}; classes are {', '.join(data['classes'])}")
    return {
        "path": str(p),
        "classes": data["classes"],
        "dtypes": {**DEFAULT_CLASSES, **dtypes},
        "layers": _layer_gates(p, data.get("layers") or {}),
    }


def _layer_gates(p: Path, raw: Any) -> dict[str, dict[str, float]]:
    """`layers:` class -> {cosine_min, norm_ratio_tol} (analysis/layer_metrics.py verdict)."""
    if not isinstance(raw, dict):
        raise UserError(f"{p}: layers: must be a mapping of quant class -> cosine_min, norm_ratio_tol (got {raw!r})")
    for cls, g in raw.items():
        if not isinstance(g, dict) or set(g) != {"cosine_min", "norm_ratio_tol"}:
            raise UserError(f"{p}: layers.{cls}: must have exactly cosine_min and norm_ratio_tol (got {g!r})")
        for k, v in g.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UserError(f"{p}: layers.{cls}.{k}: threshold must be a number (got {v!r})")
    return raw


def pick_class(gates: dict, dtype: str, asked: str | None) -> str:
    cls = asked or gates["dtypes"].get(dtype)
    if cls is None:
        raise UserError(f"{gates['path']}: no quant class for dtype {dtype!r}; add it under dtypes: or pass --class")
    if cls not in gates["classes"]:
        raise UserError(f"--class {cls}: not in {gates['path']} (classes: {', '.join(gates['classes'])})")
    return cls


def evaluate(measured: dict[str, float | None], thresholds: dict[str, float], nonfinite: int) -> list[dict]:
    """One row per gate: gate, threshold, measured, pass. NaN/Inf rows always reject."""
    out = [
        {
            "gate": "finite",
            "comparison": "==",
            "threshold": 0,
            "measured": nonfinite,
            "pass": nonfinite == 0,
            "meaning": "rows with NaN/Inf logits (any rejects)",
        }
    ]
    for g, thr in thresholds.items():
        key, cmp, meaning, _ = GATES[g]
        v = measured.get(key)
        ok = v is not None and (v <= thr if cmp == "<=" else v >= thr)
        out.append(
            {"gate": g, "comparison": cmp, "threshold": thr, "measured": v, "pass": bool(ok), "meaning": meaning}
        )
    return out


def measured_from_warehouse(con, cell_id: str) -> tuple[dict, int, str]:
    """The gated quantities of a cell vs its reference, from the metrics table (repeat 0)."""
    rel = con.execute(
        f"""
        SELECT {select_sql(D.GATES, table=None)},
               count(nonfinite) AS nonfinite, count(*) AS rows, any_value(reference_cell_id) AS ref
        FROM metrics WHERE cell_id = ? AND repeat = 0""",
        [cell_id],
    )
    cols = [d[0] for d in rel.description]
    row = dict(zip(cols, rel.fetchone()))
    if not row["rows"]:
        if con.execute("SELECT count(*) FROM metrics WHERE reference_cell_id = ?", [cell_id]).fetchone()[0]:
            raise UserError(
                f"admit: cell {cell_id} is the reference its model's stacks are measured against: "
                "there is nothing to gate it against (admit a candidate)"
            )
        raise UserError(f"admit: cell {cell_id} has no metrics; run `matrix analyze` first")
    return row, int(row["nonfinite"]), row["ref"]


def parity_gate(parity: str | None, allowed: bool) -> dict:
    """A stack whose own tokenizer disagrees with the canonical ids was fed ids it would not make
    itself (a tokenizer or BOS difference changes the input, not the arithmetic, and moves every logit):
    that rejects unless allowed."""
    bad = parity == "mismatch"
    return {
        "gate": "tokenizer_parity",
        "comparison": "==",
        "threshold": "ok",
        "measured": parity or "not_checked",
        "pass": not bad or allowed,
        "allowed": bad and allowed,
        "meaning": "the engine's own tokenizer gives the canonical ids"
        + (" (mismatch allowed)" if bad and allowed else ""),
    }


def worst_rows(con, cell_id: str, rows: list[dict]) -> None:
    """For each failed gate, the (prompt, position) that weighs most against it (rows[i]["worst"])."""
    for r in rows:
        if r["pass"]:
            continue
        if r["gate"] == "finite":  # the first flagged row, and which side; a bare 0 would be ORDER BY's column 0
            where, value, rank = "nonfinite IS NOT NULL", "nonfinite", "1 + 0 * position"
        elif r["gate"] in GATES:
            where, value, rank = "nonfinite IS NULL", GATES[r["gate"]][3], GATES[r["gate"]][3]
        else:  # tokenizer parity: not a property of a row
            continue
        hit = con.execute(
            f"SELECT prompt_id, position, {value} FROM metrics WHERE cell_id = ? AND repeat = 0 "
            f"AND {where} ORDER BY {rank} DESC NULLS LAST, prompt_id, position LIMIT 1",
            [cell_id],
        ).fetchone()
        r["worst"] = {"prompt_id": hit[0], "position": hit[1], "value": hit[2]} if hit else None
