"""`kld()`: llama-perplexity --kl-divergence's job, each candidate file against a reference over one
text, with the statistics llama-perplexity prints and each candidate's model card, as values."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import extras
from common.errors import UserError
from common.output import log as stderr_log
from matrix.api.results import CandidateResult, KldResult, RunResult
from matrix.api.sweep import run

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection


def kld(
    reference: str,
    candidates: list[str],
    text: str | os.PathLike,
    warehouse: str = "kld-warehouse",
    *,
    n_ctx: int = 512,
    chunks: int | None = None,
    threads: int | None = None,
    keep_rows: bool = False,
    options: dict[str, str] | None = None,
    address: str | None = None,
    executor: str | None = None,
    log: Callable[[str], None] | None = None,
) -> KldResult:
    """reference, candidates: a GGUF file, an HF checkpoint directory or a catalog model each; text: the
    evaluation text (UTF-8), cut into chunks of n_ctx tokens whose second halves are scored; chunks:
    only the first that many of them, as llama-perplexity's --chunks (None: every chunk). n_ctx is
    refused past the context the reference declares. options: the engine options a plug-in declares
    that the candidates run with, as their flags give them (extras.Extra.flag), e.g. {"kv_cache":
    "q8_0"} or "K,V" (llama.cpp's -ctk / -ctv; left out: its default f16, as the reference), so a
    candidate is a file and a cache: the reference's own file with a q8_0 cache measures the cache.

    The job's spec is written beside the warehouse (WAREHOUSE.kld.yaml) and run with the local executor
    unless a cluster is named. One candidate's failure is its own: the others are still measured, and
    it is listed in `incomplete`. Input refused before anything ran raises UserError."""
    from matrix.spec import kld as job

    log = log or stderr_log
    threads = cell_threads(threads, address)
    ref = job.classify(reference, "--reference")
    options = job.flag_options(options or {})
    cands = [job.classify(c, "--candidate") for c in candidates]
    text_file = Path(os.path.expanduser(str(text))).resolve()
    if not text_file.is_file():
        raise UserError(f"--text {text}: no such file")
    spec_path, asked, new = job.write_job(
        ref, cands, text_file, n_ctx, threads, warehouse, log, keep_rows, chunks, options
    )
    log(f"the job's spec: {spec_path} (`matrix run {spec_path} --warehouse {warehouse}` repeats it)")
    result, refused, stacks = _run_job(
        spec_path, asked, warehouse, executor or ("ray" if address else "local"), address, log
    )
    done, anything = _done_cells(warehouse, stacks)
    failed = {job.candidate_key(a) for a in asked} - {job.candidate_key(a) for a, _ in done}
    job.forget(warehouse, failed, drop_job=new and not anything)
    if refused is not None and not done:
        raise UserError(refused)
    con = _measured(warehouse, done, log) if done else None
    try:
        if failed:
            names = ", ".join(_label(a) for a in asked if job.candidate_key(a) in failed)
            why = "its cell did not complete (the run says why above), and it is left out of the job's spec"
            log(f"no statistics for {names}: {why}")
        results = _results(con, warehouse, done, ref.label) if con is not None else ()
    finally:
        if con is not None:
            con.close()
    return KldResult(str(spec_path), warehouse, n_ctx, results, tuple(sorted(failed)), result, refused)


def _run_job(
    spec_path: Path, asked: list[dict], warehouse: str, executor: str, address: str | None, log
) -> tuple[RunResult | None, str | None, list[tuple[dict, str]]]:
    """(the run's result, what it refused, (candidate entry, its stack id) for each candidate asked
    for): the job's spec is expanded once, for the run and for finding the candidates' cells. One
    candidate's failure is its own, so a refusal is returned for the others to be reported, not raised."""
    from matrix.spec.cells import load_spec
    from matrix.spec.kld import candidate_key

    try:
        matrix = load_spec(spec_path)
    except UserError as e:  # the job's spec itself refused: nothing runs, no candidate has a cell
        return None, str(e), []
    by_key = {candidate_key({"gguf": c.artifact, **c.opts}): c.stack_id for c in matrix.cells if c.artifact is not None}
    stacks = [(a, by_key[candidate_key(a)]) for a in asked]
    try:
        result = run(matrix, warehouse, executor=executor, address=address, log=log)
    except UserError as e:  # refused before anything ran, or a file refused where it ran
        return None, str(e), stacks
    return result, result.bad_input, stacks


def _label(entry: dict) -> str:
    """A candidate's name, with each engine option a plug-in declares that it runs with (its KV cache)."""
    import extras

    more = [f" ({x.title or x.key} {x.label(entry[x.key])})" for x in extras.options() if entry.get(x.key) is not None]
    return entry["name"] + "".join(more)


def cell_threads(threads: int | None, address: str | None) -> int:
    """The threads each cell takes: as given, else this machine's cores (refused with a cluster,
    whose nodes' cores this machine cannot know)."""
    if threads is not None and threads < 1:
        raise UserError(f"--threads {threads}: must be >= 1")
    if threads is None and address:
        raise UserError(
            "--threads: give the threads each cell takes on the cluster's nodes (this machine's core "
            "count says nothing of theirs)"
        )
    return threads or os.cpu_count() or 1


def _done_cells(warehouse: str, stacks: list[tuple[dict, str]]) -> tuple[list[tuple[dict, str]], bool]:
    """((entry, the cell of its stack this warehouse captured last) for each candidate that
    completed (a stack captured by several engine builds has a cell per build), whether any cell
    of the warehouse is complete)."""
    from store import Warehouse

    wh = Warehouse(warehouse)
    rows = [c for c in (wh.read_all("cells") if wh.check() else []) if c["status"] == "done"]
    out = []
    for a, stack in stacks:
        done = sorted((c for c in rows if c["stack_id"] == stack), key=lambda c: c["finished_at"])
        if done:
            out.append((a, done[-1]["cell_id"]))
    return out, bool(rows)


def _measured(warehouse: str, cells: list[tuple[dict, str]], log) -> DuckDBPyConnection:
    """A connection with every view of the warehouse, where each completed candidate has its
    metrics: one its capturing process could not measure (it says why in its cells row) is
    measured here, as `matrix analyze` does, and the views are bound again after it."""
    from analysis.analyze import analyze
    from analysis.sql import connect

    con = connect(warehouse)  # every view: the card reads most of them
    try:
        have = {r[0] for r in con.execute("SELECT DISTINCT cell_id FROM metrics").fetchall()}
    except BaseException:
        con.close()
        raise
    if all(cid in have for _, cid in cells):
        return con
    con.close()  # a view reads the files that were there when it was made
    log("measuring the candidates their capture did not measure (matrix analyze)")
    analyze(warehouse, log=log, side=[s[:2] for s in extras.analyses()])
    return connect(warehouse)


def _results(
    con: DuckDBPyConnection, warehouse: str, cells: list[tuple[dict, str]], ref_label: str
) -> tuple[CandidateResult, ...]:
    import backends
    from analysis.card import build_card
    from analysis.kld_stats import cell_stats
    from matrix.spec.kld import file_of

    found = []
    for a, cid in cells:
        q = "SELECT count(DISTINCT prompt_id) FROM metrics WHERE cell_id = ?"
        chunks = con.execute(q, [cid]).fetchone()[0]
        found.append((file_of(a), _label(a), cid, chunks, cell_stats(con, cid)))
    card = {"allow_undisclosed": True, "extras": extras.registered(), "as_is": backends.as_is(), "con": con}
    return tuple(
        CandidateResult(file, label, ref_label, cid, chunks, stats, build_card(warehouse, cid, **card))
        for file, label, cid, chunks, stats in found
    )


def exit_code(result: KldResult) -> int:
    """What `matrix kld` exits with: 2 for input refused, 1 where a cell failed, else 0."""
    if result.refused is not None:
        return 2
    run_result: RunResult | None = result.run
    return 0 if run_result is None or run_result.ok else 1
