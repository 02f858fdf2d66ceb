"""store/pages.py reads a shard's logits leaf from its pages; Arrow is the reference it must equal."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import pages
from store.prompt_rows import PromptRows
from store.shards import _writer, by_row, encode_rows, rows_table
from store.verify import verify_shard
from store.warehouse import LOGITS_LEAF, Warehouse, logits_matrix, row_hash

VOCAB = 4099  # odd on purpose: rows do not line up with pages or with bit-packed level groups


def native(kind: str, rows: int, seed: int = 0) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 4).astype(np.float32)  # (rows, vocab)
    if kind == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(np.float16) if kind == "f16" else x


def leaves(data: bytes) -> list[pages.Leaf]:
    pf = pq.ParquetFile(pa.BufferReader(data))
    leaf = pages.leaf_index(pf.schema, LOGITS_LEAF)
    f = pa.BufferReader(data)
    return [pages.read_row_group_leaf(f, pf.metadata, pf.schema, g, leaf) for g in range(pf.num_row_groups)]


def shard_bytes(tables: list[pa.Table]) -> bytes:
    sink = pa.BufferOutputStream()
    w = _writer(sink)  # the shard writer's own settings
    for t in tables:
        w.write_table(t)
    w.close()
    return sink.getvalue().to_pybytes()


def write(tables: list[pa.Table], **options) -> bytes:
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, tables[0].schema, **options) as w:
        for t in tables:
            w.write_table(t)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("kind", ["fp32", "bf16", "f16"])
def test_shard_pages_give_back_the_native_rows_exactly(kind):
    # 70 rows of 4,099 floats span several 1 MiB pages, with rows cut across page boundaries
    groups = [native(kind, 70, seed=1), native(kind, 3, seed=2)]
    tables = [
        rows_table("run", "cell", 0, PromptRows(f"p{i}", list(range(len(g))), [None] * len(g), g))
        for i, g in enumerate(groups)
    ]
    got = leaves(shard_bytes(tables))  # one row group per prompt, as ShardWriter writes them
    assert len(got) == 2 and len(got[0].pages) > 1
    for leaf, want, t in zip(got, groups, tables):
        rows = leaf.rows(kind)
        assert rows.dtype == want.dtype and rows.shape == want.shape
        assert rows.tobytes() == want.tobytes()
        assert [row_hash(r) for r in rows] == t.column("row_hash").to_pylist()


@pytest.mark.parametrize("kind", ["fp32", "bf16", "f16"])
def test_rows_written_one_row_at_a_time_and_through_a_reused_buffer_are_the_same_file(kind):
    # the shard writer hands Parquet a prompt's rows as one-row chunks and widens them into a
    # buffer it reuses: neither may change a byte of the file
    first, second = native(kind, 9, seed=3), native(kind, 5, seed=4)
    plain = [
        rows_table("run", "cell", 0, PromptRows(f"p{i}", list(range(len(g))), [7] * len(g), g))
        for i, g in enumerate((first, second))
    ]
    chunked = by_row(plain[0])
    assert chunked.column("logits").num_chunks == 9 and plain[0].column("logits").num_chunks == 1
    assert chunked.equals(plain[0])
    want = shard_bytes(plain)
    assert shard_bytes([by_row(t) for t in plain]) == want
    buffer = np.full(9 * VOCAB, np.nan, np.float32)  # stale values from an earlier prompt must not leak
    sink = pa.BufferOutputStream()
    w = _writer(sink)
    for i, g in enumerate((first, second)):  # each prompt written before the next one reuses the buffer
        w.write_table(
            by_row(
                rows_table("run", "cell", 0, PromptRows(f"p{i}", list(range(len(g))), [7] * len(g), g), buffer=buffer)
            )
        )
    w.close()
    assert sink.getvalue().to_pybytes() == want
    assert pq.read_table(pa.BufferReader(encode_rows(plain[1]))).equals(plain[1])


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "none", "use_byte_stream_split": [LOGITS_LEAF]},
        {"compression": "zstd", "use_byte_stream_split": False, "use_dictionary": False},  # PLAIN values
        {"compression": "snappy", "use_byte_stream_split": [LOGITS_LEAF], "data_page_version": "2.0"},
        {
            "compression": "zstd",
            "use_byte_stream_split": [LOGITS_LEAF],
            "data_page_version": "2.0",
            "data_page_size": 5000,
        },
    ],
    ids=["uncompressed", "plain", "v2-snappy", "v2-small-pages"],
)
def test_other_writers_settings_read_the_same_as_arrow(options):
    x = native("fp32", 9, seed=3)
    t = rows_table("run", "cell", 0, PromptRows("p", list(range(9)), [None] * 9, x))
    data = write([t], use_dictionary=False, **{k: v for k, v in options.items() if k != "use_dictionary"})
    (leaf,) = leaves(data)
    arrow = logits_matrix(pq.read_table(pa.BufferReader(data)).column("logits"))
    assert leaf.rows("fp32").tobytes() == arrow.tobytes() == x.tobytes()


def test_what_it_does_not_handle_is_unsupported_not_misread():
    x = native("fp32", 4)
    t = rows_table("run", "cell", 0, PromptRows("p", list(range(4)), [None] * 4, x))
    with pytest.raises(pages.Unsupported, match="dictionary"):
        leaves(write([t], use_dictionary=True))
    nulls = t.set_column(
        t.schema.get_field_index("logits"),
        "logits",
        pa.array([list(x[0]), None, list(x[2]), list(x[3])], pa.list_(pa.float32())),
    )
    with pytest.raises(pages.Unsupported, match="null"):
        leaves(write([nulls], use_dictionary=False))


def test_damage_is_named_not_misread(tmp_path):
    x = native("bf16", 40)
    t = rows_table("run", "cell", 0, PromptRows("p", list(range(40)), [None] * 40, x))
    data = bytearray(encode_rows(t))
    pf = pq.ParquetFile(pa.BufferReader(bytes(data)))
    col = pf.metadata.row_group(0).column(pages.leaf_index(pf.schema, LOGITS_LEAF))
    body = col.data_page_offset + col.total_compressed_size // 2
    flipped = bytearray(data)
    flipped[body] ^= 0x04
    with pytest.raises(pages.Corrupt, match="page CRC mismatch"):
        leaves(bytes(flipped))
    # a widened bf16 with a low bit set is not bf16, whatever its hash says
    wide = (x.astype(np.uint32) << 16).view(np.float32).copy()  # (rows, vocab)
    wide.view(np.uint32)[5, 7] |= 1
    lossy = t.set_column(
        t.schema.get_field_index("logits"),
        "logits",
        pa.ListArray.from_arrays(pa.array(np.arange(0, 41 * VOCAB, VOCAB, dtype=np.int32)), pa.array(wide.reshape(-1))),
    )
    with pytest.raises(pages.Corrupt, match="not bf16"):
        leaves(encode_rows(lossy))[0].rows("bf16")


def _shard(wh: Warehouse, rows: pa.Table, **options) -> str:
    path = wh.shard_path("cell", 0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(write([rows], **options))
    return path


def test_verify_checks_hashes_by_pages_and_by_arrow_alike(tmp_path):
    """The page reader and the Arrow fallback find the same changed row (a file without page CRCs,
    so only the row hash can tell)."""
    wh = Warehouse(tmp_path / "wh")
    wh.create()
    x = native("fp32", 6)
    t = rows_table("run", "cell", 0, PromptRows("p", [0, 32, 64, 96, 128, 160], [None] * 6, x))
    hashes = t.column("row_hash").to_pylist()
    hashes[4] = row_hash(x[3])
    t = t.set_column(t.schema.get_field_index("row_hash"), "row_hash", pa.array(hashes))
    for options in (
        {"use_byte_stream_split": [LOGITS_LEAF], "use_dictionary": False},  # pages
        {"use_dictionary": True},
    ):  # a dictionary page: Arrow
        _shard(wh, t, compression="zstd", **options)
        damage, rows, size = verify_shard(wh, "cell", 0, 6)
        assert rows == 6 and size > 6 * VOCAB  # fp32 noise barely compresses
        assert [(d.prompt_id, d.position, d.what) for d in damage] == [("p", 128, "values do not match row_hash")]
        damage, _, _ = verify_shard(wh, "cell", 0, 7)
        assert [d.what for d in damage][-1] == "6 rows, the cell has 7 per repeat"


@pytest.mark.parametrize("kind", ["fp32", "bf16", "f16"])
def test_a_leaf_streamed_a_few_rows_at_a_time_is_the_native_rows(kind):
    """LeafStream (what matrix analyze reads through) holds a page at a time: rows cut across
    pages come back whole, in any batch sizes; a flipped byte is Corrupt."""
    want = native(kind, 70, seed=3)
    data = shard_bytes([rows_table("run", "cell", 0, PromptRows("p", list(range(70)), [None] * 70, want))])
    pf = pq.ParquetFile(pa.BufferReader(data))
    leaf = pages.leaf_index(pf.schema, LOGITS_LEAF)
    s = pages.LeafStream(pa.BufferReader(data), pf.metadata, pf.schema, 0, leaf, kind)
    parts = [s.take(n) for n in (1, 3, 29, 37)]
    assert all(p.dtype == want.dtype for p in parts)
    assert np.concatenate(parts).tobytes() == want.tobytes()
    assert len(s.left) == 0 and next(s.pages, None) is None  # every page read once, nothing left over
    bad = bytearray(data)
    at = pf.metadata.row_group(0).column(leaf).data_page_offset + 200_000  # inside a page body
    bad[at] ^= 0x40
    s = pages.LeafStream(pa.BufferReader(bytes(bad)), pf.metadata, pf.schema, 0, leaf, kind)
    with pytest.raises(pages.Corrupt, match="CRC"):
        s.take(70)


def test_rows_taken_into_a_reused_buffer_are_the_rows_taken_fresh(tmp_path):
    # a bf16 shard with shifts, read with store/stream.py's Scratch and take(out=): a run of rows,
    # rows with a gap, then a later run; every one equal to a fresh take's, the shift added back
    from store.floors import Storage
    from store.stream import Rows, Scratch, shard_index
    from store.warehouse import ShardWriter

    wh = tmp_path / "wh"
    Warehouse(wh).create()
    raw = native("fp32", 40, seed=6)
    stored, shift = Storage("bf16").keep(raw)
    w = ShardWriter(str(wh), "run", "cell", 0)
    w.add(PromptRows("p0", list(range(40)), [1] * 40, stored, shift))
    w.commit()
    index = shard_index(Warehouse(wh), "cell", 0)
    fresh, reused = Rows(Warehouse(wh), index, "p0", 8), Rows(Warehouse(wh), index, "p0", 8, Scratch())
    out = np.full(16 * VOCAB, np.nan, np.float32)
    for idx in (np.arange(0, 8), np.array([9, 11, 12, 20]), np.arange(21, 37)):
        want = fresh.take(idx)
        got = reused.take(idx, out)
        assert got.shape == want.shape and np.array_equal(got, want)
        np.testing.assert_allclose(
            got, raw[idx], atol=0.07 * np.abs(raw[idx]).max()
        )  # bf16 of (row - max), max added back
