"""What runs in every vLLM worker (sent there by LLM.apply_model, see backends/vllm_backend.py):
the forward hooks that keep the hidden states of a request, and the functions that turn the rows
a capture asks for into logits with vLLM's own compute_logits, or hand back the tapped layers'
states. Only those rows leave the worker.

Each function takes the worker's model first; nothing here imports vLLM, and torch only inside
the functions, so the driver imports this module without either.
"""

from __future__ import annotations


def install_norm_hook(model) -> None:
    """Runs in every vLLM worker (apply_model): keep the final norm's output of each forward."""
    model._logit_matrix_states = []

    def hook(_mod, _args, out):
        h = out[0] if isinstance(out, tuple) else out  # RMSNorm(x, residual) -> (x, residual)
        model._logit_matrix_states.append(h.detach())

    model.model.norm.register_forward_hook(hook)


def prefill_logits(model, n_tokens: int, positions: list[int]):
    """Runs in every vLLM worker: logits of the one prefill's rows at `positions`, (rows, vocab)."""
    import torch

    states, model._logit_matrix_states = model._logit_matrix_states, []
    prefill = [h for h in states if h.shape[0] == n_tokens]
    if len(prefill) != 1:
        raise RuntimeError(
            f"expected one prefill of {n_tokens} tokens, saw hidden states of shapes "
            f"{[tuple(h.shape) for h in states]} (chunked prefill or prefix caching on?)"
        )
    keep = torch.tensor(positions, dtype=torch.long, device=prefill[0].device)
    return model.compute_logits(prefill[0][keep]).detach().cpu()


def chunked_logits(model, n_tokens: int, chunk: int, positions: list[int]):
    """Runs in every vLLM worker, after a request prefilled in steps of at most `chunk` tokens: the
    steps' final-norm rows stitched in order, then the logits at `positions`, (rows, vocab)."""
    import torch

    states, model._logit_matrix_states = model._logit_matrix_states, []
    shapes = [h.shape[0] for h in states]
    if sum(shapes) != n_tokens or any(n > chunk for n in shapes) or len(shapes) != -(-n_tokens // chunk):
        raise RuntimeError(f"expected a prefill of {n_tokens} tokens in steps of {chunk}, saw steps of {shapes}")
    keep = torch.tensor(positions, dtype=torch.long, device=states[0].device)
    return model.compute_logits(torch.cat(states)[keep]).detach().cpu()


def drop_states(model) -> None:
    """Runs in every vLLM worker: forget the norm hook's states (a warm-up request's)."""
    model._logit_matrix_states = []


def cached_logits(model, n_tokens: int, positions: list[int]):
    """Runs in every vLLM worker, after a request whose leading tokens came from the prefix cache:
    (hit, (rows, vocab) logits of the recomputed rows at the positions >= hit)."""
    import torch

    states, model._logit_matrix_states = model._logit_matrix_states, []
    if len(states) != 1 or not 0 < states[0].shape[0] <= n_tokens:
        raise RuntimeError(f"expected one prefill of at most {n_tokens} tokens, saw {[tuple(h.shape) for h in states]}")
    hit = n_tokens - states[0].shape[0]  # what the prefix cache served: never recomputed
    keep = torch.tensor([p - hit for p in positions if p >= hit], dtype=torch.long, device=states[0].device)
    return hit, model.compute_logits(states[0][keep]).detach().cpu()


def decode_logits(model, n_prefill: int, steps: int):
    """Runs in every vLLM worker, after a teacher-forced request of steps + 1 tokens: the logits of
    its decode steps 1..steps, (steps, vocab); each step's hidden state came from a forward of one token."""
    import torch

    states, model._logit_matrix_states = model._logit_matrix_states, []
    shapes = [tuple(h.shape) for h in states]
    if len(states) != steps + 1 or states[0].shape[0] != n_prefill or any(h.shape[0] != 1 for h in states[1:]):
        raise RuntimeError(f"expected a prefill of {n_prefill} tokens then {steps} one-token decodes, saw {shapes}")
    return model.compute_logits(torch.cat(states[1:])).detach().cpu()


def install_layer_taps(model, layers: list[int]) -> None:
    """Runs in every vLLM worker: keep the residual stream after each listed decoder layer. vLLM's
    decoder layers return (hidden, residual) and fuse the add into the next norm, so the stream is
    their sum, the same add HF does at the end of its layer."""
    model._logit_matrix_layers = {}

    def hook(name):
        def f(_mod, _args, out):
            h = (
                out[0] + out[1]
                if isinstance(out, tuple) and len(out) > 1 and out[1] is not None
                else (out[0] if isinstance(out, tuple) else out)
            )
            model._logit_matrix_layers.setdefault(name, []).append(h.detach())

        return f

    model._logit_matrix_taps = [model.model.layers[i].register_forward_hook(hook(f"layer.{i}")) for i in layers]


def take_layer_states(model, n_tokens: int, positions: list[int]):
    """Runs in every vLLM worker: the taps' prefill rows at `positions` (and the final norm's, from
    install_norm_hook), {name: (rows, hidden)} on the CPU; the taps are removed."""
    import torch

    for h in model._logit_matrix_taps:
        h.remove()
    got, model._logit_matrix_layers = model._logit_matrix_layers, {}
    got["final_norm"], model._logit_matrix_states = model._logit_matrix_states, []
    keep = None
    out = {}
    for name, states in got.items():
        prefill = [h for h in states if h.shape[0] == n_tokens]
        if len(prefill) != 1:
            raise RuntimeError(
                f"{name}: expected one prefill of {n_tokens} tokens, saw {[tuple(h.shape) for h in states]}"
            )
        keep = keep if keep is not None else torch.tensor(positions, dtype=torch.long, device=prefill[0].device)
        out[name] = prefill[0][keep].detach().cpu()
    return out
