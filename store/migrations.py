"""The warehouse schema's versions: what each one changed, and what brings a warehouse of the
version before up to it. store/schema.py describes the current schema only; this table is the one
place that says what changed in version N (CHANGELOG.md lists the same, briefly).

Only additive changes are allowed (new tables, new nullable columns): readers use union_by_name,
so files written by older versions stay valid as they are, their missing columns read as null.
Most versions therefore change no data: their entry's `step` is None, and migrating to them only
rewrites the marker (WAREHOUSE.json). A version that needs its warehouse changed (a new table's
directory) names the function that does it; it takes the warehouse location (store/location.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Migration:
    name: str
    changed: str  # what this version changed, and what older files read as there
    step: Callable[[Any], None] | None = None  # the data change to reach it; None: readers take older files as they are

    def apply(self, loc) -> None:
        if self.step is not None:
            self.step(loc)


def tokenizer_parity_table(loc) -> None:
    """The tokenizer_parity table's directory."""
    loc.mkdirs("tokenizer_parity")


def layer_and_decode_tables(loc) -> None:
    """The directories of the tables layer_states, layer_metrics and decode_metrics."""
    loc.mkdirs("layer_states")
    loc.mkdirs("layer_metrics")
    loc.mkdirs("decode_metrics")


def batch_metrics_table(loc) -> None:
    """The batch_metrics table's directory."""
    loc.mkdirs("batch_metrics")


def plugin_tables(loc) -> None:
    """The directory of every table the installed plug-ins declare (extras/: Extra.tables)."""
    from store.schema import CORE_TABLES, TABLES

    for name in TABLES:
        if name not in CORE_TABLES:
            loc.mkdirs(name)


# target version -> what it changed (version 1 is the first warehouse: nothing before it)
MIGRATIONS = {
    2: Migration(
        "tokenizer_parity",
        "table tokenizer_parity (one row per cell and prompt: the engine's own tokenizer against the canonical "
        "ids); cells gain options, artifact, artifact_sha256, artifact_recipe, tokenizer_parity, engine_vocab_size.",
        tokenizer_parity_table,
    ),
    3: Migration(
        "nonfinite_and_centroid_groups",
        "metrics.nonfinite (which side of a row has NaN/Inf logits; that row's metrics are null), "
        "centroid_metrics.centroid_group / nonfinite, cells.centroid_group / centroid / calibration / fingerprint. "
        "Columns only: older files read as null there (the views add missing columns).",
    ),
    4: Migration(
        "rows_delivery",
        "runs.rows_delivery (where a run's rows went: written by the node, or sent to the driver's depot), "
        "cells.rows_via / model_via: sweeps across machines without a shared disk. "
        "Columns only: older files read as null there.",
    ),
    5: Migration(
        "builds_and_replicas",
        "cells.stack_id / replica / build / build_libraries: a cell is a stack run by one engine build "
        "(common/builds.py) as one of the spec's replicas, cell_id = stack_id[.rN]@build. Columns only: a cell "
        "captured before has no build (null) and its cell id is its stack id; a run counts it as captured by "
        "another build (see --reuse-cells-from-other-builds).",
    ),
    6: Migration(
        "failed_cells",
        "cells.status `failed` with cells.error_class / error / attempts, runs.cells_failed. Columns only.",
    ),
    7: Migration(
        "analysis_kernel_version",
        "metrics / centroid_metrics / pairwise .kernel_version; each analysis output file keeps the content key "
        "of its inputs in its Parquet metadata, so `matrix analyze` redoes only what changed. Columns only: "
        "files written before read as null there and are recomputed on the next analyze.",
    ),
    8: Migration(
        "positions_and_storage",
        "cells.positions (a window of rows per prompt), cells.storage (native, or rows rounded to bf16), "
        "logits.shift (what was subtracted before a bf16 row was stored) and metrics.storage_floor (the KL "
        "that rounding costs). Columns only: older cells read as null there, which means the plain stride "
        "form and lossless native rows.",
    ),
    9: Migration(
        "layer_states",
        "tables layer_states (a `layers:` cell's hidden states), layer_metrics and decode_metrics (analyze); "
        "cells.layers / cells.decode, logits.path / logits.step and logits/<cell>/d<repeat>.parquet (a "
        "`decode:` cell's rows). Older files read as null there: no layers, no decode rows, every logits row "
        "a capture's.",
        layer_and_decode_tables,
    ),
    10: Migration(
        "prefix_cache",
        "cells.prefix_cache / model_license, decode_metrics.path / cached_tokens (`prefix_cache: check` rows, "
        "path 'prefix_cached' in a cell's d<repeat> file). Columns only: older files read as null there; a "
        "version 9 decode_metrics row's null path means 'decode'.",
    ),
    11: Migration(
        "executor",
        "runs.executor (ray | local: where the run's cells ran). Columns only: older runs read as null there, "
        "and ran on Ray.",
    ),
    12: Migration(
        "perplexity",
        "metrics.nll_ref / nll_stack (-log p of the next token, each side), for perplexity. Columns only: "
        "metrics written before read as null there; `matrix analyze` recomputes them (the metric kernel's "
        "version is part of each output's key).",
    ),
    13: Migration(
        "values_not_kept",
        "a logits shard may keep its rows' hashes without their values (store/schema.py VALUES_KEY, "
        "`keep_rows: references`). Nothing to rewrite: every shard before keeps its values.",
    ),
    14: Migration(
        "reference_confidence",
        "metrics.p_top1_ref (the reference's top-1 probability, for kld_by_confidence). Columns only: metrics "
        "written before read as null there; `matrix analyze` recomputes them (the metric kernel's version is "
        "part of each output's key).",
    ),
    15: Migration(
        "shared_hosts_and_length_refusals",
        "cells.loaded_by (the cell whose load put the weights a cell ran on in its host, under `hosts: shared`); "
        "cells.length_refusals (forwards the engine refused for their length: the prompts fed a longer prefix, "
        "and those whose rows were left out, with the engine's reason), and a logits shard's footer key "
        "logit_matrix.refused_rows (store/schema.py REFUSED_KEY) naming the prompts whose rows it lacks. "
        "Columns only: older cells read as null there (each loaded its own, none refused), and every shard "
        "before holds all its rows.",
    ),
    16: Migration(
        "batch_axis",
        "cells.batch_size / batch / batch_of (a `batch:` cell: each prompt evaluated in one forward with "
        "batch_size - 1 other sequences, and the stack id of the same stack at batch 1); table batch_metrics "
        "(analyze: a batch cell's rows against that batch-1 cell's). Older cells read as null there: batch-free.",
        batch_metrics_table,
    ),
    17: Migration(
        "plugin_columns",
        "the plug-ins (extras/) declare their cells columns and tables: cells.kv_cache_of (a cell on a KV cache "
        "other than f16: the stack id of the same stack on the f16 cache) and table kv_cache_metrics (analyze: "
        "its rows against that cell's), beside batch's. Older cells read as null there (no partner); the "
        "directory of each plug-in table is made.",
        plugin_tables,
    ),
    18: Migration(
        "prompt_sources",
        "prompts.source_sha256 (the sha256 of the text a prompt comes from, a model card's dataset revision). "
        "Columns only: older prompts read as null there, and a card of theirs names no text hash.",
    ),
    19: Migration(
        "cpu_paths",
        "cells.cpu_path_of (a cell off the reference hardware, another CPU code path, extras/cpu_path.py, or "
        "another device: the stack id of the same stack on the reference hardware) and tables "
        "hardware_metrics (analyze: its rows against that cell's) and hardware_layers (its layer states "
        "against that cell's, where both recorded them). Older cells read as null there (no partner); the "
        "tables' directories are made.",
        plugin_tables,
    ),
}
