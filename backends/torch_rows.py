"""A torch engine's logits as the numpy rows a backend hands back (bf16 as its raw bits, uint16).

Rows on the host are handed back as they are: numpy views the tensor, no copy. Rows on an
accelerator are copied into the buffers the capture asked the backend to keep
(Backend.keep_outputs: OutputRing), page-locked, so each prompt's copy lands in memory already
mapped (a fresh host array of (rows, vocab) costs its page faults on every prompt) and runs as
one DMA without a staging copy (page-locked "pinned" memory,
https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers). The copy is
asynchronous (non_blocking) and the stream is synchronized before the array is handed back.
torch is passed in: backends import it only when they load.
"""

from __future__ import annotations

import numpy as np

from backends.base import OutputRing


def native(torch, t) -> np.ndarray:
    """A host tensor's values as numpy without a copy: bf16 as its raw bits (uint16)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _torch_dtype(torch, dtype):
    """The torch dtype whose values a numpy array of dtype holds (uint16: bf16 bits)."""
    d = np.dtype(dtype)
    return torch.bfloat16 if d == np.uint16 else torch.from_numpy(np.empty(0, d)).dtype


def host_ring(torch, n: int, pinned: bool) -> OutputRing:
    """OutputRing(n) over torch host memory, page-locked where pinned (torch.empty(pin_memory=True),
    which needs a CUDA device). Each buffer is numpy over its tensor, which the array keeps alive."""

    def empty(size: int, dtype) -> np.ndarray:
        return native(torch, torch.empty(size, dtype=_torch_dtype(torch, dtype), pin_memory=pinned))

    return OutputRing(n, empty)


def numpy_dtype(torch, dtype) -> np.dtype:
    """The numpy dtype a backend hands back rows of a torch dtype in (bf16: its bits, uint16)."""
    return np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def copy_into(torch, t, ring: OutputRing) -> np.ndarray:
    """t: (rows, vocab) on any device, copied into the ring's next buffer (non_blocking; the
    stream is synchronized before the array is returned). -> (rows, vocab), that buffer."""
    out = ring.take(tuple(t.shape), numpy_dtype(torch, t.dtype))  # (rows, vocab), native dtype
    dst = torch.from_numpy(out.view(np.int16) if out.dtype == np.uint16 else out).view(t.dtype)
    dst.copy_(t, non_blocking=True)
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()  # the host reads the array next
    return out


def to_host(torch, t, ring: OutputRing) -> np.ndarray:
    """t: (rows, vocab), native dtype -> numpy: a view where t is on the host already (a copy
    there would only add one), else copy_into the ring."""
    return native(torch, t) if t.device.type == "cpu" else copy_into(torch, t, ring)
