"""`prefix_cache: check`: does a warm prefix cache give the rows a fresh prefill gives?

Each prompt is evaluated a second time with the engine's prefix cache warm from the first, by the
engine's own reuse rule; a cached prefix is not recomputed, so the rows after it come from other
kernels than a fresh prefill's (ggml-org/llama.cpp#2838). Each recomputed row (path 'prefix_cached')
goes to the repeat's side file beside the capture's own fresh row at that position (path
'prefill', step 0). An engine supports it by implementing `warm_rows(token_ids, positions)`
and may describe its reuse rule in `warm_rule` (recorded in the cell's settings).
"""

from __future__ import annotations

import json
import time
from typing import Any

from extras import Capturer, Extra, add_pairs, loads

PATH = "prefix_cached"


class PrefixCapturer(Capturer):
    def __init__(self, backend, writer):
        self.backend, self.writer = backend, writer
        self.got = {"rows": 0, "hits": {}, "identical_rows": 0, "max_abs_diff_vs_prefill": 0.0, "seconds": 0.0}

    def after(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int], fresh) -> None:
        t0 = time.perf_counter()
        hit, cached = self.backend.warm_rows(fed, positions)  # (rows >= hit, vocab)
        self.got["seconds"] += time.perf_counter() - t0
        idx = [i for i, p in enumerate(positions) if p >= hit]
        q = [positions[i] for i in idx]
        same, diff = add_pairs(self.writer, prompt_id, whole, q, fresh[idx], cached, PATH, [0] * len(q))
        c = self.got
        c["rows"] += 2 * len(q)
        c["hits"][prompt_id] = int(hit)
        c["identical_rows"] += same
        c["max_abs_diff_vs_prefill"] = max(c["max_abs_diff_vs_prefill"], diff)

    def summary(self) -> dict[str, Any]:
        return dict(self.got)


class PrefixCache(Extra):
    key = column = "prefix_cache"
    column_about = (
        'JSON: a `prefix_cache: check` cell\'s second evaluations: {"rows_per_repeat", "hits": {prompt: '
        'tokens the cache served}, "identical_rows", "max_abs_diff_vs_prefill"}'
    )
    hook = "warm_rows"
    missing = "engine {engine} has no prefix cache to check here (the cell asks for prefix_cache: check)"
    table = "side"
    paths = (PATH,)
    order = 20  # reads the prompt's fresh rows
    rank = 30
    about = "check: evaluate each prompt again with the engine's prefix cache warm, against the fresh prefill"
    json_schema = {"enum": ["check", "off", False]}
    tp1_only = "prefix_cache: check runs at tp 1 only in this version"

    def parse(self, v: Any, fail) -> bool | None:
        """check -> True; absent, off or false -> off."""
        if v is None or v is False or v == "off":
            return None
        if v == "check":
            return True
        raise fail("must be check or off", v)

    def id_part(self, value) -> str:
        return "check"

    def describe(self, value) -> str:
        return "check"

    def side_rows(self, value, fed_positions: list[list[int]], prompt_lengths: list[int]) -> tuple[int, bool]:
        """A cached and a prefill row per row the engine recomputed: at least the last of each prompt
        (how many is the engine's rule)."""
        return 2 * sum(1 for f in fed_positions if f), False

    def capturer(self, backend, value, writer) -> Capturer:
        return PrefixCapturer(backend, writer)

    def settings(self, backend, value) -> dict[str, Any]:
        rule = getattr(backend, "warm_rule", None)
        return {self.key: rule} if rule else {}

    def record(self, d: list[dict]) -> str | None:
        """cells.prefix_cache: per prompt the tokens the warm cache served, and how far its rows were."""
        return json.dumps(
            {
                "rows_per_repeat": d[0]["rows"],
                "hits": d[0]["hits"],
                "identical_rows": sum(x["identical_rows"] for x in d),
                "rows": sum(x["rows"] for x in d) // 2,
                "max_abs_diff_vs_prefill": max(x["max_abs_diff_vs_prefill"] for x in d),
                "seconds": sum(x["seconds"] for x in d),
            },
            sort_keys=True,
        )

    def path_rules(self) -> dict:
        from analysis.side_analysis import PathRule

        # its rows sit at sampled positions: the reference's capture shard holds the rows to compare with
        return {
            PATH: PathRule(active=self.active_in, hits=lambda c: loads(c.get(self.key))["hits"], reference_shard=True)
        }

    def card(self, db, cell: dict) -> dict | None:
        """The rows recomputed from a warm cache against the fresh prefill (null without)."""
        if not cell.get(self.key):
            return None
        from analysis.card import query_rows

        r = (
            query_rows(db, "SELECT * FROM summary_by_path WHERE cell_id = ? AND path = ?", [cell["cell_id"], PATH])
            or [{}]
        )[0]
        rec = loads(cell[self.key])
        return {
            "rows": r.get("rows"),
            "cached_tokens_mean": r.get("cached_tokens_mean"),
            "method": "the same prompt evaluated again with the engine's prefix cache warm from the first",
            "kld_prefill_vs_cached_mean": r.get("kld_vs_prefill_mean"),
            "max_abs_diff_vs_prefill": r.get("max_abs_diff_vs_prefill"),
            "bit_identical_share": r.get("identical_share"),
            "kld_cached_mean": r.get("kld_mean"),
            "recorded_max_abs_diff": rec.get("max_abs_diff_vs_prefill"),
        }

    def card_lines(self, pc: dict) -> list[str]:
        if not pc["rows"]:
            return []
        from analysis.card import fmt_value as g

        return [
            "",
            f"Prefix cache ({pc['method']}; {pc['rows']} recomputed rows, "
            f"{g(pc['cached_tokens_mean'])} tokens from the cache on average): against the fresh prefill "
            f"mean KL {g(pc['kld_prefill_vs_cached_mean'])}, max abs diff {g(pc['max_abs_diff_vs_prefill'])}, "
            f"bit-identical rows {g(pc['bit_identical_share'])}; against the reference mean KLD "
            f"{g(pc['kld_cached_mean'])}.",
        ]

    def report(self, data: dict) -> str:
        import html

        cached = [r for r in data.get("paths") or [] if r["path"] == PATH]
        if not cached:
            return ""
        body = "".join(
            f"<tr><td>{html.escape((data.get('names') or {}).get(r['cell_id'], r['cell_id']))}</td>"
            f"<td>{r['rows']}</td><td>{r['cached_tokens_mean']:.1f}</td>"
            f"<td>{r['kld_vs_prefill_mean']:.3g}</td><td>{r['max_abs_diff_vs_prefill']:.3g}</td>"
            f"<td>{r['identical_share']:.0%}</td></tr>"
            for r in cached
        )
        return (
            "<h2>Prefix cache against a fresh prefill</h2><p>Each prompt evaluated a second time with the "
            "engine's prefix cache warm from the first; the rows it recomputed against the fresh prefill's "
            "(a cached prefix may not equal a fresh prefill).</p>"
            '<table id="prefix-cache"><tr><th>stack</th><th>rows</th><th>tokens from the cache (mean)</th>'
            "<th>KL(prefill || cached) mean</th><th>max |cached - prefill|</th><th>bit-identical</th></tr>"
            + body
            + "</table>"
        )

    def brief(self, value) -> list[str]:
        return ["prefix cache check"]


EXTRA = PrefixCache
