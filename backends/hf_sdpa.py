"""PyTorch's scaled-dot-product attention kernels as attention values of the HF engine.

`attention: sdpa` lets PyTorch pick a kernel per call; each of these pins one, so a sweep can say
which kernel moved the logits: math (the reference arithmetic), flash, memory-efficient and
cuDNN (torch.nn.attention.sdpa_kernel, https://pytorch.org/docs/stable/backends.html). Which
exist depends on the device, dtype and PyTorch build (on CPU, PyTorch 2.13 has math and flash);
load() tries the model itself under the kernel on a few tokens, and a kernel that is not there
skips the cell with PyTorch's reason instead of failing it.

Grouped-query attention: transformers hands SDPA the model's KV heads as they are with
`enable_gqa=True` when it passes no mask (use_gqa_in_sdpa in transformers/integrations/
sdpa_attention.py), and a kernel may refuse that (PyTorch 2.11's memory-efficient kernel on an
H200 did) while it runs the same attention with each KV head repeated for the query heads that
read it. Where load()'s check fails with the heads grouped and passes with them repeated, the
model runs EXPANDED, an attention function registered with transformers' AttentionInterface, and
the cell's settings say so (kv_heads_expanded, with both head counts).

A kernel that ran load()'s check and refuses a later forward refuses it for its length (the
model, dtype and device are the same): that is LengthRefused (backends/base.py), which a capture
answers by feeding a longer prefix or leaving that prompt's rows out (actors/capture.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

from backends.base import LengthRefused, SkipCell

KERNELS = {
    "sdpa_math": "MATH",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}
CUDA_ONLY = {"sdpa_efficient", "sdpa_cudnn"}  # PyTorch builds these kernels for CUDA devices only
EXPANDED = "sdpa_kv_expanded"  # transformers' attn_implementation name of kv_expanded_attention
REFUSALS = ("No viable backend", "No available kernel")  # PyTorch's words when no allowed kernel takes a call


def implementation(attention: str) -> str:
    """transformers' attn_implementation for an attention value (load()'s check may move a
    pinned kernel's model to EXPANDED)."""
    return "sdpa" if attention in KERNELS else attention


def unsupported(attention: str, device: str) -> str | None:
    if attention in CUDA_ONLY and device == "cpu":
        return f"attention {attention}: PyTorch has that SDPA kernel on CUDA devices only"
    return None


def heads(model) -> tuple[int, int]:
    """(query heads, KV heads) of the model's attention, as its config gives them."""
    cfg = getattr(model.config, "text_config", None) or model.config
    q = int(cfg.num_attention_heads)
    return q, int(getattr(cfg, "num_key_value_heads", None) or q)


class _Ungrouped:
    """An attention module as sdpa_attention_forward reads it (num_key_value_groups, is_causal),
    with one query head per KV head: the KV heads it is handed are already repeated."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def kv_expanded_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA attention (sdpa_attention_forward) with each KV head first repeated
    for the query heads that read it, by transformers' repeat_kv, so SDPA is never asked for
    grouped-query attention. The same arithmetic: repeat_kv is a copy (expand, then reshape), and
    query head h reads KV head h // (query heads / KV heads) either way, as `enable_gqa` defines it
    (torch.nn.functional.scaled_dot_product_attention's documented reference repeats the KV heads
    with repeat_interleave; transformers' eager attention calls repeat_kv the same way). The mask
    and is_causal are sdpa's (the mask function is sdpa_mask, registered beside this).
    query: (batch, heads, T, head_dim); key, value: (batch, kv_heads, T, head_dim)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (batch, heads, T, head_dim)
    return sdpa_attention_forward(_Ungrouped(module), query, key, value, attention_mask, **kwargs)


def register() -> str:
    """EXPANDED registered with transformers (its attention function and sdpa's mask); -> that name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXPANDED, kv_expanded_attention)
    AttentionMaskInterface.register(EXPANDED, sdpa_mask)
    return EXPANDED


@contextlib.contextmanager
def pinned(torch, model, attention: str, tokens: int):
    """The cell's kernel pinned around a forward of `tokens` tokens (nothing for other attention
    values). PyTorch having no such kernel for the call ("No viable backend" / "No available
    kernel") raises LengthRefused with its reason: after load()'s check the model, dtype and
    device are the kernel's, and which kernels run a call depends on its sequence length too (an
    H200's cuDNN kernel ran 4 tokens and refused 1), so every forward says it, not only load()'s."""
    if attention not in KERNELS:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([getattr(SDPBackend, KERNELS[attention])]):
            yield
    except RuntimeError as e:
        text = str(e)
        if not any(r in text for r in REFUSALS):
            raise
        param = next(model.parameters())
        dtype, device = str(param.dtype).removeprefix("torch."), param.device.type
        how = " (its KV heads repeated)" if model.config._attn_implementation == EXPANDED else ""
        raise LengthRefused(
            f"attention {attention}: PyTorch {torch.__version__} has no {KERNELS[attention]} SDPA kernel "
            f"for this model{how} on {device} ({dtype}) at {tokens} token{'s' if tokens != 1 else ''}: "
            f"{text.strip().splitlines()[0]}",
            tokens,
        ) from None


def _probe(torch, model, attention: str, device: str, grad_off) -> None:
    ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.long, device=device)  # (1, 4)
    with grad_off, pinned(torch, model, attention, ids.shape[1]):
        model(input_ids=ids, logits_to_keep=1, use_cache=False)


def check(torch, model, attention: str, device: str, grad_off) -> None:
    """A four-token forward under the kernel: SkipCell before any capture when PyTorch has no such
    kernel for this model's dtype and device. Refused with the KV heads grouped, it is tried again
    with them repeated (EXPANDED), and the model keeps that implementation where it runs.
    grad_off: the backend's own no-grad context (its forward's), entered once per try."""
    if attention not in KERNELS:
        return
    try:
        _probe(torch, model, attention, device, grad_off)
        return
    except SkipCell as e:
        grouped = str(e)
    q, kv = heads(model)
    if kv == q or model.config._attn_implementation == EXPANDED:
        raise SkipCell(grouped)  # not the length: no kernel for this dtype and device
    model.set_attn_implementation(register())
    try:
        _probe(torch, model, attention, device, grad_off)
    except SkipCell as e:
        model.set_attn_implementation("sdpa")
        raise SkipCell(f"{grouped}; and with its {kv} KV heads repeated for its {q} query heads: {e}") from None


def settings(model, attention: str) -> dict[str, Any]:
    """What a pinned kernel's cell records of its attention: the kernel, and whether the KV heads
    were repeated before SDPA (kv_heads_expanded) with the model's query and KV head counts."""
    if attention not in KERNELS:
        return {}
    q, kv = heads(model)
    return {
        "sdpa_kernel": KERNELS[attention],
        "kv_heads_expanded": model.config._attn_implementation == EXPANDED,
        "query_heads": q,
        "kv_heads": kv,
    }
