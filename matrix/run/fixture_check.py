"""Check a stack against a reference-output fixture (analysis/fixture_export.py writes one): run
it on the fixture's own token ids, in-process or on a Ray node, and gate its top-k against the file's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from analysis.disclosure import hardware
from common import ids
from common.errors import UserError
from common.stack import Cell, StackDesc
from store import fixture_file


def _check_prompts(path: str, header: dict, model: str, tok, vocab: int) -> None:
    """The fixture's ids must be what this model's tokenizer makes of its texts."""
    if vocab != header["vocab_size"]:
        raise UserError(
            f"{path}: vocabulary {header['vocab_size']} but model {model} has {vocab}: "
            "the fixture belongs to another model"
        )
    for pr in header["prompts"]:
        fixture_ids = pr["token_ids"]
        if pr.get("text") is not None:
            plain = list(tok(pr["text"], add_special_tokens=False).input_ids)
            mine = plain if not pr.get("bos_added") else [tok.bos_token_id] + plain
            if mine != fixture_ids:
                i = next(
                    (j for j, (a, b) in enumerate(zip(mine, fixture_ids)) if a != b), min(len(mine), len(fixture_ids))
                )
                raise UserError(
                    f"{path}: prompt {pr['prompt_id']}: token ids do not match model {model}'s tokenizer "
                    f"(first difference at position {i}: fixture "
                    f"{fixture_ids[i] if i < len(fixture_ids) else 'end'}, "
                    f"model {mine[i] if i < len(mine) else 'end'})"
                )
        if max(fixture_ids) >= vocab:
            raise UserError(f"{path}: prompt {pr['prompt_id']} has token id {max(fixture_ids)} >= vocab {vocab}")


def _fixture_prompts(header: dict, rows: dict[str, list]) -> list[tuple[list[int], list[int], list[int]]]:
    """(token ids, fixture row indices, positions) per prompt, in the fixture's row order."""
    by_prompt: dict[str, list[int]] = {}
    for i, pid in enumerate(rows["prompt_id"]):
        by_prompt.setdefault(pid, []).append(i)
    ids_of = {pr["prompt_id"]: pr["token_ids"] for pr in header["prompts"]}
    return [(ids_of[pid], idx, [rows["position"][i] for i in idx]) for pid, idx in by_prompt.items()]


def differences(
    header: dict,
    engine: str,
    dtype: str,
    attention: str,
    weights: str | None,
    artifact: str | None,
    build: str | None,
    hw: str | None,
    source: str | None = None,
) -> list[dict]:
    """What differs between the fixture's producing stack and the stack under check."""
    made = header.get("produced_by") or {}
    fixture_weights = (header.get("model") or {}).get("weights_sha256")
    if fixture_weights is None:  # a fixture of a GGUF run as it is: the file itself is the checkpoint
        pairs = [("source_sha256", (header.get("model") or {}).get("source_sha256"), source)]
    else:
        pairs = [("weights_sha256", fixture_weights, weights)]
    pairs += [
        ("artifact_sha256", made.get("artifact_sha256"), artifact),
        ("engine", made.get("engine"), engine),
        ("dtype", made.get("dtype"), dtype),
        ("attention", made.get("attention"), attention),
        ("build", made.get("build"), build),
        ("hardware", made.get("hardware"), hw),
    ]
    return [{"what": w, "fixture": a, "stack": b} for w, a, b in pairs if a != b]


def _load_model(model: str, log: Callable[[str], None]):
    """--model (a catalog name or a model directory) fetched, with its tokenizer and vocabulary size.

    -> (ModelRef, the resolved model, tokenizer, vocab)."""
    import transformers

    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    p = Path(model).expanduser()
    ref = ModelRef(p.name, "path", str(p.resolve())) if p.exists() else ModelRef(model, "catalog", model)
    resolved = fetch(ref, log=log)
    tok = transformers.AutoTokenizer.from_pretrained(resolved.hf_dir)
    config = transformers.AutoConfig.from_pretrained(resolved.hf_dir)
    return ref, resolved, tok, int(getattr(config, "vocab_size", 0) or len(tok))


def _stack_cell(model_name: str, engine: str, dtype: str, attention: str, device: str, threads: int) -> Cell:
    """The cell of the stack under check; refused where the engine is not installed or cannot run it."""
    from backends import backend_class

    cls = backend_class(engine)
    if cls is None:
        raise UserError(f"fixture check: --engine {engine}: no such engine installed")
    stack = StackDesc.of(engine, dtype, attention, device, 1, model_name)
    cell = Cell(stack, ids.check_cell_id(engine, dtype, attention), threads).bound(
        None
    )  # never written: its id is its own
    why = cls.unsupported(cell)
    if why:
        raise UserError(f"fixture check: {why}")
    return cell


def _fixture_top(header: dict, rows: dict[str, list], vocab: int) -> tuple:
    """What the stack is measured against: (prompts, top-k ids, top-k logits, logsumexp, vocab)."""
    return (
        _fixture_prompts(header, rows),
        np.asarray(rows["topk_ids"], dtype=np.int64),
        np.asarray(rows["topk_logits"]),
        np.asarray(rows["logsumexp"]),
        vocab,
    )


def check_fixture(
    path: str,
    engine: str,
    model: str,
    dtype: str,
    attention: str,
    threads: int,
    log: Callable[[str], None] = print,
    device: str = "cpu",
    nodes: list | None = None,
) -> dict[str, Any]:
    """Run a stack on the fixture's prompts and measure it against the fixture: in this process,
    or (nodes: the Ray cluster's, as `matrix run` sees them) in a cell actor placed on a node of
    `device` exactly as `matrix run` places one, its weights shipped there when it lacks them."""
    header, rows = fixture_file.load(path)
    ref, resolved, tok, vocab = _load_model(model, log)
    _check_prompts(path, header, model, tok, vocab)
    cell = _stack_cell(ref.name, engine, dtype, attention, device, threads)
    top = _fixture_top(header, rows, vocab)
    run = _on_ray(cell, resolved, threads, nodes, top) if nodes is not None else _here(cell, resolved, threads, top)
    art = run["settings"].get("artifact") or {}
    diff = differences(
        header,
        engine,
        dtype,
        attention,
        resolved.weights_sha256,
        art.get("sha256"),
        run["build"],
        hardware({"fingerprint": json.dumps(run["fingerprint"], default=str), "device": device}),
        resolved.source_sha256,
    )
    return {
        "header": header,
        "metrics": run["metrics"],
        "rows": run["rows"],
        "nonfinite": run["nonfinite"],
        "settings": run["settings"],
        "differences": diff,
        "ran_on": run["ran_on"],
    }


def _here(cell: Cell, resolved, threads: int, top: tuple) -> dict[str, Any]:
    import socket

    from actors.fingerprint import fingerprint
    from actors.fixture_measure import measure
    from backends import backend_class
    from common.builds import engine_build
    from matrix.spec.cells import stack_desc

    cls = backend_class(cell.engine)
    backend = cls(stack_desc(cell, resolved), resolved.hf_dir, threads)
    backend.load()
    try:
        out = measure(backend, *top)
        settings = backend.settings()
    finally:
        backend.close()
    return {
        **out,
        "settings": settings,
        "build": engine_build(cls.libraries)["build"],
        "fingerprint": fingerprint(),
        "ran_on": {"where": "this process", "host": socket.gethostname()},
    }


def _on_ray(cell: Cell, resolved, threads: int, nodes: list, top: tuple) -> dict[str, Any]:
    import ray

    from actors.depot import DriverDepot, depot_options
    from actors.ray_actor import StackActor
    from actors.stack_actor import Delivery
    from backends import backend_class
    from matrix.run import placement
    from matrix.spec.cells import model_copy, stack_desc

    why = placement.problem(cell.device, 1, threads, nodes)
    if why:
        raise UserError(f"fixture check: --device {cell.device}: {why}")
    # the depot serves the weights to a node without them; no rows are written anywhere
    depot = DriverDepot.options(**depot_options(ray.get_runtime_context().get_node_id())).remote("")
    desc = stack_desc(cell, resolved)
    opts = placement.actor_options(cell.device, 1, threads, nodes)
    env = backend_class(cell.engine).runtime_env(desc, threads)
    if env:
        opts["runtime_env"] = env
    actor = StackActor.options(**opts).remote(desc, model_copy(resolved), threads, Delivery("", "", depot))
    try:
        loaded = ray.get(actor.load.remote())
        out = ray.get(actor.fixture.remote(*top))
    finally:
        ray.kill(actor)
        ray.kill(depot)
    settings = {**loaded["settings"], **({"artifact": loaded["artifact"]} if loaded.get("artifact") else {})}
    return {
        **out,
        "settings": settings,
        "build": loaded["build"],
        "fingerprint": loaded["fingerprint"],
        "ran_on": {
            "where": "ray",
            "host": loaded["host"],
            "node_id": loaded["node_id"],
            "model_via": loaded["model_via"],
        },
    }
