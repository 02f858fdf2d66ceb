"""What a model card discloses about a cell (analysis/card.py): the reference checkpoint, both
runtimes, the evaluation text, the candidate artefact and its calibration, context lengths, sampled
positions, KL direction, vocabulary truncation, aggregation, storage floor and reproducibility.

Every field is read from the cell's and its reference's warehouse rows; one that is unknown is None,
and the card decides whether that fails it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from typing import Any

from common import plugins
from common import positions as P


def _json(s: str | None) -> dict:
    return json.loads(s) if s else {}


def calibration(cell: dict, as_is: Collection[str]) -> str | None:
    """What the artefact was calibrated on: declared in the spec, or known from its recipe.
    as_is: the engines whose cells without a recipe run the reference checkpoint's own weights."""
    if cell.get("calibration"):
        return cell["calibration"]
    recipe = _json(cell.get("artifact_recipe"))
    tool = recipe.get("tool")
    if tool == "llama_model_quantize":
        im = recipe.get("imatrix")
        if im is None:
            return "none: llama.cpp round-to-nearest quantisation, no importance matrix"
        return (
            f"importance matrix (sha256 {im['sha256']}) from calibration text {im['calibration']} "
            f"(sha256 {im['calibration_sha256']}, {im['tokens']} tokens, {im['chunks']} chunks of "
            f"{im['ctx']} = {im['tokens_used']} tokens used), {im['tool']} {im['llama_cpp_python']}"
        )
    if tool in ("torchao", "optimum-quanto"):
        return f"none: {tool} {recipe.get('weights')} weight-only round-to-nearest at load, {recipe.get('config')}"
    if tool == "convert_hf_to_gguf.py":
        return "none: float conversion of the reference weights"
    if tool == "mlx_lm.convert":
        return (
            f"none: mlx_lm affine round-to-nearest, {recipe['q_bits']}-bit, group {recipe['q_group_size']}"
            if recipe.get("q_bits")
            else "none: float conversion of the reference weights"
        )
    if tool is None and cell["engine"] in as_is:
        return f"none: the reference checkpoint's weights at {cell['dtype']}"
    if tool == "published artifact" and recipe.get("kind") == "hf checkpoint":
        q = recipe.get("quantization_config")
        return (
            f"per the checkpoint's config: quantization_config {q}"
            if q
            else "none recorded: the checkpoint's config has no quantization_config; declare `calibration:` on the "
            "candidate if the publisher says otherwise"
        )
    if tool == "published artifact":  # what the file's own header says llama-quantize used
        im = recipe.get("imatrix")
        if im:
            return "importance matrix, per the file's header: " + ", ".join(f"{k} {v}" for k, v in sorted(im.items()))
        return (
            "no importance matrix recorded in the file's header (llama-quantize writes quantize.imatrix.* "
            "when it uses one); declare `calibration:` on the candidate if the publisher says otherwise"
        )
    return None  # e.g. a file used as shipped: only its publisher knows


def artifact(cell: dict) -> dict:
    """What the candidate ran: a published file (its hash and where it came from), or what built it."""
    recipe = _json(cell.get("artifact_recipe"))
    if recipe.get("tool") == "published artifact" and recipe.get("kind") == "hf checkpoint":
        return {
            "kind": "published artifact (HF checkpoint)",
            "source": recipe.get("source"),
            "sha256": cell.get("artifact_sha256") or "none: loaded from the hub by id and revision",
            "hash_of": "the safetensors files (name + sha256, in name order)",
            "dtype": cell["dtype"],
            "config_dtype": recipe.get("config_dtype"),
            "quantization_config": recipe.get("quantization_config") or "none",
            **({"label": recipe["label"]} if recipe.get("label") else {}),
        }
    if recipe.get("tool") == "published artifact":
        return {
            "kind": "published artifact",
            "file": recipe.get("file"),
            "sha256": cell.get("artifact_sha256"),
            "source": recipe.get("source"),
            "declared_quant": recipe.get("declared_quant"),
            **({"label": recipe["label"]} if recipe.get("label") else {}),
            # llama-quantize --tensor-type-file lines that rebuild it, where this project quantised it
            **({"tensor_type_lines": recipe["tensor_types"]} if recipe.get("tensor_types") else {}),
        }
    if not recipe:  # HF, vLLM, TensorRT-LLM: the engine loads the reference checkpoint itself
        return {"kind": f"the reference checkpoint itself, loaded by {cell['engine']} at {cell['dtype']}"}
    in_memory = cell.get("artifact") is None  # torchao / quanto: quantised at load, no file
    return {
        "kind": f"built by logit-matrix ({recipe.get('tool')})",
        "sha256": cell.get("artifact_sha256")
        or ("none: quantised in memory at load from the reference weights" if in_memory else None),
    }


def _driver(cell: dict) -> str | None:
    if cell["device"] == "cpu":
        return "none (CPU)"
    fp = _json(cell.get("fingerprint"))
    nv, amd = fp.get("nvidia") or {}, fp.get("rocm") or {}
    if nv.get("status") == "ok":
        return f"NVIDIA driver {nv.get('driver')}, CUDA {nv.get('cuda_driver')}"
    if amd.get("status") == "ok" or amd.get("rocm_version"):
        return f"ROCm {amd.get('rocm_version', 'unknown version')}"
    return None


def hardware(cell: dict) -> str | None:
    """One line: CPU model, cores, wide-vector flags; the GPUs when the cell ran on one."""
    fp = _json(cell.get("fingerprint"))
    if not fp:
        return None
    cpu = fp.get("cpu") or {}
    flags = sorted(
        f for f, on in (cpu.get("flags") or {}).items() if on and f.startswith(("avx512", "amx", "sve", "sme"))
    )
    out = f"{cpu.get('model')} ({cpu.get('logical_cores')} cores{', ' + ' '.join(flags) if flags else ''})"
    gpus = (fp.get("nvidia") or {}).get("gpus") or []
    if cell["device"] != "cpu" and gpus:
        g = gpus[0]
        out += f"; {g.get('name')} x{len(gpus)}, {g.get('sm_count')} SMs, sm_{g.get('compute_capability')}"
    return out


def _positions_rule(cell: dict) -> str:
    """The cell's kept positions in words (an imported or pre-v8 cell has the plain stride form)."""
    return P.from_dict(_json(cell.get("positions")) or None, cell.get("stride") or 1).describe()


def _runtime(cell: dict, as_is: Collection[str]) -> dict[str, Any]:
    s = _json(cell.get("settings"))
    build = {
        k: s[k]
        for k in (
            "system_info",
            "cpu_capability",
            "mkldnn",
            "gguf_tensor_types",
            "kv_cache_k",  # what llama.cpp's K and V caches held (common/kv_cache.py)
            "kv_cache_v",
            "n_batch",
            "n_ubatch",
            "torch_dtype",
            "deterministic_algorithms",
            "activations",
            "quantized_matmul",
        )
        if s.get(k) is not None
    }
    return {
        "cell_id": cell["cell_id"],
        "engine": cell["engine"],
        "libraries": _json(cell.get("versions")) or None,
        "build": build or None,
        "device": cell["device"],
        "hardware": hardware(cell),
        "driver": _driver(cell),
        "host": cell.get("host"),
        "threads": cell.get("threads"),
        "dtype": cell["dtype"],
        "attention": cell["attention"],
        "tp": cell["tp"],
        "artifact_sha256": cell.get("artifact_sha256")
        or ("none: the checkpoint itself" if cell["engine"] in as_is else None),
    }


def _reference_checkpoint(ref: dict) -> dict:
    return {
        "identity": ref.get("model_identity"),
        # a GGUF run as it is, never dequantised: the file is the checkpoint
        "weights_sha256": ref.get("weights_sha256")
        or ("none: the GGUF file itself (source_sha256)" if ref.get("source_sha256") else None),
        # a GGUF-sourced checkpoint also names the file it was dequantised from
        "source": ref.get("model_source"),
        **({"source_sha256": ref["source_sha256"]} if ref.get("source_sha256") else {}),
    }


def _evaluation_text(cell: dict, prompts: list) -> dict:
    """The corpus the rows came from: its prompts by category and a hash of their token ids."""
    cats: dict[str, int] = {}
    for p in prompts:
        cats[p["category"]] = cats.get(p["category"], 0) + 1
    ids_hash = hashlib.sha256("".join(p["ids_sha256"] for p in prompts).encode()).hexdigest()
    return {
        "corpus": cell.get("corpus"),
        **_text(prompts),
        "prompts": len(prompts),
        "categories": cats,
        "token_ids_sha256": ids_hash,
        "bos_policy": cell.get("bos_policy"),
        "tokenizer_parity": cell.get("tokenizer_parity"),
    }


def _text(prompts: list) -> dict:
    """The text the prompts come from: where they share one (`matrix kld`'s text file), its name
    (the corpus entry's `source`) and sha256 (of the file's bytes, as sha256sum gives it); else the
    corpus's name and a sha256 over its texts' in prompt order. None where a prompt records none."""
    sources = list(dict.fromkeys((p.get("source") or "", p.get("source_sha256")) for p in prompts))
    if not sources or any(sha is None for _, sha in sources):
        return {"text_name": None, "text_sha256": None}
    if len(sources) == 1:
        return {"text_name": sources[0][0] or prompts[0]["corpus"], "text_sha256": sources[0][1]}
    return {
        "text_name": prompts[0]["corpus"],
        "text_sha256": hashlib.sha256("".join(sha for _, sha in sources).encode()).hexdigest(),
    }


def _context_lengths(cell: dict, prompts: list, pos: dict) -> dict:
    ctx = sorted(p["n_tokens"] for p in prompts)
    return {
        "min": ctx[0] if ctx else None,
        "median": ctx[len(ctx) // 2] if ctx else None,
        "max": ctx[-1] if ctx else None,
        "fed_prefix_tokens": cell.get("max_tokens") or "whole prompts",
        "measured": measured_context(cell, prompts, pos),
    }


# how the corpus names a text's chunks (matrix/spec/corpus.py: <id>-c<k>) and an imported llama.cpp
# KL-divergence base file's (store/llamacpp_import.py: "<file> chunk <k>")
CHUNK_NAME = re.compile(r"(-c| chunk )[0-9]+$")


def measured_context(cell: dict, prompts: list, pos: dict) -> str | None:
    """The context the cell's rows were measured in, in words: the longest prompt (a chunk, where the
    text was cut into chunks) as fed, max_tokens cutting it, and the furthest position scored."""
    if not prompts or pos["last"] is None:
        return None
    cap = cell.get("max_tokens")
    fed = [min(p["n_tokens"], cap) if cap else p["n_tokens"] for p in prompts]
    unit = "chunk" if all(CHUNK_NAME.search(p.get("name") or "") for p in prompts) else "prompt"
    length = f"{fed[0]:,} tokens per {unit}" if len(set(fed)) == 1 else f"up to {max(fed):,} tokens per {unit}"
    return f"{length} (positions up to {pos['last']:,} scored)"


def _sampled_positions(cell: dict, pos: dict) -> dict:
    return {
        "stride": cell.get("stride"),
        "count": pos["n"],
        "first": pos["first"],
        "last": pos["last"],
        "rule": _positions_rule(cell),
        "teacher_forced": True,
    }


def _truncation(cell: dict) -> str:
    vocab, evocab = cell.get("vocab_size"), cell.get("engine_vocab_size")
    return (
        f"none: all {evocab} logits per row compared"
        if evocab == vocab or evocab is None
        else f"none: the engine's {evocab} logits per row (tokenizer {vocab}) compared in full"
    )


def disclosure(cell: dict, ref: dict, s: dict, prompts: list, pos: dict, as_is: Collection[str]) -> dict:
    """What makes the cell's KLD interpretable, by field; None where the warehouse does not know it."""
    return {
        "reference_checkpoint": _reference_checkpoint(ref),
        "reference_runtime": _runtime(ref, as_is),
        "candidate_runtime": _runtime(cell, as_is),
        **plugins.provider.disclosures(cell, ref),  # e.g. both sides' KV cache types (extras/: Extra.disclose)
        "evaluation_text": _evaluation_text(cell, prompts),
        "candidate_artifact": artifact(cell),
        "calibration_data": calibration(cell, as_is),
        "context_lengths": _context_lengths(cell, prompts, pos),
        "sampled_positions": _sampled_positions(cell, pos),
        "kl_direction": "KL(P_reference || P_candidate), natural log (nats); reverse KL and JS also reported",
        "vocabulary_truncation": _truncation(cell),
        "aggregation": (
            f"arithmetic mean over {s['rows']} sampled rows (repeat 0) of per-row KL computed in float64 "
            "from full-vocabulary log-softmax; ± standard error of the mean; percentiles by linear "
            "interpolation; per output range as listed; rows with NaN/Inf excluded and counted"
        ),
        "storage_floor": s["storage_floor"],
        "bit_reproducible": {
            "candidate": cell.get("bit_reproducible"),
            "reference": ref.get("bit_reproducible"),
            "repeats": cell.get("repeats"),
        },
    }
