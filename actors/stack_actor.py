"""What hosts one loaded stack: a Ray actor (actors/ray_actor.py) or a worker process of the local
executor (actors/local_host.py) holds one StackHost and runs its calls in order. Under `hosts:
shared` it then serves the next stacks of the same weights, in turn (switch()).

Full-vocab float arrays never travel as Python objects. A node that sees the warehouse
directory writes its Parquet shard itself; one that does not (another computer) sends each
prompt's row group to the driver's depot, already encoded (actors/depot.py). Either way the
call returns a small manifest (path, row count, times, where the rows went). This module never
imports ray: the Ray actor subclasses StackHost for the facts only Ray knows (node id, GPUs).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import extras
from actors.capture import capture_shard, feed, limit
from actors.fingerprint import fingerprint
from backends import backend_class
from common.positions import Positions
from common.stack import ModelCopy, StackDesc
from store.warehouse import ShardWriter, Warehouse


@dataclass(frozen=True)
class Delivery:
    """Where a cell's rows go: the driver's warehouse directory, the nonce this run wrote there
    (a node that reads it back sees that directory), and the driver's depot for the others."""

    warehouse: str
    nonce: str
    depot: Any  # None under the local executor: every row is written here


class StackHost:
    def __init__(self, stack: StackDesc, model: ModelCopy, threads: int, delivery: Delivery):
        extras.require(stack)  # an outside extra the cell asks for is installed on this node too
        self.cls = backend_class(stack.engine)
        if self.cls is None:
            raise RuntimeError(f"no backend for engine {stack.engine!r} on node {socket.gethostname()}")
        self.backend = None  # made in load(), once the weights are on this node
        self.stack, self.model, self.threads, self.delivery = stack, model, threads, delivery
        self.direct = False  # whether this node writes shards into the warehouse itself
        self.rank = 0
        self._load_outcome: Exception | bool = False  # False: not loaded; True: loaded; else load's error
        # the loaded weights: how they reached this node, the cell whose load() put them here, its build
        self.weights: dict[str, Any] | None = None
        self.warmup = None  # actors.inline_metrics.Warmup, when this cell measures its rows in the actor

    def _loaded(self) -> None:
        """Ray runs an actor's queued calls even after an earlier one raised. Every call after a
        failed load raises the load's own exception, so the driver gets one outcome for the cell
        whichever of its futures it takes first."""
        if isinstance(self._load_outcome, Exception):
            raise self._load_outcome
        if self._load_outcome is not True:
            raise RuntimeError(f"{self.stack.cell_id}: called before load()")

    # -- what the host knows of its node (the Ray actor asks Ray) ---------------------------
    def node_id(self) -> str:
        return "local:" + socket.gethostname()

    def node_ip(self) -> str:
        return "127.0.0.1"

    def gpu_ids(self) -> list[str]:
        """The GPUs this host was given (physical ids on its node): CUDA_VISIBLE_DEVICES."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return [g for g in visible.split(",") if g.strip()]

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port for torch.distributed's TCP store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return self.node_ip(), port

    def warm_metrics(self, vocab: int) -> None:
        """Start loading the metric kernel for `reference_metrics: in_actor` (queued before load,
        so the two overlap); returns at once."""
        from actors.inline_metrics import Warmup

        self.warmup = Warmup(vocab)

    def load(
        self, dist: dict[str, Any] | None = None, rendezvous: tuple[str, int] | None = None, *node_gpus: list[str]
    ) -> dict[str, Any]:
        """dist: {rank, world_size} for one rank of a tp > 1 cell; rendezvous: rank 0's (address, port);
        node_gpus: every rank's gpu_ids(), in rank order (object refs, resolved by Ray)."""
        try:
            out = self._load(dist, rendezvous, node_gpus)
        except Exception as e:
            self._load_outcome = e
            raise
        self._load_outcome = True
        return out

    def _load(
        self, dist: dict[str, Any] | None, rendezvous: tuple[str, int] | None, node_gpus: tuple[list[str], ...]
    ) -> dict[str, Any]:
        from actors.model_copy import artifact_file, model_dir, source_gguf

        t0 = time.perf_counter()
        built = self._planned_build()
        if dist is not None:
            dist = self._rank_dist(dist, rendezvous, node_gpus)
        node = f"{socket.gethostname()} ({self.node_id()[:12]})"
        local_dir, model_via = model_dir(self.model, self.delivery.depot, node)
        stack = self.stack.replace(
            source_gguf=source_gguf(self.model, self.delivery.depot),
            artifact=artifact_file(self.stack.artifact, self.stack.artifact_sha256, self.delivery.depot),
        )
        self.backend = self.cls(stack, local_dir, self.threads)
        self.backend.dist = dist
        self.rank = dist["rank"] if dist else 0
        # no depot: a local executor's host, which writes the warehouse itself (_writer checks that
        # it can); it may load before the driver has written this run's probe (matrix/run/early.py)
        self.direct = self.delivery.depot is None or Warehouse.reaches(self.delivery.warehouse, self.delivery.nonce)
        self.backend.load()
        self.weights = {"model_via": model_via, "loaded_by": None, "built": built, "load_seconds": None}
        out = self._answer(t0)
        self.weights.update(loaded_by=self.stack.cell_id, load_seconds=out["load_seconds"])
        return out

    def switch(self, stack: StackDesc) -> dict[str, Any]:
        """The next cell of the weights this host holds (Backend.weights_key), in turn after the
        last one: the loaded engine taken over (Backend.switch), or loaded afresh where it cannot
        be; answers as load() does, with `loaded_by`: the cell whose load put the weights here."""
        extras.require(stack)
        self.stack, self._load_outcome = stack, False
        try:
            t0 = time.perf_counter()
            held = self.backend is not None and self.weights is not None
            if held and self.backend.switch(self._on_node(stack)):
                out = self._answer(t0)
            else:
                self.close()
                self.backend = self.weights = None
                out = self._load(None, None, ())
        except Exception as e:
            self._load_outcome = e
            raise
        self._load_outcome = True
        return out

    def _on_node(self, stack: StackDesc) -> StackDesc:
        """stack with this node's copies of the files the loaded stack was built from (the same
        weights_key: the same files)."""
        here = self.backend.stack
        return stack.replace(source_gguf=here.source_gguf, artifact=here.artifact)

    def _answer(self, t0: float) -> dict[str, Any]:
        """What load() and switch() answer: the stack's settings as the engine runs it now, where
        its weights came from, and this host's facts."""
        settings = self.backend.settings()
        for x, v in extras.of(self.stack):  # what an extra's hook records of the engine's rule
            settings.update(x.settings(self.backend, v))
        w = self.weights
        return {
            "settings": settings,
            "versions": settings.pop("versions", {}),
            "artifact": settings.pop("artifact", None),
            "vocab_size": self.backend.vocab_size(),
            "load_seconds": time.perf_counter() - t0,
            "loaded_by": w["loaded_by"],
            "host": socket.gethostname(),
            "node_id": self.node_id(),
            "fingerprint": fingerprint(),
            "model_via": w["model_via"],
            "rows_via": "node" if self.direct else "driver",
            "build": w["built"]["build"],
            "build_libraries": w["built"]["libraries"],
            "pid": os.getpid(),
        }

    def _planned_build(self) -> dict[str, Any]:
        """This node's engine build (common/builds.py engine_build); an error where it is not the
        build the run planned the cell for (the engine was reinstalled since the probe)."""
        from common.builds import describe, engine_build

        built = engine_build(self.cls.libraries)
        if self.stack.build and built["build"] != self.stack.build:  # reinstalled since the probe
            raise RuntimeError(
                f"{self.stack.cell_id}: node {socket.gethostname()} now has {self.stack.engine} "
                f"build {built['build']} ({describe(built['libraries'])}), not the build "
                f"{self.stack.build} the run planned for; run again to capture it as a new cell"
            )
        return built

    def _rank_dist(
        self, dist: dict[str, Any], rendezvous: tuple[str, int], node_gpus: tuple[list[str], ...]
    ) -> dict[str, Any]:
        """A tensor-parallel rank's process group settings: where the ranks meet, its own GPUs and
        every rank's (backends/hf_backend.py shared_devices)."""
        return {
            **dist,
            "master_addr": rendezvous[0],
            "master_port": rendezvous[1],
            "own_gpus": self.gpu_ids(),
            "node_gpus": [list(g) for g in node_gpus],
        }

    def fixture(self, prompts: list, topk_ids, topk_logits, lse, vocab: int) -> dict[str, Any]:
        """`matrix fixture check` on this node: the stack's rows measured against the fixture's
        top-k rows here (actors/fixture_measure.py); only per-row metrics go back."""
        from actors.fixture_measure import measure

        self._loaded()
        return measure(self.backend, prompts, topk_ids, topk_logits, lse, vocab)

    def parity(
        self, prompts: list[tuple[str, str, list[int]]], reference: dict[str, Any], ref_vocab: int
    ) -> dict[str, Any]:
        """Encode each text with the engine's own tokenizer and compare with the canonical ids."""
        from actors.parity import diagnose, special_token_problems

        self._loaded()
        special = self.backend.special_tokens()
        rows = []
        checkable = [p for p in prompts if p[1] is not None]  # ids and chunk prompts have no text to re-tokenise
        if not checkable:
            return {"status": "not_checked", "rows": [], "special": special, "problems": []}
        for prompt_id, text, canonical in checkable:
            ids = self.backend.tokenize(text)
            if ids is None:
                return {"status": "not_checked", "rows": [], "special": special, "problems": []}
            v = diagnose(canonical, ids, reference.get("bos"), ref_vocab)
            rows.append(
                {
                    "prompt_id": prompt_id,
                    "match": v.match,
                    "first_diff": v.first_diff,
                    "diagnosis": v.diagnosis,
                    "n_canonical": len(canonical),
                    "n_engine": len(ids),
                    "engine_ids_head": ids[:16],
                    "checked_with": f"{self.stack.engine} tokenizer, engine defaults",
                }
            )
        problems = special_token_problems(reference, special)
        ok = all(r["match"] for r in rows) and not problems
        return {"status": "ok" if ok else "mismatch", "rows": rows, "special": special, "problems": problems}

    def capture(
        self,
        run_id: str,
        repeat: int,
        prompts: list[tuple[str, list[int]]],
        keep: Positions,
        store: str = "native",
        metrics_ref: str | None = None,
        values: bool = True,
    ) -> dict[str, Any]:
        """One teacher-forced prefill per prompt; the shard is written here, not returned.

        Under tensor parallelism every rank runs the same forwards (they are collective); only
        rank 0 writes rows. metrics_ref: the reference cell whose repeat 0 this node reads from the
        warehouse, to measure each prompt's rows against as they come out (the metrics rows,
        small, come back in the manifest). values=False (keep_rows: references): the shard keeps
        each row's hash, not its values, so the measurement here is the only one: its failure
        fails the capture. A node whose rows go through the driver cannot read the reference, so
        it keeps the values whatever it is asked, for `matrix analyze` to measure."""
        self._loaded()
        if self.rank > 0:
            return self._follow(prompts, keep)
        cid = self.stack.cell_id
        values = values or not self.direct  # a node that cannot read the warehouse measures nothing: analyze will
        metrics = self._metrics(metrics_ref, repeat, required=not values)
        writer = self._writer(run_id, repeat, "logits", values)
        tables = dict.fromkeys(x.table for x, _ in extras.of(self.stack) if x.table)
        side = {t: self._writer(run_id, repeat, t) for t in tables}
        out = capture_shard(
            self.backend,
            writer,
            prompts,
            keep,
            self.stack.max_tokens,
            store,
            None if metrics is None else metrics.observe,
            side,
        )
        return {
            **out,
            "cell_id": cid,
            "repeat": repeat,
            "rows_via": "node" if self.direct else "driver",
            "bytes_sent": 0 if self.direct else sum(w.bytes for w in (writer, *side.values())),
            "metrics": None if metrics is None else metrics.outcome(),
        }

    def _follow(self, prompts: list[tuple[str, list[int]]], keep: Positions) -> dict[str, Any]:
        """A rank after the first under tensor parallelism: the same forwards as rank 0 (they are
        collective), its extras' too, and no rows written."""
        side = [c for x, v in extras.of(self.stack) if (c := x.capturer(self.backend, v, None)) is not None]
        for _, ids in prompts:
            fed, positions = keep.fed(ids, self.stack.max_tokens)
            if not positions:
                continue
            # the lengths rank 0 feeds: a kernel refuses a length on every rank alike (same shapes)
            forward = partial(self.backend.forward, positions=positions)  # forward(fed) -> rows
            got = feed(forward, ids, len(fed), limit(ids, self.stack.max_tokens))
            for c in side if got.rows is not None else ():  # collective too: every rank joins what rank 0 runs
                c.other_rank(ids[: got.tokens], positions)
        return {"rows": 0, "rank": self.rank}

    def _writer(self, run_id: str, repeat: int, table: str, values: bool = True):
        """Where a shard of this capture goes: the warehouse itself, or the driver's depot (Ray only)."""
        cid = self.stack.cell_id
        if self.delivery.depot is None and not Warehouse.reaches(self.delivery.warehouse, self.delivery.nonce):
            raise RuntimeError(f"{cid}: this host cannot reach the warehouse {self.delivery.warehouse}")
        if self.direct:
            return ShardWriter(self.delivery.warehouse, run_id, cid, repeat, table, values)
        from actors.depot import RemoteShard

        return RemoteShard(self.delivery.depot, run_id, cid, repeat, table)

    def _metrics(self, ref_id: str | None, repeat: int, required: bool = False):
        from actors.inline_metrics import InlineMetrics

        if ref_id is None or (ref_id == self.stack.cell_id and repeat == 0):  # the yardstick itself
            if required:
                raise RuntimeError(
                    f"{self.stack.cell_id}: keep_rows: references keeps no values of rows that "
                    "are not measured where they are captured"
                )
            return None
        return InlineMetrics(
            self.delivery.warehouse if self.direct else None, ref_id, self.stack.cell_id, repeat, self.warmup, required
        )

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
