"""The reference-output fixture file: one captured
cell's rows as top-k ids and raw logits plus the full row's logsumexp, with a header that says
where they came from. JSON (readable) or Parquet (dense, header in the schema metadata).

Each row carries a sha256 over (top-k ids as int32, their logits as float32, logsumexp as
float64), and the header (prompts, ids, k, vocabulary, producer) a sha256 of its canonical JSON
(version 2), so a changed or damaged row or header is refused on load.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError

FORMAT = "logit-matrix-fixture"
VERSION = 2  # 2: header_sha256. A version-1 file (no header checksum) still loads, marked unchecked
READABLE = (1, 2)
META_KEY = b"logit_matrix_fixture"
ROW_KEYS = ("prompt_id", "position", "next_token_id", "topk_ids", "topk_logits", "logsumexp", "row_hash", "checksum")
SUFFIXES = (".json", ".parquet")


def checksum(ids: list[int], logits: list[float], lse: float) -> str:
    payload = (
        np.asarray(ids, dtype=np.int32).tobytes()
        + np.asarray(logits, dtype=np.float32).tobytes()
        + np.float64(lse).tobytes()
    )
    return hashlib.sha256(payload).hexdigest()


def header_checksum(header: dict) -> str:
    """sha256 of the header's canonical JSON, without its own header_sha256."""
    body = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def write(out: str, header: dict, rows: dict[str, list]) -> None:
    """rows: every ROW_KEYS column but checksum, which is computed here."""
    rows = {
        **rows,
        "checksum": [checksum(i, v, s) for i, v, s in zip(rows["topk_ids"], rows["topk_logits"], rows["logsumexp"])],
    }
    header = json.loads(json.dumps({"format": FORMAT, "version": VERSION, **header}, default=str))  # as it reads back
    header["header_sha256"] = header_checksum(header)
    if Path(out).suffix == ".json":
        body = {**header, "rows": [dict(zip(rows, vals)) for vals in zip(*rows.values())]}
        Path(out).write_text(json.dumps(body, indent=1))
        return
    table = pa.table(
        {
            "prompt_id": rows["prompt_id"],
            "position": pa.array(rows["position"], pa.int32()),
            "next_token_id": pa.array(rows["next_token_id"], pa.int32()),
            "topk_ids": pa.array(rows["topk_ids"], pa.list_(pa.int32())),
            "topk_logits": pa.array(rows["topk_logits"], pa.list_(pa.float32())),
            "logsumexp": pa.array(rows["logsumexp"], pa.float64()),
            "row_hash": rows["row_hash"],
            "checksum": rows["checksum"],
        }
    )
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(header).encode()}), out, compression="zstd")


def _read(p: Path) -> tuple[dict, dict[str, list]]:
    if p.suffix == ".parquet":
        t = pq.read_table(p)
        meta = (t.schema.metadata or {}).get(META_KEY)
        if meta is None:
            raise UserError(f"{p}: not a logit-matrix fixture (no {META_KEY.decode()} metadata)")
        return json.loads(meta), {c: t.column(c).to_pylist() for c in t.column_names}
    body = json.loads(p.read_text())
    if not isinstance(body, dict) or not isinstance(body.get("rows"), list):
        raise UserError(f"{p}: not a logit-matrix fixture (no rows)")
    header = {k: v for k, v in body.items() if k != "rows"}
    return header, {k: [r.get(k) for r in body["rows"]] for k in ROW_KEYS}


def load(path: str) -> tuple[dict, dict[str, list]]:
    """-> (header, columns); a missing, foreign, other-version or altered file is a UserError."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: fixture not found")
    try:
        header, rows = _read(p)
    except (json.JSONDecodeError, pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise UserError(f"{p}: not a readable fixture ({str(e).splitlines()[0][:120]})") from None
    if header.get("format") != FORMAT or header.get("version") not in READABLE:
        raise UserError(
            f"{p}: format {header.get('format')!r} version {header.get('version')!r}; "
            f"expected {FORMAT!r} version {' or '.join(map(str, READABLE))}"
        )
    if header["version"] >= 2 and header.get("header_sha256") != header_checksum(header):
        raise UserError(
            f"{p}: header_sha256: the header (prompts, ids, k, vocabulary, producer) does not match its "
            "checksum: the fixture was altered or damaged"
        )
    header["header_checked"] = header["version"] >= 2
    for i, (ids, vals, lse, ck) in enumerate(
        zip(rows["topk_ids"], rows["topk_logits"], rows["logsumexp"], rows["checksum"])
    ):
        if checksum(ids, vals, lse) != ck:
            raise UserError(
                f"{p}: row {i} (prompt {rows['prompt_id'][i]} position {rows['position'][i]}) "
                "fails its checksum: the fixture was altered or damaged"
            )
    return header, rows
