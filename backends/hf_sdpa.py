"""PyTorch's scaled-dot-product attention kernels as attention values of the HF engine.

`attention: sdpa` lets PyTorch pick a kernel per call; each of these pins one, so a sweep can say
which kernel moved the logits: math (the reference arithmetic), flash, memory-efficient and
cuDNN (torch.nn.attention.sdpa_kernel, https://pytorch.org/docs/stable/backends.html). Which
exist depends on the device, dtype and PyTorch build (on CPU, PyTorch 2.13 has math and flash);
load() tries the model itself under the kernel on a few tokens, and a kernel that is not there
skips the cell with PyTorch's reason instead of failing it.
"""

from __future__ import annotations

import contextlib

from backends.base import SkipCell

KERNELS = {"sdpa_math": "MATH", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
           "sdpa_cudnn": "CUDNN_ATTENTION"}
CUDA_ONLY = {"sdpa_efficient", "sdpa_cudnn"}  # PyTorch builds these kernels for CUDA devices only


def implementation(attention: str) -> str:
    """transformers' attn_implementation for an attention value."""
    return "sdpa" if attention in KERNELS else attention


def unsupported(attention: str, device: str) -> str | None:
    if attention in CUDA_ONLY and device == "cpu":
        return f"attention {attention}: PyTorch has that SDPA kernel on CUDA devices only"
    return None


def pinned(torch, attention: str):
    """The context that pins the cell's kernel around a forward (none for other attention values)."""
    if attention not in KERNELS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, KERNELS[attention])])


def check(torch, model, attention: str, device: str, grad_off) -> None:
    """A four-token forward under the kernel: SkipCell when PyTorch has no such kernel for this
    model's shapes, dtype and device ("No viable backend" / "No available kernel"). grad_off:
    the backend's own no-grad context (its forward's)."""
    if attention not in KERNELS:
        return
    ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.long, device=device)  # (1, 4)
    try:
        with grad_off, pinned(torch, attention):
            model(input_ids=ids, logits_to_keep=1, use_cache=False)
    except RuntimeError as e:
        text = str(e)
        if "No viable backend" in text or "No available kernel" in text:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            raise SkipCell(f"attention {attention}: PyTorch {torch.__version__} has no {KERNELS[attention]} "
                           f"SDPA kernel for this model on {device} ({dtype})") from None
        raise
