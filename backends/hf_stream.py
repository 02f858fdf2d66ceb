"""A long prompt's rows out of an HF model in blocks (Backend.forward_blocks): one prefill of the
whole prompt, then the LM head over the decoder's last hidden state a block of kept rows at a time,
so the logits held are one block's, (block rows, vocab), never the prompt's.

The first block comes from the model's own forward (logits_to_keep: its rows), and the same rows
are computed again from the captured hidden state: where the two differ (an architecture whose
head is more than lm_head and the final soft-capping), every later block is taken from a forward
of its own, which is the model's arithmetic again at a prefill per block. A block's LM head is a
matmul of fewer rows than the whole prompt's, which may round otherwise than one matmul of all of
them: a prompt is streamed only past STREAM_BYTES of rows, and the block's rows are in the settings.

`chunked` (a `prefill_chunk` cell's rows) feeds the prompt in forwards of N tokens that continue one
KV cache and keeps the decoder's last hidden state at the kept positions, then runs the head once
over all of them: the same matmul as the whole prompt's forward, so only the chunking differs.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from backends import hf_sdpa, torch_rows
from backends.base import block_rows


def _head(model, hidden):
    """The CausalLM's own head over hidden (1, rows, hidden): lm_head, then the final logit
    soft-capping where the config has one (transformers' Gemma 2/3 forward)."""
    torch = __import__("torch")
    logits = model.lm_head(hidden)  # (1, rows, vocab)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def blocks(be, token_ids: list[int], positions: list[int]) -> Iterator[np.ndarray]:
    """be: a loaded HFBackend. Each block's rows (block rows, vocab), native dtype, valid until the next."""
    torch, model = be._torch, be.model
    n = block_rows(be.vocab_size())
    ids = torch.tensor([token_ids], dtype=torch.long, device=be.torch_device)  # (1, T)
    keep = torch.tensor(positions, dtype=torch.long, device=be.torch_device)  # (rows,)
    seen = {}
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: seen.__setitem__("h", out[0]))
    with be._grad_off(), hf_sdpa.pinned(torch, model, be.stack.attention, len(token_ids)):
        try:
            first = model(input_ids=ids, logits_to_keep=keep[:n], use_cache=False).logits  # (1, n, vocab)
        finally:
            hook.remove()
        hidden = seen.pop("h")  # (1, T, hidden), the decoder's output after its final norm
        own = torch.equal(_head(model, hidden[:, keep[:n], :]), first)
    be.stream_head = "lm_head over the last hidden state" if own else "a forward per block"
    yield torch_rows.to_host(torch, first[0].detach(), be._outputs)
    del first
    for a in range(n, len(positions), n):
        with be._grad_off(), hf_sdpa.pinned(torch, model, be.stack.attention, len(token_ids)):
            if own:
                rows = _head(model, hidden[:, keep[a : a + n], :])
            else:
                rows = model(input_ids=ids, logits_to_keep=keep[a : a + n], use_cache=False).logits
        yield torch_rows.to_host(torch, rows[0].detach(), be._outputs)  # (block rows, vocab)


def chunked(be, token_ids: list[int], positions: list[int], chunk: int) -> np.ndarray:
    """be: a loaded HFBackend. The prompt in forwards of `chunk` tokens continuing one DynamicCache
    (each forward's own head on one row only), the decoder's final hidden states at the kept
    positions joined, then the head once over them all: (rows, vocab), native dtype."""
    torch, model = be._torch, be.model
    assert list(positions) == sorted(positions), "kept positions come in ascending order"
    seen, kept, cache = {}, [], None
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: seen.__setitem__("h", out[0]))
    try:
        for start in range(0, len(token_ids), chunk):
            ids = token_ids[start : start + chunk]
            with be._grad_off(), hf_sdpa.pinned(torch, model, be.stack.attention, len(ids)):
                out = model(
                    input_ids=torch.tensor([ids], device=be.torch_device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            cache, h = out.past_key_values, seen.pop("h")  # (1, len(ids), hidden)
            local = [p - start for p in positions if start <= p < start + len(ids)]
            if local:
                kept.append(h[:, torch.tensor(local, dtype=torch.long, device=h.device), :])
    except hf_sdpa.LengthRefused as e:  # a kernel refusing a chunk that reads the cache fails the cell, not skips it
        raise RuntimeError(f"prefill_chunk {chunk}: {e}") from e
    finally:
        hook.remove()
    with be._grad_off():
        rows = _head(model, torch.cat(kept, dim=1))[0].detach()  # (rows, vocab)
    return torch_rows.native(torch, rows.to("cpu"))  # its own host copy: the capture's rows may sit in the ring
