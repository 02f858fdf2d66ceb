"""`decode: {steps: K, at: [p, ...]}`: the decode path.

A KV-cache decode runs other kernels than a prefill (n_tokens = 1; ggml-org/llama.cpp#2838), so
its rows may differ from the prefill's at the same position. From each start p the engine
continues from its KV cache one token at a time (teacher-forced: each step is fed the prompt's own
next id, batch 1) for K steps. Both rows of each decoded position, the decode row (path 'decode')
and a prefill row of the same stack there (path 'prefill'), go to the repeat's side file (d<repeat>).
An engine supports it by implementing `decode(token_ids, at, steps)`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from extras import Capturer, Extra, add_pairs, loads


class DecodeCapturer(Capturer):
    def __init__(self, backend, value: tuple, writer):
        self.backend, (self.steps, self.at), self.writer = backend, value, writer
        self.rows, self.seconds, self.identical, self.max_abs = 0, 0.0, 0, 0.0

    def after(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int], rows) -> None:
        starts = [a for a in self.at if a + self.steps < len(whole)]  # the starts this prompt holds
        if not starts:
            return
        points = [(a, s) for a in starts for s in range(1, self.steps + 1)]  # start-major
        want = sorted({a + s for a, s in points})
        # A prefill of its own up to the last decoded position: which rows a forward keeps changes
        # the LM head's matmul shape, and so its rounding (HF fp32 measured), so the capture's rows
        # stay exactly those of the same stack without decode.
        pre = self.backend.forward(whole[: want[-1] + 1], want)  # (len(want), vocab)
        index = {p: i for i, p in enumerate(want)}
        prefill = pre[[index[a + s] for a, s in points]]  # (points, vocab)
        t0 = time.perf_counter()
        decoded = np.concatenate([self.backend.decode(whole, a, self.steps) for a in starts])  # (points, vocab)
        self.seconds += time.perf_counter() - t0
        same, diff = add_pairs(
            self.writer,
            prompt_id,
            whole,
            [a + s for a, s in points],
            prefill,
            decoded,
            "decode",
            [s for _, s in points],
        )
        self.rows += 2 * len(points)
        self.identical += same
        self.max_abs = max(self.max_abs, diff)

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "at": list(self.at),
            "rows": self.rows,
            "seconds": self.seconds,
            "identical_rows": self.identical,
            "max_abs_diff_vs_prefill": self.max_abs,
        }


class Decode(Extra):
    key = column = "decode"
    column_about = 'JSON: a `decode:` cell\'s decode rows: {"steps", "at": [...], "rows_per_repeat"}'
    hook = "decode"
    missing = "engine {engine} cannot run the decode path here (the cell asks for decode rows)"
    table = "side"
    paths = ("decode",)
    order = 30
    rank = 20
    about = "also run the decode path: steps teacher-forced tokens from each position of at"
    json_schema = {
        "type": "object",
        "required": ["steps", "at"],
        "additionalProperties": False,
        "properties": {
            "steps": {"type": "integer", "minimum": 1},
            "at": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        },
    }
    tp1_only = "decode rows are recorded at tp 1 only in this version"  # the other ranks would join each step

    def parse(self, v: Any, fail) -> tuple | None:
        """{steps: K, at: [p, ...]} -> (K, sorted positions)."""
        if v is None:
            return None
        if not isinstance(v, dict) or set(v) != {"steps", "at"}:
            raise fail("must be a mapping with exactly steps and at", v)
        steps, at = v["steps"], v["at"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise fail("must be a positive integer", steps, ".steps")
        if (
            not isinstance(at, list)
            or not at
            or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in at)
        ):
            raise fail("must be a non-empty list of positions (0-based)", at, ".at")
        return steps, tuple(sorted(set(at)))

    def for_reference(self, values: list) -> tuple | None:
        """The most steps from every start any cell of the model decodes."""
        out = None
        for v in values:
            if v is not None:
                out = v if out is None else (max(out[0], v[0]), tuple(sorted(set(out[1]) | set(v[1]))))
        return out

    def describe(self, value):
        return {"steps": value[0], "at": list(value[1])}

    def resolve(self, value, cell, facts: dict, prompts: list, fail):
        """Every start fits some prompt: `steps` more tokens before its end. A start a shorter prompt
        cannot hold is left out for that prompt (side_rows counts what is kept)."""
        steps, at = value
        longest = max(prompts, key=lambda p: len(p.token_ids))
        if at[-1] + steps >= len(longest.token_ids):
            raise fail(
                f"decode: position {at[-1]} + {steps} steps of cell {cell.stack_id} passes the "
                f"end of every prompt (the longest, {longest.name}, has {len(longest.token_ids)} tokens: "
                f"positions 0..{len(longest.token_ids) - 1})"
            )
        return value

    def side_rows(self, value, fed_positions: list[list[int]], prompt_lengths: list[int]) -> tuple[int, bool]:
        """A decode and a prefill row per step of each start that fits."""
        steps, at = value
        return 2 * steps * sum(sum(a + steps < n for a in at) for n in prompt_lengths), True

    def capturer(self, backend, value, writer) -> Capturer:
        return DecodeCapturer(backend, value, writer)

    def record(self, d: list[dict]) -> str | None:
        """cells.decode: steps, starts, rows per repeat, and how far decode rows were from the prefill's."""
        return json.dumps(
            {
                "steps": d[0]["steps"],
                "at": d[0]["at"],
                "rows_per_repeat": d[0]["rows"],
                "identical_rows": sum(x["identical_rows"] for x in d),
                "rows": sum(x["rows"] for x in d) // 2,
                "max_abs_diff_vs_prefill": max(x["max_abs_diff_vs_prefill"] for x in d),
                "decode_seconds": sum(x["seconds"] for x in d),
            },
            sort_keys=True,
        )

    def path_rules(self) -> dict:
        from analysis.side_analysis import PathRule

        # the reference's own side file holds its prefill rows at the decoded positions
        return {"decode": PathRule(active=self.active_in, reference_file=True)}

    def card(self, db, cell: dict) -> dict | None:
        """The decode rows against the prefill rows and the reference (null without)."""
        if not cell.get("decode"):
            return None
        from analysis.card import query_rows

        rows = {
            r["path"]: r
            for r in query_rows(
                db, "SELECT * FROM summary_by_path WHERE cell_id = ? AND rows_of = 'decode'", [cell["cell_id"]]
            )
        }
        rec, d, p = loads(cell["decode"]), rows.get("decode") or {}, rows.get("prefill") or {}
        return {
            "steps": rec.get("steps"),
            "at": rec.get("at"),
            "rows": d.get("rows"),
            "method": "teacher-forced from the KV cache of a prefill up to each start, batch 1, n_tokens = 1",
            "kld_decode_mean": d.get("kld_mean"),
            "kld_prefill_mean": p.get("kld_mean"),
            "top1_agreement_decode": d.get("top1_agreement"),
            "kld_prefill_vs_decode_mean": d.get("kld_vs_prefill_mean"),
            "max_abs_diff_vs_prefill": d.get("max_abs_diff_vs_prefill"),
            "bit_identical_share": d.get("identical_share"),
        }

    def card_lines(self, d: dict) -> list[str]:
        if not d["rows"]:
            return []
        from analysis.card import fmt_value as g

        return [
            "",
            f"Decode path ({d['steps']} steps from positions {d['at']}, {d['rows']} rows; {d['method']}):",
            "",
            "| path | mean KLD vs reference |",
            "|---|---|",
            f"| prefill | {g(d['kld_prefill_mean'])} |",
            f"| decode | {g(d['kld_decode_mean'])} |",
            "",
            f"Decode vs the same cell's prefill: mean KL {g(d['kld_prefill_vs_decode_mean'])}, max abs diff "
            f"{g(d['max_abs_diff_vs_prefill'])}, bit-identical rows {g(d['bit_identical_share'])}.",
        ]

    def report(self, data: dict) -> str:
        """Prefill against decode: each decode cell's KL to the reference on both paths, and how far apart."""
        from analysis.report_layers import paths_figure

        rows = [r for r in data.get("paths") or [] if r["rows_of"] == "decode"]
        if not rows:
            return ""
        return (
            "<h2>Prefill against decode</h2><p>At each decoded position: the stack's row from its one prefill, "
            "and its row from the KV cache, fed one teacher-forced token at a time (batch 1, n_tokens = 1; "
            "other kernels than the prefill's). Both against the reference's prefill row there.</p>"
            + paths_figure(rows, "decode", "prefill-decode", data.get("names"), data.get("model_of"))
        )

    def brief(self, value) -> list[str]:
        return [f"decode {value['steps']} steps from {value['at']}"]


EXTRA = Decode
