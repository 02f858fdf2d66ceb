"""Warehouse <-> llama.cpp `--kl-divergence-base` files (format: store/llamacpp_kld.py).

Export: a captured cell's rows at the positions llama-perplexity scores (j = n_ctx/2 ... n_ctx-2
of each chunk; a chunk is the first n_ctx ids of a prompt) -> a base file, so
`llama-perplexity --kl-divergence --kl-divergence-base FILE` can score a GGUF against it.

Import: a base file -> a cell (engine `llama.cpp-kld-base`) holding the decoded log-probs, usable
as `matrix analyze --reference CELL`. The format is lossy (uint16 steps, a clamp 16 nats below
the top) and carries no model or tokenizer hash: the import says so and records both in
cells.settings, with an estimate of the format's own KL floor (store/floors.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from common import ids
from common.errors import UserError
from common.files import ids_sha256, sha256_file
from store import Warehouse
from store import llamacpp_kld as K
from store import rows as R
from store.floors import kld_base_floor
from store.prompt_rows import PromptRows
from store.shards import ShardWriter
from store.values import logits_matrix

ENGINE = "llama.cpp-kld-base"


def _prompts(wh: Warehouse, model: str) -> list[dict]:
    return sorted((p for p in wh.read_all("prompts") if p["model"] == model), key=lambda p: p["prompt_id"])


def export_kld_base(warehouse: str, cell_id: str, n_ctx: int, out: str, log: Callable[[str], None] = print) -> dict:
    wh = Warehouse(warehouse).require()
    cells = {c["cell_id"]: c for c in wh.read_all("cells")}
    if cell_id not in cells or cells[cell_id]["status"] != "done":
        raise UserError(f"kld-base export: no captured cell {cell_id} in {wh.where}")
    if n_ctx < 4 or n_ctx % 2:
        raise UserError(f"kld-base export: --n-ctx {n_ctx}: must be an even number >= 4")
    chunks = [p for p in _prompts(wh, cells[cell_id]["model"]) if p["n_tokens"] >= n_ctx]
    if not chunks:
        raise UserError(
            f"kld-base export: no prompt of {cells[cell_id]['model']} has {n_ctx} tokens; use a smaller --n-ctx"
        )
    wh.require_values(cell_id, 0)
    t = wh.read_shard(cell_id, 0, ["prompt_id", "position", "logits"])
    index = {
        (p, q): i for i, (p, q) in enumerate(zip(t.column("prompt_id").to_pylist(), t.column("position").to_pylist()))
    }
    want = list(K.scored_positions(n_ctx))
    missing = [(c["prompt_id"], j) for c in chunks for j in want if (c["prompt_id"], j) not in index]
    if missing:
        first = missing[0]
        raise UserError(
            f"kld-base export: cell {cell_id} lacks {len(missing)} of the {len(chunks) * len(want)} rows "
            f"llama.cpp scores (positions {want[0]}..{want[-1]} of each {n_ctx}-token chunk), first "
            f"prompt {first[0]} position {first[1]}; capture with `stride: 1` (and max_tokens >= {n_ctx})"
        )
    logits = logits_matrix(t.column("logits"))  # (rows, vocab)
    per_chunk = [logits[[index[(c["prompt_id"], j)] for j in want]] for c in chunks]  # each (n_scored, vocab)
    tokens = np.array([c["token_ids"][:n_ctx] for c in chunks], dtype=np.int32)
    K.write(out, n_ctx, tokens, per_chunk)
    log(f"wrote {out}: {len(chunks)} chunk(s) x {len(want)} scored rows, n_ctx {n_ctx}, vocab {logits.shape[1]}")
    return {
        "path": str(out),
        "n_ctx": n_ctx,
        "n_chunk": len(chunks),
        "rows": len(chunks) * len(want),
        "n_vocab": int(logits.shape[1]),
        "prompts": [c["prompt_id"] for c in chunks],
    }


def _read(path: str) -> dict:
    try:
        return K.read(path)
    except K.FormatError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"{path}: {e.strerror}") from None


def _model_vocab(wh: Warehouse, cells: list[dict], model: str, path: str, n_vocab: int) -> int:
    """The warehouse model's vocabulary; the file (which carries no hash) must have the same."""
    mine = [c for c in cells if c["model"] == model and c["status"] == "done" and c.get("vocab_size")]
    if not mine:
        raise UserError(
            f"kld-base import: --model {model}: no captured cell of that model in {wh.where} "
            "(the file carries no model hash; name the warehouse model it belongs to)"
        )
    vocab = mine[0]["vocab_size"]
    if n_vocab not in {c.get("engine_vocab_size") or vocab for c in mine} | {vocab}:
        raise UserError(
            f"{path}: n_vocab {n_vocab} does not match model {model} (vocab {vocab}): "
            "a base file from another model or tokenizer"
        )
    return vocab


def _chunk_prompt(
    prompts: list[dict], toks: list[int], n_ctx: int, model: str, path: str, sha: str, c: int
) -> tuple[dict, bool]:
    """The warehouse prompt a chunk was cut from, else a new prompt row for it; and whether it matched."""
    # llama-perplexity feeds BOS in place of each chunk's first token: match on the rest
    hit = next((p for p in prompts if len(p["token_ids"]) >= n_ctx and p["token_ids"][1:n_ctx] == toks[1:]), None)
    if hit is not None:
        return hit, True
    ids_sha = ids_sha256(toks)
    return R.prompt_row(
        prompt_id=ids.prompt_id("kldbase", ids_sha),
        model=model,
        corpus=f"kld-base:{sha[:12]}",
        name=f"{Path(path).name} chunk {c}",
        category="kld-base",
        source=str(path),
        text=None,
        token_ids=toks,
        n_tokens=n_ctx,
        ids_sha256=ids_sha,
        bos_policy=None,
        bos_added=None,
        starts_with_bos=None,
        tokenizer_sha256=None,
        source_sha256=sha,  # the kl-divergence-base file the chunk comes from
    ), False


def _write_rows(f: dict, writer: ShardWriter, prompts: list[dict], model: str, path: str, sha: str):
    """Decode every chunk into the shard; -> (new prompt rows, chunks matched, per-row floors)."""
    n_ctx, scored = f["n_ctx"], list(K.scored_positions(f["n_ctx"]))
    floors, matched, new_prompts = [], 0, []
    for c in range(f["n_chunk"]):
        toks = [int(v) for v in f["tokens"][c]]
        prompt, found = _chunk_prompt(prompts, toks, n_ctx, model, path, sha, c)
        matched += found
        new_prompts += [] if found else [prompt]
        rows = np.asarray(f["rows"][c])  # (n_scored, nv) uint16
        floors.append(kld_base_floor(*K.row_heads(rows), K.clamped(rows, f["n_vocab"]).sum(-1)))
        native = K.decode_for_import(rows, f["n_vocab"])
        writer.add(PromptRows(prompt["prompt_id"], scored, [toks[j + 1] for j in scored], native))
    return new_prompts, matched, float(np.concatenate(floors).mean())


def _settings(f: dict, sha: str, floor: float) -> dict:
    return {
        "format": "llama.cpp kl-divergence-base (uint16 log-probs)",
        "lossy": True,
        "step_nats_max": float(np.asarray(f["rows"][:, :, :2]).view(np.float32)[..., 0].max()),
        "clamp_nats_below_top": K.CLAMP_NATS,
        "storage_floor": floor,
        "model_hash": None,
        "tokenizer_hash": None,
        "file_sha256": sha,
        "n_ctx": f["n_ctx"],
        "first_token_of_chunk": "llama-perplexity feeds BOS in its place when the model adds BOS",
    }


def _write_shard(wh: Warehouse, f: dict, run_id: str, cell_id: str, model: str, path: str, sha: str):
    """The decoded rows as the cell's shard 0, committed whole or not at all.

    -> (writer, new prompt rows, chunks matched, storage floor)."""
    writer = ShardWriter(wh.where, run_id, cell_id, 0)
    try:
        new_prompts, matched, floor = _write_rows(f, writer, _prompts(wh, model), model, path, sha)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return writer, new_prompts, matched, floor


def _cell_row(
    f: dict, cell_id: str, run_id: str, model: str, vocab: int, rows: int, path: str, sha: str, settings: dict
):
    """The imported cell: a done reference of the named model, its settings saying what the format loses."""
    return R.cell_row(
        cell_id,
        run_id,
        "done",
        model=model,
        engine=ENGINE,
        dtype="uint16-logprob",
        attention="unknown",
        tp=None,
        device="unknown",
        bit_reproducible=None,
        repeats=1,
        rows_per_repeat=rows,
        n_prompts=f["n_chunk"],
        stride=1,
        corpus=f"kld-base:{Path(path).name}",
        is_reference=True,
        reference_cell_id=None,
        model_identity=None,
        model_source=str(path),
        vocab_size=vocab,
        engine_vocab_size=f["n_vocab"],
        logits_dtype="float32",
        artifact=str(path),
        artifact_sha256=sha,
        tokenizer_parity="not_checked",
        settings=json.dumps(settings),
        versions=json.dumps({}),
    )


def _run_row(run_id: str, rows: int, path: str, sha: str) -> dict:
    """The import's run: one cell, done as it starts."""
    started = R.now()
    return R.run_row(
        run_id,
        "done",
        started_at=started,
        finished_at=started,
        spec_name=f"import {Path(path).name}",
        spec_path=str(path),
        spec_sha256=sha,
        cells_total=1,
        cells_done=1,
        rows_written=rows,
    )


def import_kld_base(warehouse: str, path: str, model: str, log: Callable[[str], None] = print) -> dict:
    f = _read(path)
    wh = Warehouse(warehouse).require()
    sha = sha256_file(Path(path))  # chunked: a base file can be many GB
    cell_id = ids.imported_cell_id(model, ENGINE, sha)
    with wh.lock():
        wh.migrate(log)
        cells = wh.read_all("cells")
        if any(c["cell_id"] == cell_id for c in cells):
            log(f"{path} is already imported as {cell_id}")
            return {"cell_id": cell_id, "imported": False}
        vocab = _model_vocab(wh, cells, model, path, f["n_vocab"])
        run_id = ids.run_id("import")
        writer, new_prompts, matched, floor = _write_shard(wh, f, run_id, cell_id, model, path, sha)
        for p in new_prompts:
            if not wh.has_rows("prompts", p["prompt_id"]):
                wh.write_rows("prompts", p["prompt_id"], [p])
        settings = _settings(f, sha, floor)
        wh.write_rows("cells", cell_id, [_cell_row(f, cell_id, run_id, model, vocab, writer.rows, path, sha, settings)])
        wh.write_rows("runs", run_id, [_run_row(run_id, writer.rows, path, sha)])
    log(
        f"imported {path} as {cell_id}: {f['n_chunk']} chunk(s), {writer.rows} rows ({matched} chunk(s) matched "
        f"warehouse prompts). LOSSY format: uint16 log-probs (step <= {settings['step_nats_max']:.2e} nats), "
        f"clamped 16 nats below the top; estimated KL floor {floor:.2e}. The file carries no model or tokenizer "
        f"hash: only n_vocab ({f['n_vocab']}) was checked against {model}."
    )
    return {
        "cell_id": cell_id,
        "imported": True,
        "rows": writer.rows,
        "chunks": f["n_chunk"],
        "matched_prompts": matched,
        "storage_floor": floor,
        "lossy": True,
    }
