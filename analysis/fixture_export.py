"""Reference-output fixtures: export one from a captured cell (the file format is
store/fixture_file.py). A fixture is the top-k of each row, with its logsumexp, so a stack can be
measured against it without the full-vocabulary rows (analysis/truncated.py bounds that KL).
Row layout: position p predicts token_ids[p + 1] (teacher forcing: the prompt's own ids are fed,
never sampled ones):

    token_ids   t0   t1   t2   t3 ...
    position    0    1    2    3
    row p       sees t0..tp, scores t(p+1)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from analysis.disclosure import hardware
from analysis.truncated import topk_rows
from common.errors import UserError
from store import Warehouse, fixture_file
from store.warehouse import logits_matrix, unshift

PROMPT_KEYS = (
    "prompt_id",
    "name",
    "category",
    "text",
    "token_ids",
    "ids_sha256",
    "bos_policy",
    "bos_added",
    "tokenizer_sha256",
)
PRODUCER_KEYS = (
    "cell_id",
    "engine",
    "dtype",
    "attention",
    "tp",
    "device",
    "threads",
    "logits_dtype",
    "bit_reproducible",
    "artifact_sha256",
    "build",
    "host",
)


def _header(cell: dict, k: int, vocab: int, prompts: list[dict]) -> dict:
    return {
        "k": k,
        "vocab_size": vocab,
        "kl_direction": "KL(P_fixture || P_stack), natural log",
        "sampling": {
            "mode": "teacher-forced prefill: raw logits at sampled positions of the given ids",
            "temperature": None,
            "top_k": None,
            "top_p": None,
            "seed": None,
        },
        "model": {
            "name": cell["model"],
            "identity": cell.get("model_identity"),
            "weights_sha256": cell.get("weights_sha256"),
            "source_sha256": cell.get("source_sha256"),
        },
        "produced_by": {key: cell.get(key) for key in PRODUCER_KEYS}
        | {
            "settings": json.loads(cell.get("settings") or "{}"),
            "versions": json.loads(cell.get("versions") or "{}"),
            "hardware": hardware(cell),
        },
        "stride": cell.get("stride"),
        "prompts": [{key: p.get(key) for key in PROMPT_KEYS} for p in prompts],
    }


def export_fixture(warehouse: str, cell_id: str, out: str, k: int = 64, log: Callable[[str], None] = print) -> dict:
    wh = Warehouse(warehouse).require()
    cell = {c["cell_id"]: c for c in wh.read_all("cells")}.get(cell_id)
    if cell is None or cell["status"] != "done":
        raise UserError(f"fixture export: no captured cell {cell_id} in {wh.where}")
    if k < 1:
        raise UserError(f"fixture export: --k {k}: must be >= 1")
    if Path(out).suffix not in fixture_file.SUFFIXES:
        raise UserError(f"fixture export: --out {out}: name it .json (human-readable) or .parquet (dense)")
    wh.require_values(cell_id, 0)
    t = wh.read_shard(cell_id, 0)
    shift = t.column("shift") if "shift" in t.column_names else None  # pre-v8 shards have none
    logits = unshift(logits_matrix(t.column("logits")), shift)  # (rows, vocab) float32, the raw logits
    k = min(k, logits.shape[1])
    top, top_vals, lse = topk_rows(logits, k)
    pids = t.column("prompt_id").to_pylist()
    prompts = {p["prompt_id"]: p for p in wh.read_all("prompts")}
    header = _header(cell, k, logits.shape[1], [prompts[p] for p in sorted(set(pids))])
    fixture_file.write(
        out,
        header,
        {
            "prompt_id": pids,
            "position": t.column("position").to_pylist(),
            "next_token_id": t.column("next_token_id").to_pylist(),
            "topk_ids": top.astype(np.int32).tolist(),
            "topk_logits": top_vals.tolist(),
            "logsumexp": lse.tolist(),
            "row_hash": t.column("row_hash").to_pylist(),
        },
    )
    log(f"wrote {out}: {len(pids)} rows, top-{k} of {logits.shape[1]}, from {cell_id}")
    return {
        "path": str(out),
        "rows": len(pids),
        "k": k,
        "vocab_size": int(logits.shape[1]),
        "prompts": len(header["prompts"]),
    }
