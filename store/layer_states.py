"""The `layer_states` shards: a `layers:` cell's hidden states, one shard per (cell, repeat) beside its
logits shard, a row group per prompt. Written by ShardWriter(table="layer_states") on a node that
sees the warehouse, or sent encoded to the driver's depot (actors/depot.py) by one that does not."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from store.schema import LAYER_STATES
from store.values import ZSTD_LEVEL, logits_matrix, native_dtype_of, native_values, row_hash, widen

VALUES_LEAF = "values.list.element"  # byte-stream-split needs the leaf path


def state_index(name: str, depth: int) -> int:
    """layer.N -> N; the final norm's output comes after every layer: depth."""
    return depth if name == "final_norm" else int(name.split(".", 1)[1])


def layer_rows_table(
    run_id: str,
    cell_id: str,
    repeat: int,
    prompt_id: str,
    positions: list[int],
    states: dict[str, np.ndarray],
    depth: int,
    sources: dict[str, str],
) -> pa.Table:
    """One prompt's states as a LAYER_STATES table, layer-major (shallowest first).
    states: {"layer.N" | "final_norm": (rows, hidden) native}; sources: the engine's tensor names."""
    names = sorted(states, key=lambda s: state_index(s, depth))
    n = len(positions)
    blocks = [states[s] for s in names]  # each (rows, hidden)
    for s, b in zip(names, blocks):
        if b.shape[0] != n:
            raise ValueError(f"{cell_id}: state {s} has {b.shape[0]} rows for {n} positions")
    native = np.concatenate(blocks) if blocks else np.zeros((0, 0), np.float32)  # (layers * rows, hidden)
    hidden, total = native.shape[1], native.shape[0]
    values = pa.array(widen(native).reshape(-1), type=pa.float32())
    offsets = pa.array(np.arange(0, (total + 1) * hidden, hidden, dtype=np.int32))
    layer = [s for s in names for _ in range(n)]
    return pa.table(
        {
            "run_id": pa.array([run_id] * total),
            "cell_id": pa.array([cell_id] * total),
            "prompt_id": pa.array([prompt_id] * total),
            "position": pa.array(list(positions) * len(names), pa.int32()),
            "repeat": pa.array([repeat] * total, pa.int32()),
            "layer": pa.array(layer),
            "layer_index": pa.array([state_index(s, depth) for s in layer], pa.int32()),
            "source": pa.array([sources.get(s, s) for s in layer]),
            "dtype": pa.array([native_dtype_of(native)] * total),
            "values": pa.ListArray.from_arrays(offsets, values),
            "row_hash": pa.array([row_hash(native[i]) for i in range(total)]),
        },
        schema=LAYER_STATES,
    )


def layer_writer(where) -> pq.ParquetWriter:
    return pq.ParquetWriter(
        where,
        LAYER_STATES,
        compression="zstd",
        compression_level=ZSTD_LEVEL,
        use_dictionary=["run_id", "cell_id", "prompt_id", "layer", "source", "dtype"],
        use_byte_stream_split=[VALUES_LEAF],
        write_statistics=["position", "repeat", "layer_index"],
        write_page_checksum=True,
    )


def native_states(rows: pa.Table) -> np.ndarray:
    """A LAYER_STATES table's values back in their native dtype: (rows, hidden)."""
    return native_values(rows, "values", "dtype")


def check_rows(rows: pa.Table, what: str) -> None:
    """Every row's values match its row_hash (rows that crossed a network)."""
    native = native_states(rows)
    for i, h in enumerate(rows.column("row_hash").to_pylist()):
        if row_hash(native[i]) != h:
            raise ValueError(f"{what}: layer row {i} does not match its row_hash")


def states_by_layer(rows: pa.Table) -> dict[str, tuple[list[tuple[str, int]], np.ndarray, int]]:
    """{layer: ([(prompt_id, position)], (rows, hidden) float32, layer_index)} of a shard's rows."""
    out = {}
    layer = np.array(rows.column("layer").to_pylist())
    prompt, pos = rows.column("prompt_id").to_pylist(), rows.column("position").to_pylist()
    index = rows.column("layer_index").to_pylist()
    values = logits_matrix(rows.column("values"))  # (rows, hidden) float32, exact widening
    for name in dict.fromkeys(layer.tolist()):
        idx = np.flatnonzero(layer == name)
        out[name] = ([(prompt[i], int(pos[i])) for i in idx], values[idx], int(index[idx[0]]))
    return out
