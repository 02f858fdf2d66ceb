"""The driver's end of a sweep on machines that share no disk.

`DriverDepot` is a Ray actor pinned to the driver's node. It writes the shards of actors whose
node cannot see the warehouse directory (they send each prompt's row group already encoded, as
Parquet bytes, never float arrays), and it serves the reference weights to nodes that do not
have them. `RemoteShard` is the actor-side writer that talks to it, with one row group in
flight: the next chunk's encoding (or the next prompt's forward) overlaps the last one's
write, and the depot's memory stays at one chunk per capture however many rows a sweep makes.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import ray

from common.files import sha256_file
from store.prompt_rows import PromptRows
from store.warehouse import ShardWriter, encode_rows, rows_table

CHUNK = 8 << 20  # bytes per read() of a model file
MESSAGE_BYTES = 16 << 20  # native logit bytes per row group a node sends to the depot


@ray.remote
class DriverDepot:
    def __init__(self, warehouse: str):
        self.warehouse = warehouse
        self.open: dict[tuple[str, int], ShardWriter] = {}
        self.manifests: dict[str, dict[str, list]] = {}
        self.lock = threading.Lock()  # a threaded actor: calls of different captures run at once
        self.received = 0  # encoded bytes written for other nodes

    # -- shards of nodes that cannot see the warehouse ---------------------------------
    # table: "logits", or "layer_states" for a `layers:` cell's second shard
    def begin(self, run_id: str, cell_id: str, repeat: int, table: str = "logits") -> None:
        with self.lock:
            stale = self.open.pop((table, cell_id, repeat), None)  # a capture whose actor died midway
            self.open[(table, cell_id, repeat)] = ShardWriter(self.warehouse, run_id, cell_id, repeat, table)
        if stale is not None:
            stale.abort()

    def add(self, cell_id: str, repeat: int, data: bytes, table: str = "logits") -> int:
        rows = self.open[(table, cell_id, repeat)].add_encoded(data)
        with self.lock:
            self.received += len(data)
        return rows

    def commit(self, cell_id: str, repeat: int, table: str = "logits", refused: dict | None = None) -> str:
        with self.lock:
            writer = self.open.pop((table, cell_id, repeat))
        return str(writer.commit(refused))

    def abort(self, cell_id: str, repeat: int, table: str = "logits") -> None:
        with self.lock:
            writer = self.open.pop((table, cell_id, repeat), None)
        if writer is not None:
            writer.abort()

    def stats(self) -> dict[str, int]:
        return {"bytes_received": self.received, "open_shards": len(self.open), "pid": os.getpid()}

    # -- reference weights for nodes that do not have them --------------------------------
    def manifest(self, path: str) -> dict[str, list]:
        """{relative file: [size, sha256]} of a model directory, or of one file (key: its name)."""
        with self.lock:
            if path not in self.manifests:
                p = Path(path)
                files = [f for f in sorted(p.rglob("*")) if f.is_file()] if p.is_dir() else [p]
                base = p if p.is_dir() else p.parent
                self.manifests[path] = {
                    str(f.relative_to(base)): [f.stat().st_size, sha256_file(f)]
                    for f in files
                    if not f.name.startswith(".")
                }
            return self.manifests[path]

    def read(self, path: str, rel: str, offset: int, size: int) -> bytes:
        if rel not in self.manifest(path):  # only files the manifest lists: no path escapes
            raise KeyError(f"{rel} is not part of {path}")
        p = Path(path)
        with open((p if p.is_dir() else p.parent) / rel, "rb") as f:
            f.seek(offset)
            return f.read(min(size, CHUNK))


class RemoteShard:
    """ShardWriter's interface, for a node that cannot see the warehouse: rows go to the depot."""

    def __init__(self, depot, run_id: str, cell_id: str, repeat: int, table: str = "logits"):
        self.depot, self.run_id, self.cell_id, self.repeat, self.table = depot, run_id, cell_id, repeat, table
        self.rows = 0
        self.bytes = 0
        self.pending = None
        ray.get(depot.begin.remote(run_id, cell_id, repeat, table))

    def add(self, rows: PromptRows) -> None:
        """Sent in chunks of at most MESSAGE_BYTES of values, so this node encodes the next chunk
        while the depot writes the last (two cores at work, not one), and a long prompt never has
        to fit in one message."""
        native = rows.native
        per = max(1, MESSAGE_BYTES // max(1, native.shape[1] * native.itemsize))  # rows per message
        for lo in range(0, native.shape[0], per):
            self._send(encode_rows(rows_table(self.run_id, self.cell_id, self.repeat, rows.part(lo, lo + per))))
        self.rows += native.shape[0]

    def add_blocks(self, prompt_id: str, positions: list[int], next_ids: list, blocks) -> None:
        """A streamed prompt (ShardWriter.add_blocks): each block sent as add() sends rows, before
        the next block is asked for."""
        at = 0
        for native, shift in blocks:  # (block rows, vocab), (block rows,) or None
            self.add(
                PromptRows(prompt_id, positions[at : at + len(native)], next_ids[at : at + len(native)], native, shift)
            )
            at += len(native)

    def add_layers(
        self, prompt_id: str, positions: list[int], states: dict[str, np.ndarray], depth: int, sources: dict[str, str]
    ) -> None:
        """A layer_states shard's prompt, in chunks of at most MESSAGE_BYTES like add()."""
        from store.layer_states import layer_rows_table

        rows = layer_rows_table(self.run_id, self.cell_id, self.repeat, prompt_id, positions, states, depth, sources)
        per = max(1, MESSAGE_BYTES // max(1, rows.nbytes // max(1, rows.num_rows)))  # rows per message
        for lo in range(0, rows.num_rows, per):
            self._send(encode_rows(rows.slice(lo, per), self.table))
        self.rows += rows.num_rows

    def _send(self, data: bytes) -> None:
        self._settle()  # back-pressure: the previous chunk is written before this one goes
        self.pending = self.depot.add.remote(self.cell_id, self.repeat, data, self.table)
        self.bytes += len(data)

    def _settle(self) -> None:
        if self.pending is not None:
            ray.get(self.pending)
            self.pending = None

    def commit(self, refused: dict | None = None) -> str:
        self._settle()
        return ray.get(self.depot.commit.remote(self.cell_id, self.repeat, self.table, refused))

    def abort(self) -> None:
        # The capture is already failing with its own exception; the depot drops the temp file
        # (or the next run sweeps it). Nothing waits on this call.
        self.depot.abort.remote(self.cell_id, self.repeat, self.table)


def fetch_file(depot, path: str, rel: str, size: int, sha256: str, dest: Path) -> None:
    """One file of the driver's into dest, checked against the driver's sha256."""
    h = hashlib.sha256()
    with open(dest, "wb") as f:
        offset, nxt = 0, depot.read.remote(path, rel, 0, CHUNK) if size else None
        while offset < size:
            block = ray.get(nxt)
            offset += len(block)
            nxt = depot.read.remote(path, rel, offset, CHUNK) if offset < size else None  # next one in flight
            f.write(block)
            h.update(block)
    if h.hexdigest() != sha256:
        raise OSError(f"{rel}: received sha256 {h.hexdigest()}, the driver's is {sha256}")


def depot_options(node_id: str) -> dict[str, Any]:
    """On the driver's node, taking no CPU from the cells, several captures at once."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {
        "num_cpus": 0,
        "max_concurrency": 16,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
