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


# target version -> migration
MIGRATIONS = {2: m002_tokenizer_parity, 3: m003_nonfinite_and_centroid_groups, 4: m004_rows_delivery}
