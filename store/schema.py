"""Warehouse schema, version 17: the current tables and columns. What each version changed, and
how an older warehouse is brought up to this one: store/migrations.py.

Layout (one directory per table; readers glob ``*.parquet``; writers go
through a hidden temp file and an atomic rename, so a killed run never leaves
a half-written file that a reader sees)::

    WAREHOUSE.json                      {"format": "logit-matrix-warehouse", "schema_version": 17}
    runs/<run_id>.parquet               one row per `matrix run` that had work to do
    cells/<cell_id>.parquet             one row per completed cell (rewritten on resume)
    prompts/<prompt_id>.parquet         one row per tokenised prompt
    tokenizer_parity/<cell_id>.parquet  one row per (cell, prompt): the engine's own tokenizer vs the canonical ids
    metrics/<cell_id>.parquet           `matrix analyze`: each row of each repeat vs the reference
    centroid_metrics/<model>[.<group>].parquet  `matrix analyze`: each stack vs the centroid of its group
    pairwise/<model>[.<group>].parquet  `matrix analyze`: every pair of stacks in a centroid group
    metrics_ranges/ranges.parquet       position buckets for the summary views
    logits/<cell_id>/r<repeat>.parquet  one shard per (cell, repeat), one row group per prompt
    logits/<cell_id>/d<repeat>.parquet  a `decode:` cell's decode rows and the prefill rows they match,
                                        and a `prefix_cache:` cell's cached-prefix rows
    layer_states/<cell_id>/r<repeat>.parquet  a `layers:` cell's hidden states, shard for shard with logits
    layer_metrics/<cell_id>.parquet     `matrix analyze`: each layer row vs the reference's same layer
    <plug-in table>/...                 a plug-in's own tables, e.g. its graded metrics (extras/)

``logits.logits`` holds the engine's native values widened exactly to float32
(bf16 and f16 are subsets of fp32), so SQL sees real numbers for every stack;
``logits_dtype`` names the native type and ``row_hash`` is the sha256 of the
native bytes (bf16: the uint16 bits, little-endian). Byte-stream-split + zstd:
for bf16 rows the two low byte streams are all zero and cost almost nothing.

A logits shard whose Parquet footer says ``logit_matrix.values: not kept``
(VALUES_KEY) holds every row's prompt, position, next token, dtype, shift and
``row_hash`` with ``logits`` null: a cell under ``keep_rows: references``, its
rows measured against the reference and hashed where they were captured, their
values not stored (llama-perplexity keeps no candidate's logits either).

A logits shard whose footer has ``logit_matrix.refused_rows`` (REFUSED_KEY) lacks the rows of the
prompts it names: the engine refused every length they could be fed (a pinned SDPA kernel that
runs some sequence lengths only); ``cells.length_refusals`` says the same, with the prompts that
were fed a longer prefix than their rows need.
"""

import json
from collections.abc import Mapping

import pyarrow as pa

from common import plugins

SCHEMA_VERSION = 19
FORMAT = "logit-matrix-warehouse"
TS = pa.timestamp("us", tz="UTC")

RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("status", pa.string()),  # running | done | failed | interrupted
        ("started_at", TS),
        ("finished_at", TS),
        ("spec_name", pa.string()),
        ("spec_path", pa.string()),
        ("spec_sha256", pa.string()),
        ("spec_yaml", pa.string()),
        ("argv", pa.string()),
        ("host", pa.string()),
        ("pid", pa.int64()),
        ("ray_address", pa.string()),
        ("logit_matrix_version", pa.string()),
        ("schema_version", pa.int32()),
        ("versions", pa.string()),  # JSON: every library version
        ("cells_total", pa.int32()),
        ("cells_done", pa.int32()),
        ("rows_written", pa.int64()),
        ("error", pa.string()),
        # JSON: where this run's rows went: {"node": captures written by the node that ran them,
        # "driver": captures sent to the driver's depot (no shared disk), "bytes_to_driver": encoded bytes}
        ("rows_delivery", pa.string()),
        ("cells_failed", pa.int32()),  # cells this run recorded as failed
        ("executor", pa.string()),  # ray | local (matrix/run/launch.py); ray_address is null for local
    ]
)

CELLS = pa.schema(
    [
        ("cell_id", pa.string()),
        ("run_id", pa.string()),
        ("model", pa.string()),
        ("engine", pa.string()),
        ("dtype", pa.string()),
        ("attention", pa.string()),
        ("tp", pa.int32()),
        ("device", pa.string()),
        ("status", pa.string()),  # done | skipped | failed
        ("skip_reason", pa.string()),
        ("bit_reproducible", pa.bool_()),
        ("repeats", pa.int32()),
        ("rows_per_repeat", pa.int32()),
        ("n_prompts", pa.int32()),
        ("stride", pa.int32()),
        ("max_tokens", pa.int32()),  # null: whole prompts
        ("threads", pa.int32()),
        ("corpus", pa.string()),
        ("bos_policy", pa.string()),
        ("is_reference", pa.bool_()),
        ("reference_cell_id", pa.string()),
        ("model_identity", pa.string()),
        ("model_source", pa.string()),
        ("source_sha256", pa.string()),
        ("weights_sha256", pa.string()),
        ("model_license", pa.string()),  # the license of the reference weights' source, when known
        ("vocab_size", pa.int32()),
        ("logits_dtype", pa.string()),
        # The engine's own weights, built from the reference checkpoint (GGUF, MLX dir, ...)
        ("artifact", pa.string()),
        ("artifact_sha256", pa.string()),
        ("artifact_recipe", pa.string()),  # JSON: tool, tool version, source sha256, settings
        ("tokenizer_parity", pa.string()),  # ok | mismatch | not_checked
        ("engine_vocab_size", pa.int32()),  # logits per row; > vocab_size means a padded vocabulary
        ("options", pa.string()),  # JSON: engine options asked for in the spec
        ("centroid_group", pa.string()),  # which centroid this stack joins (default: its model's)
        ("centroid", pa.string()),  # the spec's centroid definition: mean_prob | mean_logprob
        ("calibration", pa.string()),  # calibration data the spec declares for this artefact
        ("fingerprint", pa.string()),  # JSON: host, OS, Python, libraries, CPU flags, GPU (SMs, driver, ...)
        ("settings", pa.string()),  # JSON: everything that changes the arithmetic
        ("versions", pa.string()),  # JSON: engine library versions
        ("host", pa.string()),
        ("node_id", pa.string()),
        ("rows_via", pa.string()),  # node (it wrote its shards) | driver (it sent them to the driver's depot)
        ("model_via", pa.string()),  # local (the node's own copy, hash checked) | shipped (from the driver) | hub
        ("load_seconds", pa.float64()),
        ("capture_seconds", pa.float64()),
        ("finished_at", TS),
        # a cell is a stack (what the spec names, the same on every host and build) run by one
        # engine build (common/builds.py) as one of the spec's replicas: cell_id = stack_id[.rN]@build
        ("stack_id", pa.string()),
        ("replica", pa.int32()),
        ("build", pa.string()),
        ("build_libraries", pa.string()),  # JSON: {library: {version, files}}
        # a failed cell: the original exception's class and first line; attempts: how many times
        # this run started the cell (an actor or node that died is retried; see matrix/run/failures.py)
        ("error_class", pa.string()),
        ("error", pa.string()),
        ("attempts", pa.int32()),
        # JSON: the rows each prompt keeps, {"from", "to", "stride", "last"} (common/positions.py)
        ("positions", pa.string()),
        # JSON: how the rows are stored: {"store": "native"} (lossless) or {"store": "bf16", ...}
        ("storage", pa.string()),
        # the cell whose load put the weights this cell ran on in its host (`hosts: shared`: it took the
        # loaded model over, and load_seconds is the switch's); null: the cell loaded them itself
        ("loaded_by", pa.string()),
        # JSON: forwards the engine refused for their length (a pinned SDPA kernel that runs some sequence
        # lengths only; actors/capture.py feed()): {"longer_feeds": {prompt: {"needed", "fed", "refused":
        # [lengths], "reason"}}, "skipped": {prompt: {"rows", "refused", "reason"}}, "skipped_rows",
        # "repeats"}, or {"by_repeat": {repeat: that}} where repeats differ; null: none refused
        ("length_refusals", pa.string()),
    ]
)

PROMPTS = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("model", pa.string()),
        ("corpus", pa.string()),
        ("name", pa.string()),
        ("category", pa.string()),
        ("source", pa.string()),
        ("text", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("n_tokens", pa.int32()),
        ("ids_sha256", pa.string()),
        ("bos_policy", pa.string()),
        ("bos_added", pa.bool_()),
        ("starts_with_bos", pa.bool_()),
        ("tokenizer_sha256", pa.string()),
        # sha256 of the text the prompt comes from: a file's bytes (what sha256sum gives), an inline
        # text's UTF-8, a chat's JSON, an ids file's bytes; a model card's dataset revision
        ("source_sha256", pa.string()),
    ]
)

# A logits shard's footer key: NOT_KEPT where its rows are hashed but their values not stored.
VALUES_KEY, NOT_KEPT = b"logit_matrix.values", b"not kept"
# A logits shard's footer key, where the engine refused every length a prompt could be fed
# (actors/capture.py feed()): JSON {prompt_id: {"rows", "refused": [lengths], "reason"}}, the
# prompts whose rows the shard leaves out. Absent: it holds every row the cell keeps.
REFUSED_KEY = b"logit_matrix.refused_rows"


def refused_prompts(file_metadata: dict | None) -> dict[str, dict]:
    """{prompt_id: what was refused} from a shard's footer key-value metadata ({} for most)."""
    raw = (file_metadata or {}).get(REFUSED_KEY)
    return json.loads(raw) if raw else {}


def keeps_values(schema: pa.Schema) -> bool:
    """False for a logits shard's schema (as its footer has it) whose rows keep no values."""
    return (schema.metadata or {}).get(VALUES_KEY) != NOT_KEPT


LOGITS = pa.schema(
    [
        ("run_id", pa.string()),
        ("cell_id", pa.string()),
        ("prompt_id", pa.string()),
        ("position", pa.int32()),
        ("next_token_id", pa.int32()),  # null at the last position
        ("repeat", pa.int32()),
        ("logits_dtype", pa.string()),
        ("logits", pa.list_(pa.float32())),  # (vocab,) native values, exactly widened
        ("row_hash", pa.string()),
        # what was subtracted from the row before it was stored (`store: bf16` stores bf16 of
        # logits - row max); null: stored as the engine produced it. Raw logits = logits + shift.
        ("shift", pa.float32()),
        # null for a capture's rows (logits/<cell>/r<repeat>.parquet). A `decode:` cell's d<repeat>.parquet holds,
        # at each position it decoded, path 'decode' (the row of decode step `step`, fed one token at a
        # time from the KV cache of the prefill up to position - step) and path 'prefill' (the same position
        # from the capture's own prefill), so the two compare within the file; a `prefix_cache:` cell's
        # adds, at step 0, path 'prefix_cached' (the row recomputed with the engine's prefix cache warm from
        # the same prompt) and path 'prefill' (the capture's own row there).
        ("path", pa.string()),
        ("step", pa.int32()),
    ]
)

TOKENIZER_PARITY = pa.schema(
    [
        ("cell_id", pa.string()),
        ("run_id", pa.string()),
        ("engine", pa.string()),
        ("prompt_id", pa.string()),
        ("match", pa.bool_()),
        ("first_diff", pa.int32()),  # first differing position, null when equal
        ("diagnosis", pa.string()),  # ok | double BOS | missing BOS | extra BOS | vocab mismatch | different ids
        ("n_canonical", pa.int32()),
        ("n_engine", pa.int32()),
        ("engine_ids_head", pa.list_(pa.int32())),  # the engine's first ids, for the report
        ("checked_with", pa.string()),  # which tokenizer call, with which flags
    ]
)

F64 = pa.float64()
METRICS = pa.schema(
    [
        ("cell_id", pa.string()),
        ("reference_cell_id", pa.string()),
        ("prompt_id", pa.string()),
        ("position", pa.int32()),
        ("repeat", pa.int32()),
        ("kld", F64),
        ("kld_reverse", F64),
        ("js", F64),  # KL(P_ref||P_stack), KL(P_stack||P_ref), JS; nats
        ("top1_match", pa.bool_()),
        ("top5_overlap", F64),
        ("top10_overlap", F64),
        ("spearman_top10", F64),
        ("cosine", F64),
        ("norm_ratio", F64),
        ("nmse", F64),
        ("max_abs_diff", F64),  # on raw logits
        ("delta_p", F64),  # p_stack(next token) - p_ref(next token); null at the last position
        ("nll_ref", F64),
        ("nll_stack", F64),  # -log p(next token) of each side (perplexity); null at the last
        ("entropy_ref", F64),
        ("entropy_stack", F64),
        ("p_top1_ref", F64),  # the reference's top-1 probability (common/metric_defs.py: kld_by_confidence)
        ("storage_floor", F64),  # KL(native || stored): 0 while the warehouse is lossless
        # null for a clean row; 'stack' | 'reference' | 'both' when that side has NaN/Inf logits.
        # Such a row's metrics are null, so aggregates skip it; summaries count it.
        ("nonfinite", pa.string()),
        ("kernel_version", pa.string()),  # analysis/metrics.py KERNEL_VERSION that wrote the file
    ]
)
CENTROID_METRICS = pa.schema(
    [
        ("cell_id", pa.string()),
        ("prompt_id", pa.string()),
        ("position", pa.int32()),
        ("n_stacks", pa.int32()),  # stacks that captured this row and form its centroid
        ("kld_centroid_stack", F64),
        ("kld_stack_centroid", F64),
        ("js_centroid", F64),
        ("centroid", pa.string()),  # mean_prob | mean_logprob
        ("is_reference", pa.bool_()),
        ("centroid_group", pa.string()),  # which centroid this stack joins
        ("nonfinite", pa.bool_()),  # this stack's row has NaN/Inf: left out of the centroid
        ("kernel_version", pa.string()),  # analysis/metrics.py KERNEL_VERSION that wrote the file
    ]
)
PAIRWISE = pa.schema(
    [
        ("cell_a", pa.string()),
        ("cell_b", pa.string()),
        ("rows", pa.int64()),
        ("mean_js", F64),
        ("top1_agreement", F64),
        ("kernel_version", pa.string()),  # analysis/metrics.py KERNEL_VERSION that wrote the file
    ]
)
METRICS_RANGES = pa.schema([("lo", pa.int32()), ("hi", pa.int32()), ("range", pa.string())])

# the residual stream after decoder layer `layer_index` (0-based) at a sampled position, as the
# engine holds it (native dtype, widened exactly to float32 like logits); the final norm's output is
# layer "final_norm" with layer_index = the model's depth. `source`: the engine's own name for the
# tensor (llama.cpp l_out-N, an HF module path, ...). One row group per prompt: layer-major.
LAYER_STATES = pa.schema(
    [
        ("run_id", pa.string()),
        ("cell_id", pa.string()),
        ("prompt_id", pa.string()),
        ("position", pa.int32()),
        ("repeat", pa.int32()),
        ("layer", pa.string()),
        ("layer_index", pa.int32()),
        ("source", pa.string()),
        ("dtype", pa.string()),
        ("values", pa.list_(pa.float32())),  # (hidden,)
        ("row_hash", pa.string()),  # sha256 of the native bytes, as logits.row_hash
    ]
)
# `matrix analyze`: a layer row against the reference's same (prompt, position, layer), repeat 0;
# its cosine and norm ratio gate it (`matrix layers`), the others are reported
LAYER_METRICS = pa.schema(
    [
        ("cell_id", pa.string()),
        ("reference_cell_id", pa.string()),
        ("prompt_id", pa.string()),
        ("position", pa.int32()),
        ("repeat", pa.int32()),
        ("layer", pa.string()),
        ("layer_index", pa.int32()),
        ("cosine", F64),
        ("norm_ratio", F64),  # ||stack|| / ||ref||
        ("rel_l2", F64),
        ("max_abs_diff", F64),
        ("allclose", pa.bool_()),  # atol = rtol = 2e-2, reported only
        ("kernel_version", pa.string()),
    ]
)

# `matrix analyze`: each decode row of a `decode:` cell against the same position's prefill row of
# the same cell (prefill/decode consistency) and against the reference's prefill row
DECODE_METRICS = pa.schema(
    [
        ("cell_id", pa.string()),
        ("reference_cell_id", pa.string()),
        ("prompt_id", pa.string()),
        ("position", pa.int32()),
        ("step", pa.int32()),
        ("repeat", pa.int32()),
        # 'decode' or 'prefix_cached'; the leading tokens a prefix cache
        # served for a 'prefix_cached' row
        ("path", pa.string()),
        ("cached_tokens", pa.int32()),
        ("kld_vs_prefill", F64),
        ("max_abs_diff_vs_prefill", F64),
        ("top1_match_prefill", pa.bool_()),
        ("identical_to_prefill", pa.bool_()),  # the decode row's bytes equal the prefill row's
        ("kld", F64),
        ("top1_match", pa.bool_()),  # decode row vs the reference's prefill row: KL(P_ref || P_decode)
        ("kld_prefill", F64),  # this cell's prefill row vs the same reference row, for the side-by-side
        ("kernel_version", pa.string()),
    ]
)

CORE_TABLES = {
    "runs": RUNS,
    "cells": CELLS,
    "prompts": PROMPTS,
    "logits": LOGITS,
    "tokenizer_parity": TOKENIZER_PARITY,
    "metrics": METRICS,
    "centroid_metrics": CENTROID_METRICS,
    "pairwise": PAIRWISE,
    "metrics_ranges": METRICS_RANGES,
    "layer_states": LAYER_STATES,
    "layer_metrics": LAYER_METRICS,
    "decode_metrics": DECODE_METRICS,
}


class _Tables(Mapping):
    """Every table: the core's, then the plug-ins' own (common/plugins.py); the cells table gains
    the columns the plug-ins record after the core's. Read on each use, so an outside plug-in
    found after this module was imported is there too."""

    def _all(self) -> dict[str, pa.Schema]:
        extra = plugins.provider.columns()
        cells = pa.schema([*CORE_TABLES["cells"], *(pa.field(n, t) for n, t in extra)])
        return {**CORE_TABLES, "cells": cells, **plugins.provider.tables()}

    def __getitem__(self, name: str) -> pa.Schema:
        return self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


TABLES: Mapping[str, pa.Schema] = _Tables()
