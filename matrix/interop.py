"""Warehouse <-> llama.cpp `--kl-divergence-base` files (format: store/llamacpp_kld.py).

Export: a captured cell's rows at the positions llama-perplexity scores (j = n_ctx/2 ... n_ctx-2
of each chunk; a chunk is the first n_ctx ids of a prompt) -> a base file, so
`llama-perplexity --kl-divergence --kl-divergence-base FILE` can score a GGUF against it.

Import: a base file -> a cell (engine `llama.cpp-kld-base`) holding the decoded log-probs, usable
as `matrix analyze --reference CELL`. The format is lossy (uint16 steps, a clamp 16 nats below
the top) and carries no model or tokenizer hash: the import says so and records both in
cells.settings, with an estimate of the format's own KL floor.
"""

from __future__ import annotations

import datetime as dt
import json
import socket
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq

from matrix.corpus import ids_sha256
from matrix.errors import UserError
from matrix.models import sha256_file
from store import Warehouse
from store import llamacpp_kld as K
from store.warehouse import ShardWriter, logits_matrix

ENGINE = "llama.cpp-kld-base"
CLAMPED_BELOW = 64.0  # nats below min_log_prob where an imported clamped entry is put


def _prompts(wh: Warehouse, model: str) -> list[dict]:
    return sorted((p for p in wh.read_all("prompts") if p["model"] == model), key=lambda p: p["prompt_id"])


def export_kld_base(warehouse: str, cell_id: str, n_ctx: int, out: str, log: Callable[[str], None] = print) -> dict:
    wh = Warehouse(warehouse).require()
    cells = {c["cell_id"]: c for c in wh.read_all("cells")}
    if cell_id not in cells or cells[cell_id]["status"] != "done":
        raise UserError(f"kld-base export: no captured cell {cell_id} in {wh.root}")
    if n_ctx < 4 or n_ctx % 2:
        raise UserError(f"kld-base export: --n-ctx {n_ctx}: must be an even number >= 4")
    cell = cells[cell_id]
    chunks = [p for p in _prompts(wh, cell["model"]) if p["n_tokens"] >= n_ctx]
    if not chunks:
        raise UserError(f"kld-base export: no prompt of {cell['model']} has {n_ctx} tokens; use a smaller --n-ctx")
    t = pq.read_table(wh.shard_path(cell_id, 0), columns=["prompt_id", "position", "logits"])
    index = {(p, q): i for i, (p, q) in enumerate(zip(t.column("prompt_id").to_pylist(),
                                                     t.column("position").to_pylist()))}
    want = list(K.scored_positions(n_ctx))
    missing = [(c["prompt_id"], j) for c in chunks for j in want if (c["prompt_id"], j) not in index]
    if missing:
        first = missing[0]
        raise UserError(f"kld-base export: cell {cell_id} lacks {len(missing)} of the {len(chunks) * len(want)} rows "
                        f"llama.cpp scores (positions {want[0]}..{want[-1]} of each {n_ctx}-token chunk), first "
                        f"prompt {first[0]} position {first[1]}; capture with `stride: 1` (and max_tokens >= {n_ctx})")
    logits = logits_matrix(t.column("logits"))  # (rows, vocab)
    per_chunk = [logits[[index[(c["prompt_id"], j)] for j in want]] for c in chunks]  # each (n_scored, vocab)
    tokens = np.array([c["token_ids"][:n_ctx] for c in chunks], dtype=np.int32)
    K.write(out, n_ctx, tokens, per_chunk)
    log(f"wrote {out}: {len(chunks)} chunk(s) x {len(want)} scored rows, n_ctx {n_ctx}, vocab {logits.shape[1]}")
    return {"path": str(out), "n_ctx": n_ctx, "n_chunk": len(chunks), "rows": len(chunks) * len(want),
            "n_vocab": int(logits.shape[1]), "prompts": [c["prompt_id"] for c in chunks]}


def floor_estimate(rows_u16: np.ndarray, n_vocab: int) -> np.ndarray:
    """Per row, a bound on the KL the encoding itself costs, from the file alone: uniform rounding
    of each log-prob within +-scale/2 (KL ~ scale^2/24), plus the probability mass the clamp
    dropped (at most e^min_log_prob per clamped token; dropping mass m costs KL ~ m)."""
    head = np.ascontiguousarray(rows_u16[:, :4]).view(np.float32)  # (rows, 2)
    scale, mlp = head[:, 0].astype(np.float64), head[:, 1].astype(np.float64)
    dropped = (rows_u16[:, 4:4 + n_vocab] == 0).sum(-1) * np.exp(mlp)
    return scale ** 2 / 24 + np.minimum(dropped, 1.0)


def import_kld_base(warehouse: str, path: str, model: str, log: Callable[[str], None] = print) -> dict:
    try:
        f = K.read(path)
    except K.FormatError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"{path}: {e.strerror}") from None
    wh = Warehouse(warehouse).require()
    sha = sha256_file(Path(path))  # chunked: a base file can be many GB
    cell_id = f"{model}.{ENGINE}.{sha[:12]}"
    with wh.lock():
        wh.migrate(log)
        cells = wh.read_all("cells")
        if any(c["cell_id"] == cell_id for c in cells):
            log(f"{path} is already imported as {cell_id}")
            return {"cell_id": cell_id, "imported": False}
        mine = [c for c in cells if c["model"] == model and c["status"] == "done" and c.get("vocab_size")]
        if not mine:
            raise UserError(f"kld-base import: --model {model}: no captured cell of that model in {wh.root} "
                            "(the file carries no model hash; name the warehouse model it belongs to)")
        vocab = mine[0]["vocab_size"]
        engine_vocab = {c.get("engine_vocab_size") or vocab for c in mine}
        if f["n_vocab"] not in engine_vocab | {vocab}:
            raise UserError(f"{path}: n_vocab {f['n_vocab']} does not match model {model} (vocab {vocab}): "
                            "a base file from another model or tokenizer")
        prompts = _prompts(wh, model)
        n_ctx, scored = f["n_ctx"], list(K.scored_positions(f["n_ctx"]))
        run_id = "import-" + uuid.uuid4().hex[:10]
        writer = ShardWriter(wh.root, run_id, cell_id, 0)
        floors, matched, new_prompts = [], 0, []
        try:
            for c in range(f["n_chunk"]):
                toks = [int(v) for v in f["tokens"][c]]
                # llama-perplexity feeds BOS in place of each chunk's first token: match on the rest
                hit = next((p for p in prompts if len(p["token_ids"]) >= n_ctx
                            and p["token_ids"][1:n_ctx] == toks[1:]), None)
                if hit is None:
                    ids_sha = ids_sha256(toks)
                    hit = {"prompt_id": f"kldbase-{ids_sha[:12]}", "model": model, "corpus": f"kld-base:{sha[:12]}",
                           "name": f"{Path(path).name} chunk {c}", "category": "kld-base", "source": str(path),
                           "text": None, "token_ids": toks, "n_tokens": n_ctx, "ids_sha256": ids_sha,
                           "bos_policy": None, "bos_added": None, "starts_with_bos": None, "tokenizer_sha256": None}
                    new_prompts.append(hit)
                else:
                    matched += 1
                rows = np.asarray(f["rows"][c])  # (n_scored, nv) uint16
                lp = K.decode_rows(rows, f["n_vocab"])  # (n_scored, vocab) log-probs
                # q = 0 means "16+ nats below the top: no information". llama.cpp's own KL skips those
                # base entries; stored at min_log_prob - 64 they carry ~zero probability here too,
                # instead of the e^-16 each that would otherwise be spread over thousands of tokens.
                head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # (n_scored, 2)
                clamped = (rows[:, 4:4 + f["n_vocab"]] == 0) & (head[:, :1] > 0)
                lp[clamped] = np.broadcast_to(head[:, 1:2] - np.float32(CLAMPED_BELOW), lp.shape)[clamped]
                floors.append(floor_estimate(rows, f["n_vocab"]))
                writer.add(hit["prompt_id"], scored, [toks[j + 1] for j in scored], lp)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        for p in new_prompts:
            if not wh.has_rows("prompts", p["prompt_id"]):
                wh.write_rows("prompts", p["prompt_id"], [p])
        floor = float(np.concatenate(floors).mean())
        settings = {"format": "llama.cpp kl-divergence-base (uint16 log-probs)", "lossy": True,
                    "step_nats_max": float(np.asarray(f["rows"][:, :, :2]).view(np.float32)[..., 0].max()),
                    "clamp_nats_below_top": K.CLAMP_NATS, "storage_floor": floor,
                    "model_hash": None, "tokenizer_hash": None, "file_sha256": sha, "n_ctx": n_ctx,
                    "first_token_of_chunk": "llama-perplexity feeds BOS in its place when the model adds BOS"}
        now = dt.datetime.now(dt.timezone.utc)
        wh.write_rows("cells", cell_id, [{
            "cell_id": cell_id, "run_id": run_id, "model": model, "engine": ENGINE, "dtype": "uint16-logprob",
            "attention": "unknown", "tp": None, "device": "unknown", "status": "done", "bit_reproducible": None,
            "repeats": 1, "rows_per_repeat": writer.rows, "n_prompts": f["n_chunk"], "stride": 1,
            "corpus": f"kld-base:{Path(path).name}", "is_reference": True, "reference_cell_id": None,
            "model_identity": None, "model_source": str(path), "vocab_size": vocab,
            "engine_vocab_size": f["n_vocab"], "logits_dtype": "float32", "artifact": str(path),
            "artifact_sha256": sha, "tokenizer_parity": "not_checked", "settings": json.dumps(settings),
            "versions": json.dumps({}), "host": socket.gethostname(), "finished_at": now}])
        wh.write_rows("runs", run_id, [{
            "run_id": run_id, "status": "done", "started_at": now, "finished_at": now,
            "spec_name": f"import {Path(path).name}", "spec_path": str(path), "spec_sha256": sha,
            "host": socket.gethostname(), "cells_total": 1, "cells_done": 1, "rows_written": writer.rows}])
    log(f"imported {path} as {cell_id}: {f['n_chunk']} chunk(s), {writer.rows} rows ({matched} chunk(s) matched "
        f"warehouse prompts). LOSSY format: uint16 log-probs (step <= {settings['step_nats_max']:.2e} nats), "
        f"clamped 16 nats below the top; estimated KL floor {floor:.2e}. The file carries no model or tokenizer "
        f"hash: only n_vocab ({f['n_vocab']}) was checked against {model}.")
    return {"cell_id": cell_id, "imported": True, "rows": writer.rows, "chunks": f["n_chunk"],
            "matched_prompts": matched, "storage_floor": floor, "lossy": True}
