"""A toy per-cell extra, registered from outside the package by the entry point of the distribution
beside it (toy_extra-0.1.dist-info, group logit_matrix.extras): `echo: on` evaluates each prompt's
prefill a second time in the same process and writes each row beside the first one (decode-file
path 'echo'), so analysis measures how far an engine's two identical forwards are apart. Every
engine has the hook it needs (forward)."""

from __future__ import annotations

import json

from analysis.aggregates import agg
from extras import Capturer, Extra, add_pairs, loads


class EchoCapturer(Capturer):
    def __init__(self, backend, writer):
        self.backend, self.writer, self.rows, self.identical = backend, writer, 0, 0

    def after(self, prompt_id, whole, fed, positions, rows) -> None:
        again = self.backend.forward(fed, positions)  # (rows, vocab), native dtype
        self.identical += add_pairs(
            self.writer, prompt_id, whole, positions, rows, again, "echo", [0] * len(positions)
        )[0]
        self.rows += 2 * len(positions)

    def summary(self):
        return {"rows": self.rows, "identical_rows": self.identical}


class Echo(Extra):
    key = "echo"
    hook = "forward"
    table = "side"
    paths = ("echo",)
    order = 40

    def parse(self, v, fail):
        if v in (None, False, "off"):
            return None
        if v == "on":
            return True
        raise fail("must be on or off", v)

    def side_rows(self, value, fed_positions, prompt_lengths):
        return 2 * sum(len(p) for p in fed_positions), True

    def capturer(self, backend, value, writer) -> Capturer:
        return EchoCapturer(backend, writer)

    def settings(self, backend, value):
        return {"echo": "each prefill evaluated twice in one process"}

    def active_in(self, cell_row: dict) -> bool:  # no column of its own: its settings entry says so
        return "echo" in loads(cell_row.get("settings"))

    def path_rules(self):
        from analysis.side_analysis import PathRule

        return {"echo": PathRule(active=self.active_in, reference_shard=True)}

    def views(self):
        sql = f"""SELECT cell_id, count(*) AS rows, {agg("share", "identical_to_prefill")} AS identical_share,
                         {agg("max", "max_abs_diff_vs_prefill")} AS max_abs_diff
                  FROM decode_metrics WHERE path = 'echo' AND repeat = 0 GROUP BY cell_id"""
        return {"echo_agreement": (sql, "each echo cell's second prefill against its first")}

    def describe(self, value):
        return "on"

    def brief(self, value):
        return ["echo"]

    def record(self, parts):
        return json.dumps({"rows": sum(p["rows"] for p in parts)})
