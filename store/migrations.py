"""Numbered warehouse migrations. Each takes the warehouse location (store/location.py) and moves
it up one version.

Only additive changes are allowed (new tables, new nullable columns): readers
use union_by_name, so files written by older versions stay valid as they are.
"""

from __future__ import annotations


def m002_tokenizer_parity(loc) -> None:
    """v2: table tokenizer_parity; cells gain options, artifact*, tokenizer_parity, engine_vocab_size."""
    loc.mkdirs("tokenizer_parity")


def m003_nonfinite_and_centroid_groups(loc) -> None:
    """v3: metrics.nonfinite, centroid_metrics.centroid_group/nonfinite, cells.centroid_group/centroid/calibration.

    Columns only: older files read as null there (the views add missing columns)."""


def m004_rows_delivery(loc) -> None:
    """v4: runs.rows_delivery, cells.rows_via / model_via (sweeps across machines without a shared disk).

    Columns only: older files read as null there."""


def m005_builds_and_replicas(loc) -> None:
    """v5: cells.stack_id / replica / build / build_libraries (the engine build is part of a cell).

    Columns only: a cell captured before v5 has no build (null) and its cell id is its stack id;
    a run counts it as captured by another build (see --reuse-cells-from-other-builds)."""


def m006_failed_cells(loc) -> None:
    """v6: cells.error_class / error / attempts (status failed), runs.cells_failed. Columns only."""


def m007_analysis_kernel_version(loc) -> None:
    """v7: metrics / centroid_metrics / pairwise .kernel_version; each analysis output file keeps the
    content key of its inputs in its Parquet metadata, so `matrix analyze` redoes only what changed.
    Columns only: files written before read as null there and are recomputed on the next analyze."""


def m008_positions_and_storage(loc) -> None:
    """v8: cells.positions (a window of rows per prompt) and cells.storage (native, or rows rounded to
    bf16 with their KL floor in metrics.storage_floor). Columns only: older cells read as null there,
    which means the plain stride form and lossless native rows."""


def m009_layer_states(loc) -> None:
    """v9: tables layer_states (a `layers:` cell's hidden states), layer_metrics and decode_metrics
    (analyze); cells.layers / cells.decode and logits.path / logits.step (a `decode:` cell's rows).
    Columns read as null in older files: no layers, no decode rows, every logits row a capture's."""
    loc.mkdirs("layer_states")
    loc.mkdirs("layer_metrics")
    loc.mkdirs("decode_metrics")


def m010_prefix_cache(loc) -> None:
    """v10: cells.prefix_cache / model_license, decode_metrics.path / cached_tokens (`prefix_cache: check` rows, path
    'prefix_cached' in a cell's d<repeat> file). Columns only: older files read as null there."""


def m011_executor(loc) -> None:
    """v11: runs.executor (ray | local: where the run's cells ran). Columns only: older runs read as
    null there, and ran on Ray."""


def m012_perplexity(loc) -> None:
    """v12: metrics.nll_ref / nll_stack (-log p of the next token, each side), for perplexity.
    Columns only: metrics written before read as null there; `matrix analyze` recomputes them
    (the metric kernel's version is part of each output's key)."""


def m013_values_not_kept(loc) -> None:
    """v13: a logits shard may keep its rows' hashes without their values (store/schema.py
    VALUES_KEY, `keep_rows: references`). Nothing to rewrite: every shard before keeps its values."""


def m014_reference_confidence(loc) -> None:
    """v14: metrics.p_top1_ref (the reference's top-1 probability, for kld_by_confidence). Columns only:
    metrics written before read as null there; `matrix analyze` recomputes them (the metric kernel's
    version is part of each output's key)."""


# target version -> migration
MIGRATIONS = {
    2: m002_tokenizer_parity,
    3: m003_nonfinite_and_centroid_groups,
    4: m004_rows_delivery,
    5: m005_builds_and_replicas,
    6: m006_failed_cells,
    7: m007_analysis_kernel_version,
    8: m008_positions_and_storage,
    9: m009_layer_states,
    10: m010_prefix_cache,
    11: m011_executor,
    12: m012_perplexity,
    13: m013_values_not_kept,
    14: m014_reference_confidence,
}
