"""`layers: [i, ...] | first-N | all`: where divergence starts.

The cell also records the residual stream after those decoder layers and the final norm's output,
at the same sampled positions and from the same forward as its rows, in a `layer_states` shard per
repeat. `matrix analyze` compares each state with the reference's same (prompt, position, layer)
(cosine and norm ratio: the two gates, since cosine misses a dropped scale factor; NVIDIA
TensorRT-Edge-LLM's few-layer numeric validation guide), and `matrix layers CELL` gives the verdict.
An engine supports it by implementing `layer_states(token_ids, positions, layers)` and `n_layers()`,
and optionally `forward_and_layers` (rows and states from one forward) and `layer_sources` (its
own name of each state).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from extras import Capturer, Extra, loads
from store.cell_rows import CellRow


def sources(backend, layers: list[int]) -> dict[str, str]:
    """{state name: the engine's name for that tensor} ("{i}" in its layer_sources is the index)."""
    src = getattr(backend, "layer_sources", {})
    return {
        **{f"layer.{i}": src.get("layer", "layer {i}").format(i=i) for i in layers},
        "final_norm": src.get("final_norm", "final norm"),
    }


class LayersCapturer(Capturer):
    taps_forward = True

    def __init__(self, backend, layers: tuple, writer):
        self.backend, self.layers, self.writer = backend, list(layers), writer
        self.depth = backend.n_layers()
        self.sources = sources(backend, self.layers)

    def forward(self, prompt_id: str, fed: list[int], positions: list[int]) -> np.ndarray:
        both = getattr(self.backend, "forward_and_layers", None)
        if both is not None:  # (rows, vocab), {state: (rows, hidden)}: one forward, the taps only copy
            rows, states = both(fed, positions, self.layers)
        else:
            rows, states = self.backend.forward(fed, positions), self.backend.layer_states(fed, positions, self.layers)
        self.writer.add_layers(prompt_id, positions, states, self.depth, self.sources)
        return rows

    def other_rank(self, fed: list[int], positions: list[int]) -> None:
        self.backend.layer_states(fed, positions, self.layers)  # collective: every rank joins rank 0's

    def summary(self) -> dict[str, Any]:
        return {"rows": self.writer.rows, "depth": self.depth, "layers": self.layers, "sources": self.sources}


class Layers(Extra):
    key = column = "layers"
    column_about = (
        'JSON: a `layers:` cell\'s hidden states: {"layers": [i, ...], "depth", "rows_per_repeat", "sources"}'
    )
    hook = "layer_states"
    requires = ("n_layers",)
    missing = "engine {engine} cannot give per-layer states (the cell asks for layers)"
    table = "layer_states"
    order = 10  # it replaces the forward the others read rows from
    rank = 10
    about = "record hidden states after these decoder layers: a list of indices, first-N or all"
    json_schema = {
        "anyOf": [
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            {"type": "string", "pattern": "^(first-[0-9]*[1-9][0-9]*|all)$"},
        ]
    }

    def parse(self, v: Any, fail) -> tuple | str | None:
        """[i, ...] | first-N | all -> sorted indices, or "all" (the depth is known at plan time)."""
        if v is None:
            return None
        if v == "all":
            return "all"
        if isinstance(v, str):
            m = re.fullmatch(r"first-([0-9]+)", v)
            if not m or int(m.group(1)) < 1:
                raise fail("expected a list of layer indices, first-N or all", v)
            return tuple(range(int(m.group(1))))
        if not isinstance(v, list) or not v or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in v):
            raise fail("expected a non-empty list of layer indices (0-based), first-N or all", v)
        return tuple(sorted(set(v)))

    def for_reference(self, values: list) -> tuple | str | None:
        """Every layer any cell of the model asks for."""
        out = None
        for v in values:
            if v is not None:
                out = v if out is None else "all" if "all" in (out, v) else tuple(sorted(set(out) | set(v)))
        return out

    def describe(self, value):
        return list(value) if isinstance(value, tuple) else value

    def resolve(self, value, cell, facts: dict, prompts: list, fail):
        """ "all" becomes 0..depth-1; an index past the depth is exit 2 before anything runs."""
        depth = facts["depth"]
        if value == "all":
            return tuple(range(depth))
        if max(value) >= depth:
            raise fail(
                f"layers: layer {max(value)} of cell {cell.stack_id}: model {cell.model} has "
                f"{depth} decoder layers (0..{depth - 1})"
            )
        return value

    def side_rows(self, value, fed_positions: list[list[int]], prompt_lengths: list[int]) -> tuple[int, bool]:
        """Each layer and the final norm at every sampled row."""
        return sum(len(p) for p in fed_positions) * (len(value) + 1), True

    def capturer(self, backend, value, writer) -> Capturer:
        return LayersCapturer(backend, value, writer)

    def record(self, parts: list[dict]) -> str | None:
        """cells.layers: indices, depth, the engine's tensor names, rows per repeat."""
        got = parts[-1]
        return json.dumps(
            {
                "layers": got["layers"],
                "depth": got["depth"],
                "rows_per_repeat": got["rows"],
                "sources": got.get("sources"),
            },
            sort_keys=True,
        )

    def analyze(
        self, wh, done: list[CellRow], reference: str | None, force: bool, log, skip_damaged: bool = False
    ) -> dict | None:
        if not any(self.active_in(c) for c in done):
            return None
        from analysis.layer_analysis import analyze_layers

        return analyze_layers(wh, done, reference, force, log)

    def analysis_line(self, la: dict) -> str:
        return (
            f"layer metrics: {la['cells']} cell(s), {la['rows']} layer rows ({la['reused']} up to date); "
            "`matrix layers CELL` for the table and the first failing layer"
        )

    def card(self, db, cell: dict) -> dict | None:
        """The cell's per-layer agreement with its reference (null for a cell without layers)."""
        if not cell.get("layers"):
            return None
        from analysis.card import query_rows

        rows = query_rows(
            db,
            """SELECT layer, layer_index, rows, cosine_min, cosine_mean, norm_ratio_dev_max,
                                        rel_l2_max FROM layer_summary WHERE cell_id = ? ORDER BY layer_index""",
            [cell["cell_id"]],
        )
        recorded = loads(cell["layers"])
        return {
            "recorded": recorded.get("layers"),
            "depth": recorded.get("depth"),
            "sources": recorded.get("sources"),
            "comparison": "each state vs the reference's same (prompt, position, layer), repeat 0; float64",
            "by_layer": rows,
        }

    def card_lines(self, lay: dict) -> list[str]:
        return [
            "",
            f"Per-layer agreement with the reference (layers {lay['recorded']} of {lay['depth']}, "
            "and the final norm's output):",
            "",
            "| state | rows | cosine min | cosine mean | max abs(norm ratio - 1) | max rel L2 |",
            "|---|---|---|---|---|---|",
        ] + [
            f"| {r['layer']} | {r['rows']} | {r['cosine_min']:.6f} | {r['cosine_mean']:.6f} | "
            f"{r['norm_ratio_dev_max']:.3g} | {r['rel_l2_max']:.3g} |"
            for r in lay["by_layer"]
        ]

    def report(self, data: dict) -> str:
        from analysis.report_layers import layers_section

        return layers_section(data.get("layers") or [], data.get("names"), data.get("model_of"))

    def brief(self, value) -> list[str]:
        return []

    @staticmethod
    def bytes_estimate(value: tuple, rows: int, hidden: int, wide: bool) -> dict:
        """What the states will take: rows x (layers + final norm) x hidden at the engine's native width
        (llama.cpp's graph and fp32 stacks: 4 B; bf16/f16 activations: 2 B; zstd barely shrinks hidden
        states: 3.5 B/value on disk for fp32 ones, 1.5 for bf16)."""
        states = len(value) + 1
        return {
            "layers": list(value),
            "rows": rows,
            "states_per_row": states,
            "hidden": hidden,
            "bytes_estimate": rows * states * hidden * (4 if wide else 2),
        }


EXTRA = Layers
