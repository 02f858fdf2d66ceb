"""llama.cpp's `--kl-divergence-base` file: read and write, bit-compatible with perplexity.cpp.

Layout (native byte order, no version field, no model or tokenizer hash):

    char[8]  "_logits_"
    int32    n_ctx, n_vocab, n_chunk
    int32    tokens[n_chunk * n_ctx]
    per chunk, per scored position j = n_ctx/2 ... n_ctx-2 (row j predicts token j+1):
        uint16[nv], nv = 2*((n_vocab+1)/2) + 4:
            bytes 0-3  float32 scale = (max_logit - min_logit) / 65535
            bytes 4-7  float32 min_log_prob = min_logit - max_logit - logsumexp
            uint16 q[n_vocab] = nearest_int((logit - min_logit) / scale), 0 at or below min_logit
        with min_logit raised to max_logit - 16: everything 16 nats below the top is clamped.

    decode: log p_i = scale * q_i + min_log_prob

The encoding is lossy: a step of up to 16/65535 = 2.4e-4 nats, and the clamp. Its own KL
floor is measured on real rows by the round-trip test and reported on import.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from common.positions import LLAMA_PERPLEXITY

MAGIC = b"_logits_"
CLAMP_NATS = 16.0


def row_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_positions(n_ctx: int) -> list[int]:
    """Row j of a chunk predicts token j + 1; perplexity.cpp scores j = n_ctx/2 .. n_ctx - 2."""
    return LLAMA_PERPLEXITY.of(n_ctx)


def encode_rows(logits: np.ndarray) -> np.ndarray:
    """(rows, vocab) float32 logits -> (rows, nv) uint16, as perplexity.cpp's log_softmax() writes."""
    x = np.ascontiguousarray(logits, dtype=np.float32)  # (rows, vocab)
    rows, vocab = x.shape
    out = np.zeros((rows, row_width(vocab)), dtype=np.uint16)
    mx = x.max(-1)
    mn = np.maximum(x.min(-1), mx - np.float32(CLAMP_NATS))  # float32 arithmetic, like the C++
    sum_exp = np.exp(x - mx[:, None]).astype(np.float64).sum(-1)  # expf, summed in double
    lse = np.log(sum_exp).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    head = out[:, :4].view(np.float32)  # (rows, 2)
    head[:, 0], head[:, 1] = scale, min_log_prob
    for i in range(rows):
        if scale[i] == 0:
            continue
        inv = np.float32(1) / scale[i]
        t = inv * (x[i] - mn[i])  # float32
        # nearest_int() adds 1.5*2^23: round half to even, as np.rint
        q = np.where(x[i] > mn[i], np.rint(t), 0)
        out[i, 4 : 4 + vocab] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """(rows, nv) uint16 -> (rows, n_vocab) float32 log-probabilities (clamped tail included)."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # (rows, 2): scale, min_log_prob
    q = rows[:, 4 : 4 + n_vocab].astype(np.float32)
    return (head[:, :1] * q + head[:, 1:2]).astype(np.float32)


def row_heads(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, nv) uint16 -> each row's (scale, min_log_prob), float32."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # (rows, 2)
    return head[:, 0], head[:, 1]


def clamped(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """(rows, n_vocab) bool: entries at or below min_logit, i.e. 16+ nats below the top (q = 0)."""
    return rows[:, 4 : 4 + n_vocab] == 0


# Where an imported clamped entry is put: this many nats below min_log_prob.
CLAMPED_BELOW = 64.0


def decode_for_import(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """decode_rows, with each clamped entry put CLAMPED_BELOW nats under min_log_prob.

    q = 0 means "16+ nats below the top: no information". llama.cpp's own KL skips those base
    entries; put far below they carry ~zero probability here too, instead of the e^-16 each
    that would otherwise be spread over thousands of tokens."""
    lp = decode_rows(rows, n_vocab)  # (rows, n_vocab)
    scale, mlp = row_heads(rows)
    mask = clamped(rows, n_vocab) & (scale[:, None] > 0)
    lp[mask] = np.broadcast_to((mlp - np.float32(CLAMPED_BELOW))[:, None], lp.shape)[mask]
    return lp


def write(path: str | os.PathLike, n_ctx: int, tokens: np.ndarray, logits_per_chunk: list[np.ndarray]) -> None:
    """tokens: (n_chunk, n_ctx) int; logits_per_chunk[c]: (n_ctx - 1 - n_ctx//2, vocab) at scored positions."""
    tokens = np.asarray(tokens, dtype=np.int32)
    n_chunk = tokens.shape[0]
    vocab = logits_per_chunk[0].shape[1] if n_chunk else 0
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([n_ctx, vocab, n_chunk], dtype=np.int32).tobytes())
        f.write(tokens.tobytes())
        for chunk in logits_per_chunk:
            f.write(encode_rows(chunk).tobytes())
    os.replace(tmp, path)


class FormatError(ValueError):
    pass


def read(path: str | os.PathLike) -> dict:
    """-> {n_ctx, n_vocab, n_chunk, tokens (n_chunk, n_ctx), rows (n_chunk, n_scored, nv) uint16 memmap}."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(8)
        if magic != MAGIC:
            raise FormatError(f"{path}: not a llama.cpp KL-divergence base file (magic {magic!r}, expected {MAGIC!r})")
        head = np.frombuffer(f.read(12), dtype=np.int32)
    if len(head) != 3:
        raise FormatError(f"{path}: truncated header ({size} bytes)")
    n_ctx, n_vocab, n_chunk = (int(v) for v in head)
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise FormatError(f"{path}: header n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk} is not plausible")
    n_scored = len(scored_positions(n_ctx))
    nv = row_width(n_vocab)
    want = 20 + 4 * n_chunk * n_ctx + 2 * n_chunk * n_scored * nv
    if size != want:
        raise FormatError(
            f"{path}: {size} bytes, but n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk} "
            f"need {want}: the sizes do not add up (truncated or foreign file)"
        )
    tokens = np.fromfile(path, dtype=np.int32, count=n_chunk * n_ctx, offset=20).reshape(n_chunk, n_ctx)
    rows = np.memmap(path, dtype=np.uint16, mode="r", offset=20 + 4 * n_chunk * n_ctx, shape=(n_chunk, n_scored, nv))
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "n_chunk": n_chunk, "tokens": tokens, "rows": rows}
