"""`prefill_chunk: [N, ...]`: each prompt fed in chunks of N tokens, graded against the same cell fed it whole.

Serving engines split a long prompt's prefill into chunks that each attend to the KV cache the
chunks before them filled (vLLM's chunked prefill, `max_num_batched_tokens`; llama.cpp's `n_batch`
calls of llama_decode). The kernels then see other shapes than one whole-prompt forward, so the
rows may differ. For each N, the engine runs the prompt again in chunks of N tokens
(`chunked_rows(token_ids, positions, N)`) and each sampled row goes to the repeat's side file at
path 'chunked', step N; the capture's own row there goes beside them once (path 'prefill', step 0).

Graded against the cell's own prefill path, not a partner cell: the same process and weights give
both rows, so what differs is the chunking alone, at the cost of one more forward per size.
A prompt no longer than N is one chunk: a second whole prefill, with the KV cache kept.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from common.positions import next_ids
from extras import Capturer, Extra, loads
from store.cell_rows import CellRow
from store.prompt_rows import PromptRows

PATH = "chunked"
VIEW = "prefill_chunk_drift"


class ChunkCapturer(Capturer):
    def __init__(self, backend, sizes: tuple[int, ...], writer):
        self.backend, self.sizes, self.writer = backend, sizes, writer
        self.got = {"rows": 0, "seconds": 0.0, "chunked_prompts": dict.fromkeys(map(str, sizes), 0)}

    def after(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int], rows) -> None:
        nxt = next_ids(whole, positions)
        k = len(positions)
        self.writer.add(PromptRows(prompt_id, positions, nxt, rows, None, ["prefill"] * k, [0] * k))
        for n in self.sizes:
            t0 = time.perf_counter()
            chunked = self.backend.chunked_rows(fed, positions, n)  # (rows, vocab), native dtype
            self.got["seconds"] += time.perf_counter() - t0
            chunked = chunked.astype(rows.dtype)
            self.writer.add(PromptRows(prompt_id, positions, nxt, chunked, None, [PATH] * k, [n] * k))
            self.got["chunked_prompts"][str(n)] += len(fed) > n
        self.got["rows"] += k * (1 + len(self.sizes))

    def summary(self) -> dict[str, Any]:
        return dict(self.got)


class PrefillChunk(Extra):
    key = "prefill_chunk"
    hook = "chunked_rows"
    missing = "engine {engine} cannot feed a prompt in chunks here (the cell asks for prefill_chunk)"
    table = "side"
    paths = (PATH,)
    order = 25  # reads the prompt's whole-prefill rows
    rank = 35
    about = "also feed each prompt in chunks of N tokens (each size), graded against the whole prefill"
    json_schema = {
        "oneOf": [
            {"type": "integer", "minimum": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        ]
    }
    tp1_only = "prefill_chunk runs at tp 1 only in this version"

    def parse(self, v: Any, fail) -> tuple[int, ...] | None:
        """[N, ...] (or one N) -> the sizes, ascending, each once."""
        if v is None:
            return None
        sizes = v if isinstance(v, list) else [v]
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise fail("must be a chunk size in tokens or a non-empty list of them (each 1 or more)", v)
        return tuple(sorted(set(sizes)))

    def describe(self, value) -> list[int]:
        return list(value)

    def side_rows(self, value, fed_positions: list[list[int]], prompt_lengths: list[int]) -> tuple[int, bool]:
        """Per sampled row, the whole prefill's once and a chunked one per size."""
        return (1 + len(value)) * sum(len(f) for f in fed_positions), True

    def capturer(self, backend, value, writer) -> Capturer:
        return ChunkCapturer(backend, value, writer)

    def settings(self, backend, value) -> dict[str, Any]:
        # what "whole" is on this engine (llama.cpp: its n_batch and n_ubatch; whole where >= the prompt)
        whole = getattr(backend, "whole_prefill", None)
        return {self.key: {"sizes": list(value), **({"whole": whole()} if callable(whole) else {})}}

    def active_in(self, cell_row: Mapping | CellRow) -> bool:  # no cells column: its settings entry says so
        return self.key in loads(cell_row.get("settings"))

    def path_rules(self) -> dict:
        from analysis.side_analysis import PathRule

        # its rows sit at sampled positions: the reference's capture shard holds the rows to compare with
        return {PATH: PathRule(active=self.active_in, reference_shard=True, prefill_step=0)}

    def views(self) -> dict[str, tuple[str, str]]:
        from analysis.aggregates import agg

        sql = f"""
        SELECT c.model, d.cell_id, c.engine, c.dtype, c.attention, d.step AS chunk, count(*) AS rows,
               count(*) FILTER (WHERE d.identical_to_prefill) AS identical_rows,
               bool_and(d.identical_to_prefill) AS bit_identical,
               {agg("mean", "d.kld_vs_prefill")} AS kld_mean, {agg("stderr", "d.kld_vs_prefill")} AS kld_stderr,
               {agg("max", "d.kld_vs_prefill")} AS kld_max, {agg("share", "d.top1_match_prefill")} AS top1_agreement,
               {agg("max", "d.max_abs_diff_vs_prefill")} AS max_abs_diff,
               {agg("mean", "d.kld")} AS kld_vs_reference, {agg("mean", "d.kld_prefill")} AS kld_whole_vs_reference
        FROM decode_metrics d JOIN cells c USING (cell_id)
        WHERE d.path = '{PATH}' AND d.repeat = 0
        GROUP BY c.model, d.cell_id, c.engine, c.dtype, c.attention, d.step"""
        about = (
            "each prefill_chunk cell's rows fed in chunks of `chunk` tokens against the same cell's whole "
            "prefill: rows bit-identical, KL(whole ‖ chunked) (mean, s.e., max), top-1 agreement and max "
            "|Δlogit|; with both paths' KL against the reference"
        )
        return {VIEW: (sql, about)}

    def card(self, db, cell: dict) -> dict | None:
        """Per chunk size: the chunked rows against the whole prefill (null without)."""
        if not self.active_in(cell):
            return None
        from analysis.card import query_rows

        rows = query_rows(db, f"SELECT * FROM {VIEW} WHERE cell_id = ? ORDER BY chunk", [cell["cell_id"]])
        keys = ("chunk", "rows", "identical_rows", "kld_mean", "kld_stderr", "kld_max", "top1_agreement")
        return {"sizes": [{k: r[k] for k in keys} for r in rows]}

    def card_lines(self, block: dict) -> list[str]:
        from analysis.card import fmt_value as g

        return [""] + [
            f"Prefill in chunks of {s['chunk']} tokens against the whole prefill: KL {g(s['kld_mean'])} "
            f"± {g(s['kld_stderr'] or 0)} nats (max {g(s['kld_max'])}), top-1 {g(s['top1_agreement'])}, "
            f"{s['identical_rows']} of {s['rows']} rows bit-identical."
            for s in block["sizes"]
        ]

    def report(self, data: dict) -> str:
        """KL against the whole prefill by chunk size, one line per cell, and the rows as a table."""
        import html

        from analysis import report_plots as P
        from analysis import report_tables as T

        rows = sorted((data.get("plugin_views") or {}).get(VIEW) or [], key=lambda r: (r["cell_id"], r["chunk"]))
        if not rows:
            return ""
        names = data.get("names") or {}
        sizes = sorted({r["chunk"] for r in rows})
        by_cell: dict[str, list[dict]] = {}
        for r in rows:
            by_cell.setdefault(names.get(r["cell_id"], r["cell_id"]), []).append(r)
        series = [
            (label, [sizes.index(r["chunk"]) for r in rs], [r["kld_mean"] for r in rs]) for label, rs in by_cell.items()
        ]
        head = "stack|chunk|rows|bit-identical rows|KL vs whole|± s.e.|max|top-1|KL vs reference".split("|")
        keys = ("chunk", "rows", "identical_rows", "kld_mean", "kld_stderr", "kld_max", "top1_agreement")
        table = [
            [
                html.escape(T.fmt(v))
                for v in (names.get(r["cell_id"], r["cell_id"]), *(r[k] for k in keys), r["kld_vs_reference"])
            ]
            for r in rows
        ]
        return (
            "<h2>Prefill in chunks</h2><p>Each prompt fed again in chunks of N tokens, each chunk attending to "
            "the KV cache the chunks before it filled (a serving engine's chunked prefill), against the same "
            "cell's whole prefill at the same positions.</p>"
            + P.lines(
                series, "prefill-chunk", "chunk size (tokens)", "KL(whole ‖ chunked), nats", list(map(str, sizes))
            )
            + T.html_table("prefill-chunk-rows", head, table)
        )

    def brief(self, value) -> list[str]:
        return [f"prefill in chunks of {', '.join(map(str, value))}"]


EXTRA = PrefillChunk
