"""Reference-output fixtures (seeds/000): a standalone file a stack can be gated against.

A fixture keeps, for every sampled row of one captured cell, the top-k token ids and raw
logits plus the logsumexp of the full row. The logsumexp makes the reference's tail mass
T = 1 - sum(top-k probabilities) exact, so the KL quoted against a fixture is bounded:

    KL_coarse = sum_topk p log(p/q) + T log(T / Q_tail)         (top-k + one "rest" bucket)
    KL_coarse <= KL(P || Q) <= KL_coarse + T * log( (p_k / T) * (Q_tail / q_min_tail) )

The lower end is KL between the coarse-grained distributions (data processing inequality);
the upper end holds because every tail p_j <= p_k, the smallest top-k probability. Gates
apply to the lower end (a stack failing it certainly fails); the upper end is printed beside.

Row layout: position p predicts token_ids[p + 1] (teacher forcing: the prompt's own ids are
fed, never sampled ones):

    token_ids   t0   t1   t2   t3 ...
    position    0    1    2    3
    row p       sees t0..tp, scores t(p+1)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from matrix.errors import UserError
from store import Warehouse
from store.warehouse import logits_matrix, widen

FORMAT = "logit-matrix-fixture"
VERSION = 1
META_KEY = b"logit_matrix_fixture"


def _checksum(ids: list[int], logits: list[float], lse: float) -> str:
    payload = np.asarray(ids, dtype=np.int32).tobytes() + np.asarray(logits, dtype=np.float32).tobytes() \
        + np.float64(lse).tobytes()
    return hashlib.sha256(payload).hexdigest()


def export_fixture(warehouse: str, cell_id: str, out: str, k: int = 64, log: Callable[[str], None] = print) -> dict:
    wh = Warehouse(warehouse).require()
    cells = {c["cell_id"]: c for c in wh.read_all("cells")}
    cell = cells.get(cell_id)
    if cell is None or cell["status"] != "done":
        raise UserError(f"fixture export: no captured cell {cell_id} in {wh.root}")
    if k < 1:
        raise UserError(f"fixture export: --k {k}: must be >= 1")
    suffix = Path(out).suffix
    if suffix not in (".json", ".parquet"):
        raise UserError(f"fixture export: --out {out}: name it .json (human-readable) or .parquet (dense)")
    t = pq.read_table(wh.shard_path(cell_id, 0))
    logits = logits_matrix(t.column("logits"))  # (rows, vocab) float32
    vocab = logits.shape[1]
    k = min(k, vocab)
    x = logits.astype(np.float64)
    mx = x.max(-1, keepdims=True)
    lse = (mx[:, 0] + np.log(np.exp(x - mx).sum(-1)))  # (rows,) of the full row
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # (rows, k) descending, ties: lower id
    top_vals = np.take_along_axis(logits, top, -1)
    pids = t.column("prompt_id").to_pylist()
    used = sorted(set(pids))
    prompts = {p["prompt_id"]: p for p in wh.read_all("prompts")}
    header = {
        "format": FORMAT, "version": VERSION, "k": k, "vocab_size": vocab,
        "kl_direction": "KL(P_fixture || P_stack), natural log",
        "sampling": {"mode": "teacher-forced prefill: raw logits at sampled positions of the given ids",
                     "temperature": None, "top_k": None, "top_p": None, "seed": None},
        "model": {"name": cell["model"], "identity": cell.get("model_identity"),
                  "weights_sha256": cell.get("weights_sha256"), "source_sha256": cell.get("source_sha256")},
        "produced_by": {k2: cell.get(k2) for k2 in ("cell_id", "engine", "dtype", "attention", "tp", "device",
                                                    "threads", "logits_dtype", "bit_reproducible")}
        | {"settings": json.loads(cell.get("settings") or "{}"), "versions": json.loads(cell.get("versions") or "{}")},
        "stride": cell.get("stride"),
        "prompts": [{key: prompts[p].get(key) for key in ("prompt_id", "name", "category", "text", "token_ids",
                                                          "ids_sha256", "bos_policy", "bos_added", "tokenizer_sha256")}
                    for p in used],
    }
    nxt = t.column("next_token_id").to_pylist()
    rows = {
        "prompt_id": pids, "position": t.column("position").to_pylist(), "next_token_id": nxt,
        "topk_ids": top.astype(np.int32).tolist(), "topk_logits": top_vals.tolist(), "logsumexp": lse.tolist(),
        "row_hash": t.column("row_hash").to_pylist(),
    }
    rows["checksum"] = [_checksum(i, v, s) for i, v, s in zip(rows["topk_ids"], rows["topk_logits"], rows["logsumexp"])]
    if suffix == ".json":
        body = {**header, "rows": [dict(zip(rows, vals)) for vals in zip(*rows.values())]}
        Path(out).write_text(json.dumps(body, indent=1))
    else:
        table = pa.table({
            "prompt_id": rows["prompt_id"], "position": pa.array(rows["position"], pa.int32()),
            "next_token_id": pa.array(rows["next_token_id"], pa.int32()),
            "topk_ids": pa.array(rows["topk_ids"], pa.list_(pa.int32())),
            "topk_logits": pa.array(rows["topk_logits"], pa.list_(pa.float32())),
            "logsumexp": pa.array(rows["logsumexp"], pa.float64()),
            "row_hash": rows["row_hash"], "checksum": rows["checksum"],
        })
        table = table.replace_schema_metadata({META_KEY: json.dumps(header).encode()})
        pq.write_table(table, out, compression="zstd")
    log(f"wrote {out}: {len(pids)} rows, top-{k} of {vocab}, from {cell_id}")
    return {"path": str(out), "rows": len(pids), "k": k, "vocab_size": vocab, "prompts": len(used)}


def load_fixture(path: str) -> tuple[dict, dict[str, list]]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: fixture not found")
    try:
        if p.suffix == ".parquet":
            t = pq.read_table(p)
            meta = (t.schema.metadata or {}).get(META_KEY)
            if meta is None:
                raise UserError(f"{p}: not a logit-matrix fixture (no {META_KEY.decode()} metadata)")
            header = json.loads(meta)
            rows = {c: t.column(c).to_pylist() for c in t.column_names}
        else:
            body = json.loads(p.read_text())
            if not isinstance(body, dict) or not isinstance(body.get("rows"), list):
                raise UserError(f"{p}: not a logit-matrix fixture (no rows)")
            header = {k: v for k, v in body.items() if k != "rows"}
            keys = ("prompt_id", "position", "next_token_id", "topk_ids", "topk_logits", "logsumexp", "row_hash",
                    "checksum")
            rows = {k: [r.get(k) for r in body["rows"]] for k in keys}
    except (json.JSONDecodeError, pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise UserError(f"{p}: not a readable fixture ({str(e).splitlines()[0][:120]})") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise UserError(f"{p}: format {header.get('format')!r} version {header.get('version')!r}; "
                        f"expected {FORMAT!r} version {VERSION}")
    for i, (ids, vals, lse, ck) in enumerate(zip(rows["topk_ids"], rows["topk_logits"], rows["logsumexp"],
                                                  rows["checksum"])):
        if _checksum(ids, vals, lse) != ck:
            raise UserError(f"{p}: row {i} (prompt {rows['prompt_id'][i]} position {rows['position'][i]}) "
                            "fails its checksum: the fixture was altered or damaged")
    return header, rows


def truncated_metrics(topk_ids: np.ndarray, topk_logits: np.ndarray, lse: np.ndarray,
                      stack: np.ndarray) -> dict[str, np.ndarray]:
    """Fixture rows (top-k ids (rows, k), their logits, full-row logsumexp) vs a stack's full logits
    (rows, vocab). Returns per-row coarse KL (a lower bound), its upper bound, JS of the coarse
    distributions, top-1 match, and cosine / norm ratio / max |diff| over the top-k logits."""
    s = stack.astype(np.float64)  # (rows, vocab)
    m = s.max(-1, keepdims=True)
    lq = s - (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))  # (rows, vocab) stack log-probs
    lp_k = topk_logits.astype(np.float64) - lse[:, None]  # (rows, k) reference log-probs, exact
    p_k, lq_k = np.exp(lp_k), np.take_along_axis(lq, topk_ids, -1)
    q_k = np.exp(lq_k)
    tail_p = np.clip(1.0 - p_k.sum(-1), 0.0, 1.0)  # (rows,)
    tail_q = np.clip(1.0 - q_k.sum(-1), 1e-300, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(tail_p > 0, tail_p * np.log(tail_p / tail_q), 0.0)
        kl = (p_k * (lp_k - lq_k)).sum(-1) + rest
        mask = np.ones_like(lq, dtype=bool)
        np.put_along_axis(mask, topk_ids, False, -1)
        q_min_tail = np.where(mask, np.exp(lq), np.inf).min(-1)
        gap = np.where(tail_p > 0, tail_p * np.maximum(0.0, np.log(p_k.min(-1) / tail_p) + np.log(tail_q / q_min_tail)),
                       0.0)
        pm = np.concatenate([p_k, tail_p[:, None]], 1)
        qm = np.concatenate([q_k, tail_q[:, None]], 1)
        mm = 0.5 * (pm + qm)
        js = 0.5 * (np.where(pm > 0, pm * np.log(pm / mm), 0) + np.where(qm > 0, qm * np.log(qm / mm), 0)).sum(-1)
    sv = np.take_along_axis(s, topk_ids, -1)
    rv = topk_logits.astype(np.float64)
    return {
        "kld": np.maximum(kl, 0.0), "kld_upper": np.maximum(kl, 0.0) + gap, "tail_mass": tail_p, "js": js,
        "top1_match": topk_ids[:, 0] == stack.argmax(-1),
        "cosine_topk": (rv * sv).sum(-1) / np.linalg.norm(rv, axis=-1) / np.linalg.norm(sv, axis=-1),
        "norm_ratio_topk": np.linalg.norm(sv, axis=-1) / np.linalg.norm(rv, axis=-1),
        "max_abs_diff_topk": np.abs(sv - rv).max(-1),
    }


def check_fixture(path: str, engine: str, model: str, dtype: str, attention: str, threads: int,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run a stack (in this process) on the fixture's prompts and measure it against the fixture."""
    import transformers

    from backends import backend_class
    from matrix.models import fetch
    from matrix.spec import ModelRef

    header, rows = load_fixture(path)
    p = Path(model).expanduser()
    ref = ModelRef(p.name, "path", str(p.resolve())) if p.exists() else ModelRef(model, "catalog", model)
    resolved = fetch(ref, log=log)
    tok = transformers.AutoTokenizer.from_pretrained(resolved.hf_dir)
    config = transformers.AutoConfig.from_pretrained(resolved.hf_dir)
    vocab = int(getattr(config, "vocab_size", 0) or len(tok))
    if vocab != header["vocab_size"]:
        raise UserError(f"{path}: vocabulary {header['vocab_size']} but model {model} has {vocab}: "
                        "the fixture belongs to another model")
    for pr in header["prompts"]:
        ids = pr["token_ids"]
        if pr.get("text") is not None:
            plain = list(tok(pr["text"], add_special_tokens=False).input_ids)
            mine = plain if not pr.get("bos_added") else [tok.bos_token_id] + plain
            if mine != ids:
                i = next((j for j, (a, b) in enumerate(zip(mine, ids)) if a != b), min(len(mine), len(ids)))
                raise UserError(f"{path}: prompt {pr['prompt_id']}: token ids do not match model {model}'s tokenizer "
                                f"(first difference at position {i}: fixture "
                                f"{ids[i] if i < len(ids) else 'end'}, model {mine[i] if i < len(mine) else 'end'})")
        if max(ids) >= vocab:
            raise UserError(f"{path}: prompt {pr['prompt_id']} has token id {max(ids)} >= vocab {vocab}")
    cls = backend_class(engine)
    if cls is None:
        raise UserError(f"fixture check: --engine {engine}: no such engine installed")
    cell = {"model": ref.name, "engine": engine, "dtype": dtype, "attention": attention, "tp": 1, "device": "cpu",
            "cell_id": f"fixture-check.{engine}.{dtype}.{attention}", "options": {}, "max_tokens": None,
            "weights_sha256": resolved.weights_sha256,
            "source": {"gguf": resolved.gguf_path, "quant": resolved.gguf_quant}}
    from matrix.spec import Cell

    why = cls.unsupported(Cell(ref.name, engine, dtype, attention, 1, "cpu", threads, cell["cell_id"]))
    if why:
        raise UserError(f"fixture check: {why}")
    backend = cls(cell, resolved.hf_dir, threads)
    backend.load()
    try:
        by_prompt: dict[str, list[int]] = {}
        for i, pid in enumerate(rows["prompt_id"]):
            by_prompt.setdefault(pid, []).append(i)
        ids_of = {pr["prompt_id"]: pr["token_ids"] for pr in header["prompts"]}
        stack = np.empty((len(rows["prompt_id"]), vocab), dtype=np.float32)
        for pid, idx in by_prompt.items():
            positions = [rows["position"][i] for i in idx]
            out = widen(backend.forward(ids_of[pid], positions))[:, :vocab]  # (rows, vocab)
            stack[idx] = out
        settings = backend.settings()
    finally:
        backend.close()
    m = truncated_metrics(np.asarray(rows["topk_ids"], dtype=np.int64), np.asarray(rows["topk_logits"]),
                          np.asarray(rows["logsumexp"]), stack)
    return {"header": header, "metrics": m, "rows": len(stack), "nonfinite": int((~np.isfinite(stack).all(-1)).sum()),
            "settings": settings}
