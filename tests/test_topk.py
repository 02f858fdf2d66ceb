"""The top-k ids the metrics compare (analysis/metrics.py _topk): the K largest logits of a row, value
descending and the lower id first among equal values, as a full stable sort of the row orders them.
The selection partitions instead of sorting; these rows hold what a sort would settle differently
if the partition got it wrong: ties across the K-th place, whole blocks of equal maxima, masked
(-inf) tokens, a tail past the last block of 64, and a vocabulary smaller than K."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import metrics as M


def _sorted_ids(x: np.ndarray) -> np.ndarray:
    """The first K ids of each row's stable descending sort: the definition, over the whole row."""
    return np.argsort(-x, axis=-1, kind="stable")[:, : M.K]


def _block_max(x: np.ndarray) -> np.ndarray:
    nb = x.shape[1] // M.BLOCK
    return x[:, : nb * M.BLOCK].reshape(len(x), nb, M.BLOCK).max(-1)


def _rows(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((9, vocab)) * 3).astype(np.float32)
    x[1] = np.round(x[1] * 2) / 2  # coarse values: ties everywhere, at the K-th place too
    x[2, ::3] = x[2].max()  # a third of the row ties for the top
    x[3] = 0.0  # every value equal (and -0.0 beside 0.0)
    x[3, ::2] = -0.0
    x[4, : vocab // 2] = -np.inf  # masked tokens, the first half
    x[5, -min(5, vocab) :] = x[5].max() + 1  # the largest at the end of the row, in the tail
    x[6] = np.float32(1.0) / (1 + np.arange(vocab) % 7)  # the same few values, repeated, block after block
    return x


@pytest.mark.parametrize("vocab", [3, 10, 64, 100, 640, 1000, 4099, 49152])
def test_the_k_largest_ids_are_a_full_sorts(vocab):
    for seed in range(3):
        x = _rows(vocab, seed)
        np.testing.assert_array_equal(M._topk(x, _block_max(x)), _sorted_ids(x)[:, : min(M.K, vocab)])


def test_the_partition_picks_what_a_stable_sort_picks_nan_included():
    rng = np.random.default_rng(7)
    v = np.round(rng.standard_normal((50, 300)) * 2).astype(np.float32)  # few distinct values
    v[3, 10], v[4, :] = np.nan, -np.inf
    for k in (1, 5, 10, 299, 300):
        want = np.sort(np.argsort(-v, axis=-1, kind="stable")[:, :k], -1)
        np.testing.assert_array_equal(M._largest(v, k), want)
        np.testing.assert_array_equal(M._largest(v[5:], k), want[5:])  # without the NaN row: the partition
