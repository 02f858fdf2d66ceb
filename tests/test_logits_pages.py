"""A logits slice written page by page (store/logits_pages.py) is the file pyarrow's writer gives
for it, byte for byte: at vocabularies below, at and above a page a row, for float32 and bf16 rows;
and where pyarrow would end its pages elsewhere its writer writes the slices, to the same shard."""

from __future__ import annotations

import numpy as np
import pytest

from store import logits_pages, shard_encoding
from store.logits_pages import Layout, OtherPages, PageWriter, rows_a_page
from store.prompt_rows import PromptRows
from store.shard_encoding import pyarrow_slice, slice_bound
from store.values import ZSTD_LEVEL, widen
from store.warehouse import ShardWriter, Warehouse


def rows(n: int, vocab: int, seed: int) -> np.ndarray:
    """Logit-like rows: a spread of values, a few large ones, some repeated."""
    g = np.random.default_rng(seed)
    x = (g.standard_normal((n, vocab)) * 3 - 4).astype(np.float32)
    x[:, :: max(1, vocab // 7)] = 12.5
    return x


# (vocabulary, rows): several rows a page with a partial last page; one page a row exactly (4 x
# 262,144 = 1 MiB); more than a page a row; a page that ends on pyarrow's row count; one odd row
SHAPES = [(49_152, 21), (262_144, 3), (300_007, 2), (1, 20_001), (13, 20_003), (4_099, 1)]


@pytest.mark.parametrize("vocab,n", SHAPES)
def test_a_slice_is_the_file_pyarrows_writer_gives(vocab, n):
    writer = PageWriter(Layout(vocab, pyarrow_slice, ZSTD_LEVEL))
    x = rows(n, vocab, vocab)
    for native in (x, (x.view(np.uint32) >> 16).astype(np.uint16)):  # float32, bf16 bits
        want = pyarrow_slice(widen(native))
        out = np.zeros(slice_bound(native.size), np.uint8)
        assert out[: writer.write(native, out)].tobytes() == want


def test_pages_hold_what_pyarrows_rules_give():
    assert [rows_a_page(v) for v in (262_144, 262_143, 49_152, 32_001, 13, 1)] == [1, 2, 6, 9, 20_000, 20_000]


def test_a_page_rule_pyarrow_does_not_follow_is_refused(monkeypatch):
    monkeypatch.setattr(logits_pages, "PAGE_BYTES", 1 << 19)  # pages half pyarrow's: its first page is longer
    with pytest.raises(OtherPages, match="first page holds"):
        Layout(49_152, pyarrow_slice, ZSTD_LEVEL)


def test_a_file_that_is_not_pyarrows_is_refused_before_any_slice_is_written(monkeypatch):
    monkeypatch.setattr(logits_pages, "_signed", lambda crc: 0)  # page headers pyarrow would not write
    with pytest.raises(OtherPages, match="not the one written here"):
        Layout(4_099, pyarrow_slice, ZSTD_LEVEL)


def write_shard(root, prompts: list[np.ndarray], threads: int = 2) -> bytes:
    w = ShardWriter(str(root), "run", "cell", 0, threads=threads)
    for i, native in enumerate(prompts):
        n = len(native)
        w.add(PromptRows(f"p{i}", list(range(n)), list(range(1, n)) + [None], native))
    return (root / w.commit()).read_bytes()


def test_where_pyarrow_ends_pages_elsewhere_its_writer_writes_the_same_shard(tmp_path, monkeypatch):
    # slices of 6 rows: each prompt spans several, encoded on two threads, each its own PageWriter
    monkeypatch.setattr(shard_encoding, "SLICE_VALUES", 6 * 4_099)
    Warehouse(tmp_path).create()
    x = rows(30, 4_099, 1)
    prompts = [x, (x[:11].view(np.uint32) >> 16).astype(np.uint16), x[:5].astype(np.float16)]
    direct = write_shard(tmp_path, prompts)
    assert shard_encoding.layout(4_099) is not None  # the pages above were PageWriter's
    assert write_shard(tmp_path, prompts, threads=1) == direct
    monkeypatch.setattr(shard_encoding, "_LAYOUTS", {4_099: None})  # as where OtherPages was raised
    assert write_shard(tmp_path, prompts) == direct
