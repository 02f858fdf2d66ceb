"""The HF engine's batch cells and its `deterministic` option: a prompt evaluated in a right-padded
batch with others (common/batching.py), and torch's deterministic algorithms."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from backends import hf_sdpa, torch_rows

CUBLAS_WORKSPACE = ":4096:8"  # PyTorch's reproducibility notes: a fixed workspace for deterministic cuBLAS


def forward(backend, token_ids: list[int], positions: list[int], others: list[list[int]]) -> np.ndarray:
    """A padded batch, as HF users batch: token_ids is sequence 0, every sequence is padded on the
    right to the longest with an attention mask, so each keeps the positions it has alone (no
    position_ids to derive) and padding is never attended by a real token (causal). The LM head
    runs on every sequence's kept positions (logits_to_keep), (batch, rows, vocab), of which
    sequence 0's come back: a batch cell does not stream, so its prompts want max_tokens."""
    torch = backend._torch
    seqs = [token_ids, *others]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)  # (batch, T); pad id 0, masked out
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (batch, T)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    dev = backend.torch_device
    keep = torch.tensor(positions, dtype=torch.long, device=dev)  # (rows,)
    with backend._grad_off(), hf_sdpa.pinned(torch, backend.model, backend.stack.attention, width):
        out = backend.model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev) if masked(backend.stack) else None,
            logits_to_keep=keep,
            use_cache=False,
        )
    return torch_rows.to_host(torch, out.logits[0].detach(), backend._outputs)  # (rows, vocab), sequence 0's


def masked(stack) -> bool:
    """Whether a batch goes with its padding mask: not under the pinned flash kernel, which takes no
    mask (PyTorch refuses it one); right padding under the causal mask is never attended anyway."""
    return stack.attention != "sdpa_flash"


def settings(stack) -> dict[str, Any]:
    """How a prompt shares its forward: alone, or in a right-padded batch."""
    batch = stack.extra("batch")
    if batch is None:
        return {"batch_size": 1}
    return {"batch_size": batch.size, "padding_side": "right", "attention_mask": masked(stack), "batch_row": 0}


def deterministic(torch, on: bool, device: str) -> None:
    """`deterministic: true`: torch.use_deterministic_algorithms (an op without a deterministic kernel
    then raises rather than run another), and on CUDA the fixed cuBLAS workspace PyTorch requires
    for reproducible GEMMs, before the first cuBLAS handle (the actor starts with it: runtime_env).
    Set either way: the process may host another stack before this one."""
    if on and device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(on)
