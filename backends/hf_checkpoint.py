"""The weights an HF model loaded are the checkpoint's, or the oracle refuses to run: the loader's
own report (missing, unexpected, mismatched keys, errors), then every parameter against the
safetensors file it came from.
"""

from __future__ import annotations

from pathlib import Path

from common.errors import OracleError


def check_loaded(model, info: dict, model_dir: str, quantised: bool) -> None:
    """Raise OracleError unless from_pretrained's loading report (output_loading_info) is clean and,
    for weights not quantised at load, every parameter equals the checkpoint's."""
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or ())
        if keys:
            problems.append(
                f"{kind.replace('_', ' ')}: {', '.join(keys[:8])}"
                + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
            )
    if info.get("error_msgs"):
        problems.append("errors: " + "; ".join(map(str, info["error_msgs"]))[:300])
    if problems:
        raise OracleError(
            f"{model_dir}: refusing to run, weights not loaded from the checkpoint: " + "; ".join(problems)
        )
    if not quantised:  # quantised weights cannot equal the checkpoint's; the loading report above stands
        verify_against_checkpoint(model, model_dir)


def verify_against_checkpoint(model, model_dir: str) -> None:
    """Every parameter must equal the checkpoint tensor (cast to the load dtype).

    Catches a loader that reports success while some weights were randomly initialised (e.g.
    huggingface/transformers#47407: compressed-tensors MoE experts newly initialised by
    from_pretrained). Tied weights may be absent from the file.
    """
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return  # hub id or .bin checkpoint: the loading report above is the check
    import torch
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    seen, bad = set(), []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                seen.add(key)
                p = params.get(key)
                if p is None:
                    continue
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a TP shard: compare the whole
                if not torch.equal(full.detach(), fh.get_tensor(key).to(p.dtype)):
                    bad.append(key)
    tied = {k for k, p in params.items() if k not in seen and any(p is q for k2, q in params.items() if k2 in seen)}
    missing = sorted(k for k in params if k not in seen and k not in tied)
    if missing or bad:
        parts = []
        if missing:
            parts.append(f"not in the checkpoint (randomly initialised): {', '.join(missing[:8])}")
        if bad:
            parts.append(f"differ from the checkpoint: {', '.join(bad[:8])}")
        raise OracleError(f"{model_dir}: refusing to run, " + "; ".join(parts))
