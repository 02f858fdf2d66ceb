"""PyTorch's scaled-dot-product attention kernels as attention values of the HF engine.

`attention: sdpa` lets PyTorch pick a kernel per call; each of these pins one, so a sweep can say
which kernel moved the logits: math (the reference arithmetic), flash, memory-efficient and
cuDNN (torch.nn.attention.sdpa_kernel, https://pytorch.org/docs/stable/backends.html). Which
exist depends on the device, dtype and PyTorch build (on CPU, PyTorch 2.13 has math and flash);
load() tries the model itself under the kernel on a few tokens, and a kernel that is not there,
then or for a prompt's length later, skips the cell with PyTorch's reason instead of failing it.
"""

from __future__ import annotations

import contextlib

from backends.base import SkipCell

KERNELS = {
    "sdpa_math": "MATH",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}
CUDA_ONLY = {"sdpa_efficient", "sdpa_cudnn"}  # PyTorch builds these kernels for CUDA devices only


def implementation(attention: str) -> str:
    """transformers' attn_implementation for an attention value."""
    return "sdpa" if attention in KERNELS else attention


def unsupported(attention: str, device: str) -> str | None:
    if attention in CUDA_ONLY and device == "cpu":
        return f"attention {attention}: PyTorch has that SDPA kernel on CUDA devices only"
    return None


@contextlib.contextmanager
def pinned(torch, model, attention: str, tokens: int):
    """The cell's kernel pinned around a forward of `tokens` tokens (nothing for other attention
    values). PyTorch having no such kernel for the call ("No viable backend" / "No available
    kernel") skips the cell with its reason: which kernels exist depends on the sequence length as
    well as on the dtype and device (an H200's cuDNN kernel ran load()'s 4 tokens and refused the
    prompts), so every forward says it, not only load()'s check."""
    if attention not in KERNELS:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([getattr(SDPBackend, KERNELS[attention])]):
            yield
    except RuntimeError as e:
        text = str(e)
        if "No viable backend" in text or "No available kernel" in text:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            device = next(model.parameters()).device.type
            raise SkipCell(
                f"attention {attention}: PyTorch {torch.__version__} has no {KERNELS[attention]} "
                f"SDPA kernel for this model on {device} ({dtype}) at {tokens} token{'s' if tokens != 1 else ''}"
            ) from None
        raise


def check(torch, model, attention: str, device: str, grad_off) -> None:
    """A four-token forward under the kernel: SkipCell before any capture when PyTorch has no such
    kernel for this model's dtype and device. grad_off: the backend's own no-grad context (its forward's)."""
    if attention not in KERNELS:
        return
    ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.long, device=device)  # (1, 4)
    with grad_off, pinned(torch, model, attention, ids.shape[1]):
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
