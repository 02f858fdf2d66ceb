"""`matrix card CELL`: a model-card KLD block that discloses what makes the number interpretable.

A KLD is meaningless without its reference checkpoint, both runtimes, the evaluation text,
calibration data, context lengths, sampled positions, KL direction, vocabulary truncation,
aggregation, storage floor and reproducibility. Every field is read from the
warehouse; one that is unknown fails the card (naming the field) unless the caller allows
it to be printed as "undisclosed".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from typing import Any

from analysis import confidence as C
from analysis.sql import connect, dict_rows
from common import metric_defs as D
from common import positions as P
from common.errors import UserError

UNDISCLOSED = "undisclosed"


def query_rows(warehouse: str, sql: str, params=()) -> list[dict]:
    """One query's rows as dicts, on a connection of its own."""
    con = connect(warehouse)
    try:
        return dict_rows(con, sql, params)
    finally:
        con.close()


def _json(s: str | None) -> dict:
    return json.loads(s) if s else {}


def calibration(cell: dict, as_is: Collection[str]) -> str | None:
    """What the artefact was calibrated on: declared in the spec, or known from its recipe.
    as_is: the engines whose cells without a recipe run the reference checkpoint's own weights."""
    if cell.get("calibration"):
        return cell["calibration"]
    recipe = _json(cell.get("artifact_recipe"))
    tool = recipe.get("tool")
    if tool == "llama_model_quantize":
        im = recipe.get("imatrix")
        if im is None:
            return "none: llama.cpp round-to-nearest quantisation, no importance matrix"
        return (
            f"importance matrix (sha256 {im['sha256']}) from calibration text {im['calibration']} "
            f"(sha256 {im['calibration_sha256']}, {im['tokens']} tokens, {im['chunks']} chunks of "
            f"{im['ctx']} = {im['tokens_used']} tokens used), {im['tool']} {im['llama_cpp_python']}"
        )
    if tool in ("torchao", "optimum-quanto"):
        return f"none: {tool} {recipe.get('weights')} weight-only round-to-nearest at load, {recipe.get('config')}"
    if tool == "convert_hf_to_gguf.py":
        return "none: float conversion of the reference weights"
    if tool == "mlx_lm.convert":
        return (
            f"none: mlx_lm affine round-to-nearest, {recipe['q_bits']}-bit, group {recipe['q_group_size']}"
            if recipe.get("q_bits")
            else "none: float conversion of the reference weights"
        )
    if tool is None and cell["engine"] in as_is:
        return f"none: the reference checkpoint's weights at {cell['dtype']}"
    if tool == "published artifact" and recipe.get("kind") == "hf checkpoint":
        q = recipe.get("quantization_config")
        return (
            f"per the checkpoint's config: quantization_config {q}"
            if q
            else "none recorded: the checkpoint's config has no quantization_config; declare `calibration:` on the "
            "candidate if the publisher says otherwise"
        )
    if tool == "published artifact":  # what the file's own header says llama-quantize used
        im = recipe.get("imatrix")
        if im:
            return "importance matrix, per the file's header: " + ", ".join(f"{k} {v}" for k, v in sorted(im.items()))
        return (
            "no importance matrix recorded in the file's header (llama-quantize writes quantize.imatrix.* "
            "when it uses one); declare `calibration:` on the candidate if the publisher says otherwise"
        )
    return None  # e.g. a file used as shipped: only its publisher knows


def artifact(cell: dict) -> dict:
    """What the candidate ran: a published file (its hash and where it came from), or what built it."""
    recipe = _json(cell.get("artifact_recipe"))
    if recipe.get("tool") == "published artifact" and recipe.get("kind") == "hf checkpoint":
        return {
            "kind": "published artifact (HF checkpoint)",
            "source": recipe.get("source"),
            "sha256": cell.get("artifact_sha256") or "none: loaded from the hub by id and revision",
            "hash_of": "the safetensors files (name + sha256, in name order)",
            "dtype": cell["dtype"],
            "config_dtype": recipe.get("config_dtype"),
            "quantization_config": recipe.get("quantization_config") or "none",
            **({"label": recipe["label"]} if recipe.get("label") else {}),
        }
    if recipe.get("tool") == "published artifact":
        return {
            "kind": "published artifact",
            "file": recipe.get("file"),
            "sha256": cell.get("artifact_sha256"),
            "source": recipe.get("source"),
            "declared_quant": recipe.get("declared_quant"),
            **({"label": recipe["label"]} if recipe.get("label") else {}),
        }
    if not recipe:  # HF, vLLM, TensorRT-LLM: the engine loads the reference checkpoint itself
        return {"kind": f"the reference checkpoint itself, loaded by {cell['engine']} at {cell['dtype']}"}
    in_memory = cell.get("artifact") is None  # torchao / quanto: quantised at load, no file
    return {
        "kind": f"built by logit-matrix ({recipe.get('tool')})",
        "sha256": cell.get("artifact_sha256")
        or ("none: quantised in memory at load from the reference weights" if in_memory else None),
    }


def _driver(cell: dict) -> str | None:
    if cell["device"] == "cpu":
        return "none (CPU)"
    fp = _json(cell.get("fingerprint"))
    nv, amd = fp.get("nvidia") or {}, fp.get("rocm") or {}
    if nv.get("status") == "ok":
        return f"NVIDIA driver {nv.get('driver')}, CUDA {nv.get('cuda_driver')}"
    if amd.get("status") == "ok" or amd.get("rocm_version"):
        return f"ROCm {amd.get('rocm_version', 'unknown version')}"
    return None


def hardware(cell: dict) -> str | None:
    """One line: CPU model, cores, wide-vector flags; the GPUs when the cell ran on one."""
    fp = _json(cell.get("fingerprint"))
    if not fp:
        return None
    cpu = fp.get("cpu") or {}
    flags = sorted(
        f for f, on in (cpu.get("flags") or {}).items() if on and f.startswith(("avx512", "amx", "sve", "sme"))
    )
    out = f"{cpu.get('model')} ({cpu.get('logical_cores')} cores{', ' + ' '.join(flags) if flags else ''})"
    gpus = (fp.get("nvidia") or {}).get("gpus") or []
    if cell["device"] != "cpu" and gpus:
        g = gpus[0]
        out += f"; {g.get('name')} x{len(gpus)}, {g.get('sm_count')} SMs, sm_{g.get('compute_capability')}"
    return out


def _positions_rule(cell: dict) -> str:
    """The cell's kept positions in words (an imported or pre-v8 cell has the plain stride form)."""
    return P.from_dict(_json(cell.get("positions")) or None, cell.get("stride") or 1).describe()


def _runtime(cell: dict, as_is: Collection[str]) -> dict[str, Any]:
    s = _json(cell.get("settings"))
    build = {
        k: s[k]
        for k in (
            "system_info",
            "cpu_capability",
            "mkldnn",
            "gguf_tensor_types",
            "kv_cache",
            "n_batch",
            "n_ubatch",
            "torch_dtype",
            "deterministic_algorithms",
            "activations",
            "quantized_matmul",
        )
        if s.get(k) is not None
    }
    return {
        "cell_id": cell["cell_id"],
        "engine": cell["engine"],
        "libraries": _json(cell.get("versions")) or None,
        "build": build or None,
        "device": cell["device"],
        "hardware": hardware(cell),
        "driver": _driver(cell),
        "host": cell.get("host"),
        "threads": cell.get("threads"),
        "dtype": cell["dtype"],
        "attention": cell["attention"],
        "tp": cell["tp"],
        "artifact_sha256": cell.get("artifact_sha256")
        or ("none: the checkpoint itself" if cell["engine"] in as_is else None),
    }


def _query(warehouse: str, cell_id: str) -> tuple[dict, dict, dict, list, list, dict]:
    """-> (cell, its reference, its summary row, ranges, prompts, sampled positions)."""
    con = connect(warehouse)
    try:
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
                                       p.bos_added, p.corpus FROM prompts p JOIN metrics m USING (prompt_id)
                                WHERE m.cell_id = ? AND m.repeat = 0 ORDER BY p.prompt_id""",
            [cell_id],
        )
        pos = dict_rows(
            con,
            """SELECT count(*) AS n, min(position) AS first, max(position) AS last
                            FROM metrics WHERE cell_id = ? AND repeat = 0""",
            [cell_id],
        )[0]
    finally:
        con.close()
    return cell, ref, s, ranges, prompts, pos


def _disclosure(cell: dict, ref: dict, s: dict, prompts: list, pos: dict, as_is: Collection[str]) -> dict:
    ctx = sorted(p["n_tokens"] for p in prompts)
    cats: dict[str, int] = {}
    for p in prompts:
        cats[p["category"]] = cats.get(p["category"], 0) + 1
    ids_hash = hashlib.sha256("".join(p["ids_sha256"] for p in prompts).encode()).hexdigest()
    vocab, evocab = cell.get("vocab_size"), cell.get("engine_vocab_size")
    trunc = (
        f"none: all {evocab} logits per row compared"
        if evocab == vocab or evocab is None
        else f"none: the engine's {evocab} logits per row (tokenizer {vocab}) compared in full"
    )
    return {
        "reference_checkpoint": {
            "identity": ref.get("model_identity"),
            # a GGUF run as it is, never dequantised: the file is the checkpoint
            "weights_sha256": ref.get("weights_sha256")
            or ("none: the GGUF file itself (source_sha256)" if ref.get("source_sha256") else None),
            # a GGUF-sourced checkpoint also names the file it was dequantised from
            "source": ref.get("model_source"),
            **({"source_sha256": ref["source_sha256"]} if ref.get("source_sha256") else {}),
        },
        "reference_runtime": _runtime(ref, as_is),
        "candidate_runtime": _runtime(cell, as_is),
        "evaluation_text": {
            "corpus": cell.get("corpus"),
            "prompts": len(prompts),
            "categories": cats,
            "token_ids_sha256": ids_hash,
            "bos_policy": cell.get("bos_policy"),
            "tokenizer_parity": cell.get("tokenizer_parity"),
        },
        "candidate_artifact": artifact(cell),
        "calibration_data": calibration(cell, as_is),
        "context_lengths": {
            "min": ctx[0] if ctx else None,
            "median": ctx[len(ctx) // 2] if ctx else None,
            "max": ctx[-1] if ctx else None,
            "fed_prefix_tokens": cell.get("max_tokens") or "whole prompts",
        },
        "sampled_positions": {
            "stride": cell.get("stride"),
            "count": pos["n"],
            "first": pos["first"],
            "last": pos["last"],
            "rule": _positions_rule(cell),
            "teacher_forced": True,
        },
        "kl_direction": "KL(P_reference || P_candidate), natural log (nats); reverse KL and JS also reported",
        "vocabulary_truncation": trunc,
        "aggregation": (
            f"arithmetic mean over {s['rows']} sampled rows (repeat 0) of per-row KL computed in float64 "
            "from full-vocabulary log-softmax; ± standard error of the mean; percentiles by linear "
            "interpolation; per output range as listed; rows with NaN/Inf excluded and counted"
        ),
        "storage_floor": s["storage_floor"],
        "bit_reproducible": {
            "candidate": cell.get("bit_reproducible"),
            "reference": ref.get("bit_reproducible"),
            "repeats": cell.get("repeats"),
        },
    }


# the summary's numbers a card gives: the registry's (common/metric_defs.py, shown on the card), then these
NUMBERS = tuple(a.alias for _, a in D.aggregates(D.CARD)) + tuple(
    "rows nonfinite_rows below_resolution ppl ppl_ref ppl_ratio nll_correlation".split()
)


def build_card(
    warehouse: str, cell_id: str, allow_undisclosed: bool = False, *, extras, as_is: Collection[str]
) -> dict:
    """extras: the per-cell extras (key, card(warehouse, cell)); each adds its block (null without).
    as_is: the engines whose cells without a weights recipe run the reference checkpoint's own
    weights at their dtype (backends.as_is(): Backend.checkpoint_as_is)."""
    cell, ref, s, ranges, prompts, pos = _query(warehouse, cell_id)
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
        "by_confidence": query_rows(warehouse, C.CARD_SQL, [cell_id]),
        "disclosure": disclosure,
        "undisclosed": missing,
        **{x.key: x.card(warehouse, cell) for x in extras},
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
    out += C.card_lines(card.get("by_confidence") or [])
    out += ["", "| disclosure | value |", "|---|---|"]
    for k, v in card["disclosure"].items():
        if isinstance(v, dict) and k.endswith("runtime"):
            for kk, vv in v.items():
                out.append(f"| {k}.{kk} | {fmt_value(vv).replace('|', '/')} |")
        else:
            out.append(f"| {k} | {fmt_value(v).replace('|', '/')} |")
    for x in extras:  # each per-cell extra's block (extras: Extra.card_lines)
        if card.get(x.key):
            out += x.card_lines(card[x.key])
    if card["undisclosed"]:
        out += ["", f"Undisclosed: {', '.join(card['undisclosed'])}."]
    return "\n".join(out) + "\n"
