"""The environment a local executor's worker process starts with (matrix/run/local_worker.py)."""

from __future__ import annotations

from matrix.run.local_worker import Worker


def test_a_worker_asks_numpy_for_no_huge_pages_unless_the_user_said_otherwise(monkeypatch):
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _, env = Worker("cell", (), 2, 0, None).environment([])
    assert env["NUMPY_MADVISE_HUGEPAGE"] == "0" and env["OMP_NUM_THREADS"] == "2" and env["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    _, env = Worker("cell", (), 2, 0, None).environment(["1"])
    assert env["NUMPY_MADVISE_HUGEPAGE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
