"""Token-id corpora read from files: .npy, .parquet, or a llama.cpp `--kl-divergence-base` file.

.npy      int array: 1-D is one prompt, 2-D (prompts, tokens) one prompt per row
.parquet  a `token_ids` column of int lists (and an optional `name` column), one prompt per row
base file llama-perplexity's chunks (tokens as it stores them: before BOS takes each chunk's start)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from common.errors import UserError
from store import llamacpp_kld as K


def _check(path: Path, rows: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    for name, ids in rows:
        if not ids:
            raise UserError(f"{path}: prompt {name}: no token ids")
        bad = next((v for v in ids if v < 0), None)
        if bad is not None:
            raise UserError(f"{path}: prompt {name}: token id {bad} is negative")
    return rows


def read_ids_file(path: Path) -> tuple[str, list[tuple[str, list[int]]]]:
    """-> (kind: npy | parquet | kld-base, [(name, ids), ...]); names are row numbers unless given."""
    if not path.is_file():
        raise UserError(f"{path}: ids file not found")
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic == K.MAGIC:
        try:
            base = K.read(path)
        except K.FormatError as e:
            raise UserError(str(e)) from None
        return "kld-base", _check(
            path, [(f"chunk{c}", [int(v) for v in base["tokens"][c]]) for c in range(base["n_chunk"])]
        )
    if path.suffix == ".npy":
        try:
            a = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise UserError(f"{path}: not a readable .npy file ({e})") from None
        if a.dtype.kind not in "iu" or a.ndim not in (1, 2):
            raise UserError(f"{path}: token ids must be a 1-D or 2-D integer array (got {a.dtype}, {a.ndim}-D)")
        a = a[None] if a.ndim == 1 else a
        return "npy", _check(path, [(str(i), [int(v) for v in row]) for i, row in enumerate(a)])
    if path.suffix == ".parquet":
        try:
            t = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - named in one line: a bad input file
            raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        if "token_ids" not in t.column_names:
            raise UserError(f"{path}: token_ids: no such column (columns: {', '.join(t.column_names)})")
        ids = t.column("token_ids").to_pylist()
        names = t.column("name").to_pylist() if "name" in t.column_names else [str(i) for i in range(len(ids))]
        if any(not isinstance(r, list) or not all(isinstance(v, int) for v in r) for r in ids):
            raise UserError(f"{path}: token_ids: must be lists of integers")
        return "parquet", _check(path, [(str(n), r) for n, r in zip(names, ids)])
    raise UserError(f"{path}: ids_file: expected a .npy, a .parquet or a llama.cpp kl-divergence-base file")
