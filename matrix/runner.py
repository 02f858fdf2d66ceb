"""`matrix run`: place one actor per cell on a Ray cluster, collect manifests, record cells.

The caller (the CLI) owns the Ray connection: this module expects `ray` to be
initialised and never shuts it down.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

from matrix import __version__
from matrix.corpus import Prompt, tokenize
from backends import backend_class
from backends.base import SkipCell
from matrix.errors import UserError
from matrix import placement
from matrix.models import ResolvedModel, fetch, sha256_file
from matrix.spec import Cell, Spec
from store import SCHEMA_VERSION, Warehouse


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "logit-matrix": __version__}
    for dist in ("numpy", "pyarrow", "duckdb", "ray", "pyyaml", "torch", "transformers",
                 "accelerate", "safetensors", "gguf", "tokenizers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


@dataclass
class Plan:
    spec: Spec
    models: dict[str, ResolvedModel]
    prompts: dict[str, list[Prompt]]  # model -> prompts
    todo: dict[str, list[int]] = field(default_factory=dict)  # cell_id -> repeats to capture
    complete: list[str] = field(default_factory=list)
    special: dict[str, dict] = field(default_factory=dict)  # model -> reference bos/eos ids
    vocab: dict[str, int] = field(default_factory=dict)  # model -> reference vocab size (logits per row)


def prepare(spec: Spec, wh: Warehouse, log: Callable[[str], None]) -> Plan:
    """Resolve models, tokenise once per model, and work out what is left to do."""
    import transformers

    models, prompts, special, vocab = {}, {}, {}, {}
    for name, ref in spec.models.items():
        models[name] = m = fetch(ref, log=log)
        tok = transformers.AutoTokenizer.from_pretrained(m.hf_dir)
        config = transformers.AutoConfig.from_pretrained(m.hf_dir)
        vocab[name] = int(getattr(config, "vocab_size", 0) or 0) or len(tok)
        if len(tok) > vocab[name]:
            raise UserError(f"{m.hf_dir}: the tokenizer has {len(tok)} tokens but the model has "
                            f"vocab_size {vocab[name]}: tokenizer and model do not match")
        special[name] = {"bos": tok.bos_token_id, "eos": tok.eos_token_id}
        tok_file = os.path.join(m.hf_dir, "tokenizer.json")
        tok_sha = sha256_file(tok_file) if os.path.isfile(tok_file) else None
        prompts[name] = tokenize(spec.corpus, name, tok, spec.bos, tok_sha)
    plan = Plan(spec, models, prompts, special=special, vocab=vocab)
    find_todo(plan, wh)
    return plan


def find_todo(plan: Plan, wh: Warehouse) -> None:
    """Which (cell, repeat) captures are missing. Re-checked under the writer lock."""
    spec = plan.spec
    plan.todo, plan.complete = {}, []
    exists = wh.check()
    for cell in spec.cells:
        done = wh.completed_repeats(cell.cell_id) if exists else set()
        missing = [r for r in range(spec.repeats) if r not in done]
        row = wh.read_rows("cells", cell.cell_id) if exists else []
        if row and row[0]["status"] == "skipped":
            plan.complete.append(cell.cell_id)  # deterministic: building it again fails the same way
        elif not missing and row and row[0]["status"] == "done" and row[0]["repeats"] >= spec.repeats:
            plan.complete.append(cell.cell_id)
        else:
            plan.todo[cell.cell_id] = missing


def regroup_complete_cells(plan: Plan, wh: Warehouse, log: Callable[[str], None]) -> None:
    """Centroid grouping and calibration notes describe a cell without changing its arithmetic
    (they are not in the cell id): a spec that changes them re-labels captured cells instead
    of capturing them again."""
    cells = {c.cell_id: c for c in plan.spec.cells}
    changed = 0
    for cid in plan.complete:
        rows = wh.read_rows("cells", cid)
        want = {"centroid_group": cells[cid].centroid_group, "centroid": plan.spec.centroid,
                "calibration": cells[cid].calibration}
        if rows and any(rows[0].get(k) != v for k, v in want.items()):
            wh.write_rows("cells", cid, [{**rows[0], **want}])
            changed += 1
    if changed:
        log(f"centroid grouping / calibration changed: relabelled {changed} captured cell(s); "
            "run `matrix analyze` again")


def mark_interrupted_runs(wh: Warehouse, log: Callable[[str], None]) -> None:
    """Runs still 'running' while we hold the writer lock were killed: say so."""
    for f in wh.table_files("runs"):
        rows = pq.read_table(f).to_pylist()
        if rows and rows[0]["status"] == "running":
            rows[0].update(status="interrupted", error="the process ended before the run finished")
            wh.write_rows("runs", rows[0]["run_id"], rows)
            log(f"run {rows[0]['run_id']} was interrupted; resuming its work")


def cell_threads(cell: Cell, nodes: list[placement.Node]) -> int:
    """The spec's threads, else the smallest node's CPU count (live nodes; types when none is)."""
    if cell.threads:
        return cell.threads
    live = [n for n in nodes if n.node_type is None] or nodes
    cpus = [n.resources.get("CPU", 0) for n in live]
    return max(1, int(min(c for c in cpus if c > 0))) if any(cpus) else 1


def check_placement(cells: list[Cell], nodes: list[placement.Node], log: Callable[[str], None]) -> None:
    """Before anything is written: a cell no node (or node type) can host would wait forever."""
    unplaceable = {c.cell_id: p for c in cells
                   if (p := placement.problem(c.device, c.tp, cell_threads(c, nodes), nodes))}
    if unplaceable:
        cid, why = next(iter(unplaceable.items()))
        more = f" (and {len(unplaceable) - 1} more cell(s))" if len(unplaceable) > 1 else ""
        raise UserError(f"cannot place {cid}: {why}{more}; nodes: "
                        + ", ".join(f"{n.host or n.node_id[:8]} {_node_desc(n)}" for n in nodes))
    for c in cells:
        w = placement.where(c.device, c.tp, cell_threads(c, nodes), nodes)
        if w.startswith("autoscaler: "):
            log(f"{c.cell_id}: no live node can host it yet; it waits for the autoscaler to start {w[12:]}")


def _node_desc(n) -> str:
    dev = n.labels.get(placement.LABEL) or n.labels.get(placement.RAY_ACCEL) or "cpu"
    if n.node_type:
        dev = f"launchable, {dev}"
    return f"[{dev}, {int(n.resources.get('CPU', 0))} CPU, {int(n.resources.get('GPU', 0))} GPU]"


def _bit_reproducible(wh: Warehouse, cell_id: str, repeats: int) -> bool:
    hashes = [wh.shard_hashes(cell_id, r) for r in range(repeats)]
    return all(h == hashes[0] for h in hashes[1:])


def _skipped_row(plan: Plan, cell: Cell, run_id: str, reason: str) -> dict:
    model = plan.models[cell.model]
    return {**cell.axes(), "cell_id": cell.cell_id, "run_id": run_id, "status": "skipped",
            "skip_reason": reason, "repeats": 0, "stride": plan.spec.stride, "corpus": plan.spec.corpus,
            "options": json.dumps(cell.opts, sort_keys=True), "model_identity": model.identity,
            "model_source": model.source, "source_sha256": model.source_sha256,
            "weights_sha256": model.weights_sha256, "finished_at": now(),
            "centroid_group": cell.centroid_group, "centroid": plan.spec.centroid,
            "calibration": cell.calibration}


def _cell_row(plan: Plan, cell: Cell, run_id: str, loaded: dict, wh: Warehouse, capture_s: float,
              parity: dict | None) -> dict:
    spec, model = plan.spec, plan.models[cell.model]
    art = loaded.get("artifact") or {}
    first = pq.read_table(wh.shard_path(cell.cell_id, 0), columns=["logits_dtype"])
    rows = pq.read_metadata(wh.shard_path(cell.cell_id, 0)).num_rows
    ref = spec.reference_cells.get(cell.model)
    return {
        **cell.axes(), "cell_id": cell.cell_id, "run_id": run_id, "status": "done",
        "bit_reproducible": _bit_reproducible(wh, cell.cell_id, spec.repeats),
        "repeats": spec.repeats, "rows_per_repeat": rows, "n_prompts": len(plan.prompts[cell.model]),
        "stride": spec.stride, "threads": loaded["settings"].get("threads"), "corpus": spec.corpus,
        "bos_policy": spec.bos, "is_reference": ref == cell.cell_id, "reference_cell_id": ref,
        "model_identity": model.identity, "model_source": model.source,
        "source_sha256": model.source_sha256, "weights_sha256": model.weights_sha256,
        "vocab_size": plan.vocab[cell.model], "engine_vocab_size": loaded["vocab_size"],
        "logits_dtype": first.column(0)[0].as_py(),
        "artifact": art.get("path"), "artifact_sha256": art.get("sha256"),
        "artifact_recipe": json.dumps(art.get("recipe"), sort_keys=True) if art else None,
        "tokenizer_parity": parity["status"] if parity else "not_checked",
        "options": json.dumps(cell.opts, sort_keys=True), "max_tokens": cell.max_tokens,
        "centroid_group": cell.centroid_group, "centroid": spec.centroid, "calibration": cell.calibration,
        "settings": json.dumps(loaded["settings"], sort_keys=True),
        "fingerprint": json.dumps(loaded.get("fingerprint"), sort_keys=True, default=str),
        "versions": json.dumps(loaded["versions"], sort_keys=True),
        "host": loaded["host"], "node_id": loaded["node_id"], "load_seconds": loaded["load_seconds"],
        "capture_seconds": capture_s, "finished_at": now(),
    }


def execute(plan: Plan, wh: Warehouse, argv: list[str], address: str | None,
            log: Callable[[str], None], cluster_config: str | Path | None = None) -> dict:
    """Run every unfinished cell; returns a summary. Requires ray to be initialised."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.stack_actor import StackActor

    spec = plan.spec
    cells = {c.cell_id: c for c in spec.cells}
    todo = [cells[cid] for cid in plan.todo]
    # The reference first: every other number is measured against it.
    todo.sort(key=lambda c: c.cell_id not in spec.reference_cells.values())
    nodes = placement.known_nodes(placement.cluster_nodes(), cluster_config)
    if cluster_config:
        log(f"node types from {cluster_config}: " + ", ".join(n.node_type for n in nodes if n.node_type))
    check_placement(todo, nodes, log)

    wh.create()
    mark_interrupted_runs(wh, log)
    for p in wh.sweep_tmp():
        log(f"removed a partial file left by an interrupted run: {p.relative_to(wh.root)}")
    for plist in plan.prompts.values():
        for p in plist:
            if not wh.has_rows("prompts", p.prompt_id):
                wh.write_rows("prompts", p.prompt_id, [{**p.to_row(), "n_tokens": len(p.token_ids)}])

    run_id = now().strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    run = {"run_id": run_id, "status": "running", "started_at": now(), "finished_at": None,
           "spec_name": spec.name, "spec_path": str(spec.path), "spec_sha256": spec.sha256,
           "spec_yaml": spec.raw_text, "argv": json.dumps(argv), "host": socket.gethostname(),
           "pid": os.getpid(), "ray_address": address or "local", "logit_matrix_version": __version__,
           "schema_version": SCHEMA_VERSION, "versions": json.dumps(library_versions(), sort_keys=True),
           "cells_total": len(spec.cells), "cells_done": len(plan.complete), "rows_written": 0, "error": None}
    wh.write_rows("runs", run_id, [run])

    units_total = sum(len(plan.todo[c.cell_id]) for c in todo)
    units_done, rows, t0 = 0, 0, time.perf_counter()
    cells_done = len(plan.complete)
    actors, pending = {}, {}  # cell_id -> actor (rank 0); future -> (kind, cell_id, repeat)
    followers, groups = {}, {}  # cell_id -> actors of ranks 1.. / its placement group (tp > 1)
    loaded, capture_s, left, parity, threads_of = {}, {}, {}, {}, {}
    status = "failed"

    def drop(cid: str) -> None:
        for fut in [f for f, (_, c, _) in pending.items() if c == cid]:
            del pending[fut]
        for a in [actors.pop(cid)] + followers.pop(cid, []):
            ray.kill(a)
        if cid in groups:
            remove_placement_group(groups.pop(cid))

    try:
        for cell in todo:
            threads = threads_of[cell.cell_id] = cell_threads(cell, nodes)
            model = plan.models[cell.model]
            desc = {**cell.axes(), "cell_id": cell.cell_id, "options": cell.opts, "max_tokens": cell.max_tokens,
                    "weights_sha256": model.weights_sha256,
                    "source": {"gguf": model.gguf_path, "quant": model.gguf_quant}}
            ids = [(p.prompt_id, p.token_ids) for p in plan.prompts[cell.model]]
            cls = backend_class(cell.engine)
            if cell.tp > 1 and not getattr(cls, "own_workers", False):
                # One actor per rank, all in one STRICT_PACK group; every rank loads and runs the
                # (collective) forwards, rank 0 also checks parity and writes the rows.
                # Nothing here blocks: the actors start when the group is placed, and rank 0's
                # address reaches the other ranks' load() as an object ref.
                pg = groups[cell.cell_id] = placement.placement_group_for(cell.device, cell.tp, threads, nodes)
                gpu = {"num_gpus": 1} if placement.NEEDS[cell.device].gpu else {}
                ranks = [StackActor.options(num_cpus=threads, **gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i)).remote(desc, model.hf_dir, threads, str(wh.root))
                    for i in range(cell.tp)]
                rendezvous = ranks[0].rendezvous.remote()
                gpus = [a.gpu_ids.remote() for a in ranks] if gpu else []  # each rank sees them all (NCCL P2P)
                actor, followers[cell.cell_id] = ranks[0], ranks[1:]
                for i, a in enumerate(ranks):
                    pending[a.load.remote({"rank": i, "world_size": cell.tp}, rendezvous, *gpus)] = \
                        ("load" if i == 0 else "rank", cell.cell_id, None)
                for a in ranks[1:]:
                    for r in plan.todo[cell.cell_id]:
                        pending[a.capture.remote(run_id, r, ids, spec.stride)] = ("rank", cell.cell_id, r)
            else:
                if cls.workers_in_group(cell):
                    # The engine starts its own Ray workers (vLLM's Ray executor): they go into this
                    # cell's group, found from inside the actor, not into a group nested in ours.
                    pg = groups[cell.cell_id] = placement.placement_group_for(cell.device, cell.tp, threads, nodes)
                    opts = placement.engine_driver_options(pg)
                else:
                    opts = placement.actor_options(cell.device, cell.tp, threads, nodes)
                    if cell.tp > 1:  # own tp workers (vLLM "mp"): one actor holds all their devices
                        opts["num_cpus"] = threads * cell.tp
                        if "num_gpus" in opts:
                            opts["num_gpus"] = cell.tp
                if getattr(cls, "separate_python", False):  # e.g. vLLM's own venv: its pins stay out of ours
                    opts["runtime_env"] = cls.runtime_env(desc, threads)
                actor = StackActor.options(**opts).remote(desc, model.hf_dir, threads, str(wh.root))
                pending[actor.load.remote()] = ("load", cell.cell_id, None)
            actors[cell.cell_id] = actor
            # An actor runs its calls in order: load, parity, then the captures.
            texts = [(p.prompt_id, p.text, p.token_ids) for p in plan.prompts[cell.model]]
            pending[actor.parity.remote(texts, plan.special[cell.model], plan.vocab[cell.model])] = \
                ("parity", cell.cell_id, None)
            for r in plan.todo[cell.cell_id]:
                pending[actor.capture.remote(run_id, r, ids, spec.stride)] = ("capture", cell.cell_id, r)
            left[cell.cell_id] = len(plan.todo[cell.cell_id])
            capture_s[cell.cell_id] = 0.0
        log(f"{len(todo)} cell(s) to run, {units_total} capture(s); {len(plan.complete)} already complete")
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=HEARTBEAT_S)
            if not ready:  # nothing finished for a while: say what is still waiting, and on what
                now_nodes = placement.known_nodes(placement.cluster_nodes(), cluster_config)
                log(_heartbeat(cells, threads_of, pending, loaded, now_nodes, units_done, units_total, rows, t0))
                continue
            kind, cid, rep = pending.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except Exception as e:
                # After a failed load every later call of the cell raises the load's own exception
                # (StackActor._loaded), so a SkipCell from any of them is the load's outcome.
                cause = getattr(e, "cause", None)
                if not isinstance(cause, SkipCell):
                    raise
                reason = str(cause).splitlines()[0]
                log(f"[cells {cells_done + 1}/{len(spec.cells)}] {cid} skipped: {reason}")
                units_total -= left.pop(cid)
                drop(cid)
                wh.write_rows("cells", cid, [_skipped_row(plan, cells[cid], run_id, reason)])
                cells_done += 1
                continue
            if kind == "rank":
                continue  # another rank's load or forwards finished; rank 0 reports the cell
            if kind == "load":
                loaded[cid] = result
                log(f"loaded {cid} on {result['host']} in {result['load_seconds']:.1f}s")
            elif kind == "parity":
                parity[cid] = result
                wh.write_rows("tokenizer_parity", cid, [
                    {**r, "cell_id": cid, "run_id": run_id, "engine": cells[cid].engine} for r in result["rows"]])
                if result["status"] == "mismatch":
                    bad = [r for r in result["rows"] if not r["match"]]
                    what = "; ".join(f"{r['prompt_id']}: {r['diagnosis']} at position {r['first_diff']}"
                                     for r in bad[:3]) + "".join(f"; {p}" for p in result["problems"])
                    log(f"tokenizer parity MISMATCH for {cid} ({len(bad)}/{len(result['rows'])} prompts): {what}"
                        " -- capture still uses the canonical ids")
            else:
                units_done += 1
                rows += result["rows"]
                capture_s[cid] += result["seconds"]
                left[cid] -= 1
                rate = rows / max(time.perf_counter() - t0, 1e-9)
                log(f"[cells {cells_done}/{len(spec.cells)} | captures {units_done}/{units_total}] "
                    f"{cid} r{rep}: {result['rows']} rows in {result['seconds']:.1f}s "
                    f"| rows {rows} | {rate:.1f} rows/s")
            if left.get(cid) == 0 and cid in loaded and cid in parity:
                wh.write_rows("cells", cid, [_cell_row(plan, cells[cid], run_id, loaded[cid], wh, capture_s[cid],
                                                       parity.get(cid))])
                ray.get([a.close.remote() for a in [actors[cid]] + followers.get(cid, [])])
                drop(cid)
                del left[cid]
                cells_done += 1
                log(f"[cells {cells_done}/{len(spec.cells)}] {cid} done")
        status = "done"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        err = getattr(e, "cause", None) or e  # the actor's own exception, not Ray's wrapper
        run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
        raise
    finally:
        for cid in list(actors):
            drop(cid)
        run.update(status=status, finished_at=now(), cells_done=cells_done, rows_written=rows)
        wh.write_rows("runs", run_id, [run])
    elapsed = time.perf_counter() - t0
    return {"run_id": run_id, "cells_total": len(spec.cells), "cells_done": cells_done,
            "cells_run": len(todo), "rows_written": rows, "seconds": round(elapsed, 2),
            "rows_per_second": round(rows / max(elapsed, 1e-9), 2),
            "skipped": spec.skipped}


HEARTBEAT_S = float(os.environ.get("LOGIT_MATRIX_HEARTBEAT_S", "60"))


def _heartbeat(cells: dict, threads_of: dict, pending: dict, loaded: dict, nodes: list, units_done: int,
               units_total: int, rows: int, t0: float) -> str:
    """One line while nothing finishes: which cells are not loaded yet, and where they can go now."""
    waiting = sorted({cid for kind, cid, _ in pending.values() if kind == "load" and cid not in loaded})
    where = []
    for cid in waiting[:3]:
        c = cells[cid]
        where.append(f"{cid} ({placement.where(c.device, c.tp, threads_of[cid], nodes)})")
    more = f" and {len(waiting) - 3} more" if len(waiting) > 3 else ""
    state = (f"; {len(waiting)} cell(s) not loaded yet: " + ", ".join(where) + more) if waiting else ""
    # an actor runs its calls in order: a loaded cell's first pending capture is the one running
    busy = {}
    for kind, cid, rep in pending.values():
        if kind == "capture" and cid in loaded:
            busy[cid] = min(busy.get(cid, rep), rep)
    if busy:
        state += "; capturing: " + ", ".join(f"{cid} r{r}" for cid, r in sorted(busy.items())[:3]) \
            + (f" and {len(busy) - 3} more" if len(busy) > 3 else "")
    return (f"waiting {time.perf_counter() - t0:.0f}s in: captures {units_done}/{units_total}, rows {rows}"
            f"{state}")


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, with the address in the message, instead of Ray's long retry loop."""
    if address == "auto":
        return  # Ray looks for a local cluster and says clearly when there is none
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"--address {address}: cannot reach {host}:{port} ({e.strerror or e})") from None


def init_ray(address: str | None):
    """Connect to a cluster or start a local one. Only the CLI calls this (and shutdown)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 defaults to token auth
    import ray

    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise UserError(f"--address {address}: {str(e).splitlines()[0]}") from None
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    return ray


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
