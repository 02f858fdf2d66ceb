"""Reference-output fixtures (seed 000_d5fbcc845b899b80.txt): export one from a captured cell,
and check a stack against one.

The file format is store/fixture_file.py; the bounded KL against a top-k fixture is
analysis/truncated.py. Row layout: position p predicts token_ids[p + 1] (teacher forcing: the
prompt's own ids are fed, never sampled ones):

    token_ids   t0   t1   t2   t3 ...
    position    0    1    2    3
    row p       sees t0..tp, scores t(p+1)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from analysis.card import hardware
from analysis.truncated import topk_rows, truncated_metrics
from common import ids
from common.errors import UserError
from common.stack import Cell
from store import Warehouse, fixture_file
from store.warehouse import logits_matrix, unshift, widen

PROMPT_KEYS = ("prompt_id", "name", "category", "text", "token_ids", "ids_sha256", "bos_policy", "bos_added",
               "tokenizer_sha256")
PRODUCER_KEYS = ("cell_id", "engine", "dtype", "attention", "tp", "device", "threads", "logits_dtype",
                 "bit_reproducible", "artifact_sha256", "build", "host")


def _header(cell: dict, k: int, vocab: int, prompts: list[dict]) -> dict:
    return {
        "k": k, "vocab_size": vocab, "kl_direction": "KL(P_fixture || P_stack), natural log",
        "sampling": {"mode": "teacher-forced prefill: raw logits at sampled positions of the given ids",
                     "temperature": None, "top_k": None, "top_p": None, "seed": None},
        "model": {"name": cell["model"], "identity": cell.get("model_identity"),
                  "weights_sha256": cell.get("weights_sha256"), "source_sha256": cell.get("source_sha256")},
        "produced_by": {key: cell.get(key) for key in PRODUCER_KEYS}
        | {"settings": json.loads(cell.get("settings") or "{}"), "versions": json.loads(cell.get("versions") or "{}"),
           "hardware": hardware(cell)},
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
    t = wh.read_shard(cell_id, 0)
    shift = t.column("shift") if "shift" in t.column_names else None  # pre-v8 shards have none
    logits = unshift(logits_matrix(t.column("logits")), shift)  # (rows, vocab) float32, the raw logits
    k = min(k, logits.shape[1])
    top, top_vals, lse = topk_rows(logits, k)
    pids = t.column("prompt_id").to_pylist()
    prompts = {p["prompt_id"]: p for p in wh.read_all("prompts")}
    header = _header(cell, k, logits.shape[1], [prompts[p] for p in sorted(set(pids))])
    fixture_file.write(out, header, {
        "prompt_id": pids, "position": t.column("position").to_pylist(),
        "next_token_id": t.column("next_token_id").to_pylist(), "topk_ids": top.astype(np.int32).tolist(),
        "topk_logits": top_vals.tolist(), "logsumexp": lse.tolist(), "row_hash": t.column("row_hash").to_pylist()})
    log(f"wrote {out}: {len(pids)} rows, top-{k} of {logits.shape[1]}, from {cell_id}")
    return {"path": str(out), "rows": len(pids), "k": k, "vocab_size": int(logits.shape[1]),
            "prompts": len(header["prompts"])}


def _check_prompts(path: str, header: dict, model: str, tok, vocab: int) -> None:
    """The fixture's ids must be what this model's tokenizer makes of its texts."""
    if vocab != header["vocab_size"]:
        raise UserError(f"{path}: vocabulary {header['vocab_size']} but model {model} has {vocab}: "
                        "the fixture belongs to another model")
    for pr in header["prompts"]:
        fixture_ids = pr["token_ids"]
        if pr.get("text") is not None:
            plain = list(tok(pr["text"], add_special_tokens=False).input_ids)
            mine = plain if not pr.get("bos_added") else [tok.bos_token_id] + plain
            if mine != fixture_ids:
                i = next((j for j, (a, b) in enumerate(zip(mine, fixture_ids)) if a != b),
                         min(len(mine), len(fixture_ids)))
                raise UserError(f"{path}: prompt {pr['prompt_id']}: token ids do not match model {model}'s tokenizer "
                                f"(first difference at position {i}: fixture "
                                f"{fixture_ids[i] if i < len(fixture_ids) else 'end'}, "
                                f"model {mine[i] if i < len(mine) else 'end'})")
        if max(fixture_ids) >= vocab:
            raise UserError(f"{path}: prompt {pr['prompt_id']} has token id {max(fixture_ids)} >= vocab {vocab}")


def _run_stack(backend, header: dict, rows: dict[str, list], vocab: int) -> np.ndarray:
    """The stack's logits at every fixture row: (rows, vocab) float32."""
    by_prompt: dict[str, list[int]] = {}
    for i, pid in enumerate(rows["prompt_id"]):
        by_prompt.setdefault(pid, []).append(i)
    ids_of = {pr["prompt_id"]: pr["token_ids"] for pr in header["prompts"]}
    stack = np.empty((len(rows["prompt_id"]), vocab), dtype=np.float32)
    for pid, idx in by_prompt.items():
        stack[idx] = widen(backend.forward(ids_of[pid], [rows["position"][i] for i in idx]))[:, :vocab]
    return stack


def differences(header: dict, engine: str, dtype: str, attention: str, weights: str | None, artifact: str | None,
                build: str | None, hw: str | None) -> list[dict]:
    """What differs between the fixture's producing stack and the stack under check."""
    made = header.get("produced_by") or {}
    pairs = [("weights_sha256", (header.get("model") or {}).get("weights_sha256"), weights),
             ("artifact_sha256", made.get("artifact_sha256"), artifact), ("engine", made.get("engine"), engine),
             ("dtype", made.get("dtype"), dtype), ("attention", made.get("attention"), attention),
             ("build", made.get("build"), build), ("hardware", made.get("hardware"), hw)]
    return [{"what": w, "fixture": a, "stack": b} for w, a, b in pairs if a != b]


def check_fixture(path: str, engine: str, model: str, dtype: str, attention: str, threads: int,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run a stack (in this process) on the fixture's prompts and measure it against the fixture."""
    import transformers

    from backends import backend_class
    from matrix.cells import stack_desc
    from matrix.models import fetch
    from matrix.spec import ModelRef

    header, rows = fixture_file.load(path)
    p = Path(model).expanduser()
    ref = ModelRef(p.name, "path", str(p.resolve())) if p.exists() else ModelRef(model, "catalog", model)
    resolved = fetch(ref, log=log)
    tok = transformers.AutoTokenizer.from_pretrained(resolved.hf_dir)
    config = transformers.AutoConfig.from_pretrained(resolved.hf_dir)
    vocab = int(getattr(config, "vocab_size", 0) or len(tok))
    _check_prompts(path, header, model, tok, vocab)
    cls = backend_class(engine)
    if cls is None:
        raise UserError(f"fixture check: --engine {engine}: no such engine installed")
    cell = Cell(ref.name, engine, dtype, attention, 1, "cpu", threads, ids.check_cell_id(engine, dtype, attention))
    why = cls.unsupported(cell)
    if why:
        raise UserError(f"fixture check: {why}")
    backend = cls(stack_desc(cell, resolved), resolved.hf_dir, threads)
    backend.load()
    try:
        stack = _run_stack(backend, header, rows, vocab)
        settings = backend.settings()
    finally:
        backend.close()
    from actors.fingerprint import fingerprint
    from common.builds import engine_build

    art = settings.get("artifact") or {}
    here = hardware({"fingerprint": json.dumps(fingerprint(), default=str), "device": "cpu"})
    diff = differences(header, engine, dtype, attention, resolved.weights_sha256, art.get("sha256"),
                       engine_build(cls.libraries)["build"], here)
    m = truncated_metrics(np.asarray(rows["topk_ids"], dtype=np.int64), np.asarray(rows["topk_logits"]),
                          np.asarray(rows["logsumexp"]), stack)
    return {"header": header, "metrics": m, "rows": len(stack), "nonfinite": int((~np.isfinite(stack).all(-1)).sum()),
            "settings": settings, "differences": diff}
