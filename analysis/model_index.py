"""A card's figures as the `model-index` of a Hugging Face model card's front matter, the structured
results the Hub reads (huggingface_hub's ModelCardData.eval_results parses it back): the KL
statistics and the PPL ratio, measured on the text (`dataset`: its name, its sha256 as revision),
each metric carrying the reference file's sha256, the context length and the tool version (`args`)."""

from __future__ import annotations

import re
from typing import Any

from common.errors import UserError

TASK = {"type": "text-generation", "name": "KL divergence against the reference"}
# (the card's number, metric type, metric name)
METRICS = (
    ("kld_mean", "kl_divergence", "Mean KL divergence (nats)"),
    ("kld_stderr", "kl_divergence_stderr", "Standard error of the mean KL divergence"),
    ("kld_median", "kl_divergence_median", "Median KL divergence (nats)"),
    ("kld_p99", "kl_divergence_p99", "99th percentile KL divergence (nats)"),
    ("kld_max", "kl_divergence_max", "Maximum KL divergence (nats)"),
    ("top1_agreement", "same_top_p", "Same top token as the reference"),
    ("ppl_ratio", "perplexity_ratio", "PPL(candidate) / PPL(reference)"),
)
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def model_index(card: dict, tool: str) -> dict[str, Any]:
    """{"model-index": [...]} for the card's candidate; tool: the name and version that measured it."""
    text = card["disclosure"]["evaluation_text"]
    if not text.get("text_sha256"):
        raise UserError(
            f"card {card['cell_id']}: its prompts record no sha256 of their text (captured before prompts "
            "recorded one); capture it again for a model-index"
        )
    args = {
        "reference_sha256": reference_sha256(card["disclosure"]["reference_checkpoint"]),
        "n_ctx": card["disclosure"]["context_lengths"]["max"],
        "tool": tool,
    }
    numbers = card["numbers"]
    metrics = [
        {"type": kind, "name": name, "value": numbers[key], "args": dict(args), "verified": False}
        for key, kind, name in METRICS
        if numbers.get(key) is not None
    ]
    dataset = {"name": text["text_name"], "type": text["text_name"], "revision": text["text_sha256"]}
    return {"model-index": [{"name": _name(card), "results": [{"task": TASK, "dataset": dataset, "metrics": metrics}]}]}


def reference_sha256(checkpoint: dict) -> str | None:
    """The sha256 of the file the reference came from (a GGUF's), else of its checkpoint's weights."""
    return next(
        (v for v in (checkpoint.get("source_sha256"), checkpoint.get("weights_sha256")) if SHA256.match(str(v))),
        None,
    )


def _name(card: dict) -> str:
    """The candidate as a model card names it: its file's label, else its cell id."""
    artifact = card["disclosure"].get("candidate_artifact") or {}
    return artifact.get("label") or artifact.get("file") or card["cell_id"]
