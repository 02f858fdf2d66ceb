"""A shard's logits encoded in slices on several threads and spliced into one row group per prompt
(store/shard_encoding.py, store/parquet_splice.py): an ordinary Parquet file that pyarrow, the
project's page reader, `matrix verify` and DuckDB read back exactly, the same bytes at any thread
count, and the footer codec true to the byte."""

from __future__ import annotations

import io
import struct
import threading

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import shard_encoding
from store.floors import Storage
from store.parquet_splice import Part, SpliceError, Splicer
from store.prompt_rows import PromptRows
from store.shards import _template, _writer, by_row, encode_rows, rows_table
from store.stream import Rows, shard_index
from store.thrift_compact import decode, encode
from store.verify import verify_shard
from store.warehouse import ShardWriter, Warehouse, row_hash, widen

VOCAB = 4099  # odd on purpose: rows line up with neither pages nor level groups
SLICE_ROWS = 6  # rows a slice holds in these tests (SLICE_VALUES below), so a prompt spans several


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    monkeypatch.setattr(shard_encoding, "SLICE_VALUES", SLICE_ROWS * VOCAB)


def logits(rows: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 3 + 2).astype(np.float32)  # (rows, vocab)


def prompts() -> list[dict]:
    """Each prompt's rows as ShardWriter.add takes them: fp32 over many slices, bf16 bits, one
    row, f16, and `store: bf16` rows with their shift."""
    stored, shift = Storage("bf16").keep(logits(17, 4))
    out = [
        {"native": logits(40, 1)},
        {"native": (logits(23, 2).view(np.uint32) >> 16).astype(np.uint16)},
        {"native": logits(1, 3)},
        {"native": logits(9, 5).astype(np.float16)},
        {"native": stored, "shift": shift},
    ]
    for i, p in enumerate(out):
        p["id"], p["positions"] = f"p{i}", list(range(3, 3 + len(p["native"])))
        p["next"] = [7 + k for k in range(len(p["native"]) - 1)] + [None]
    return out


def write(root, rows: list[dict], threads: int) -> bytes:
    w = ShardWriter(str(root), "run", "cell", 0, threads=threads)
    for p in rows:
        w.add(PromptRows(p["id"], p["positions"], p["next"], p["native"], p.get("shift")))
    key = w.commit()
    return (root / key).read_bytes()


def footer_bytes(data: bytes) -> bytes:
    (size,) = struct.unpack("<I", data[-8:-4])
    return data[-8 - size : -8]


def test_the_footer_codec_gives_back_a_pyarrow_footer_byte_for_byte(tmp_path):
    Warehouse(tmp_path).create()
    rows = prompts()
    sink = pa.BufferOutputStream()
    w = _writer(sink)  # one pyarrow writer: statistics, dictionaries, size statistics, column orders
    for p in rows:
        w.write_table(by_row(rows_table("run", "cell", 0, PromptRows(p["id"], p["positions"], p["next"], p["native"]))))
    w.close()
    for data in (sink.getvalue().to_pybytes(), write(tmp_path, rows, 2)):
        foot = footer_bytes(data)
        assert encode(decode(foot)) == foot


def test_whole_row_groups_spliced_are_pyarrows_own_file():
    tables = [
        rows_table("run", "cell", 0, PromptRows(p["id"], p["positions"], p["next"], p["native"])) for p in prompts()
    ]
    sink = pa.BufferOutputStream()
    w = _writer(sink)
    for t in tables:
        w.write_table(by_row(t))
    w.close()
    out = io.BytesIO()
    s = Splicer(out, _template("logits", True))
    for t in tables:
        s.add([Part.of(encode_rows(t))])
    s.close()
    assert out.getvalue() == sink.getvalue().to_pybytes()


def test_a_prompt_of_one_slice_is_the_file_one_pyarrow_writer_writes(tmp_path, monkeypatch):
    # the slices' and the small columns' writers encode each column as the whole file's writer does
    monkeypatch.setattr(shard_encoding, "SLICE_VALUES", 4 * SLICE_ROWS * VOCAB)  # its last slices: SLICE_ROWS
    Warehouse(tmp_path).create()
    p = prompts()[1]
    p["native"] = p["native"][:SLICE_ROWS]
    p["positions"], p["next"] = p["positions"][:SLICE_ROWS], p["next"][:SLICE_ROWS]
    got = write(tmp_path, [p], 2)
    want = encode_rows(rows_table("run", "cell", 0, PromptRows(p["id"], p["positions"], p["next"], p["native"])))
    assert got == want


def test_the_same_rows_are_the_same_bytes_at_any_thread_count(tmp_path):
    Warehouse(tmp_path).create()
    rows = prompts()
    one = write(tmp_path, rows, 1)
    assert write(tmp_path, rows, 2) == one == write(tmp_path, rows, 3)
    assert not [t for t in threading.enumerate() if t.name.startswith("shard-store")]  # commit ended the pool


def expected(p: dict) -> tuple[np.ndarray, list[str]]:
    """(the stored values widened to float32, each row's row_hash)."""
    return widen(p["native"]).astype(np.float32), [row_hash(r) for r in p["native"]]


def test_pyarrow_reads_every_row_back_with_page_crcs_checked(tmp_path):
    Warehouse(tmp_path).create()
    rows = prompts()
    pf = pq.ParquetFile(pa.BufferReader(write(tmp_path, rows, 2)), page_checksum_verification=True)
    assert pf.schema_arrow == _writer(pa.BufferOutputStream()).schema
    assert pf.num_row_groups == len(rows)
    leaf = pf.metadata.row_group(0).column(7)
    assert leaf.path_in_schema == "logits.list.element" and "BYTE_STREAM_SPLIT" in leaf.encodings
    assert leaf.compression == "ZSTD" and not leaf.has_dictionary_page
    for g, p in enumerate(rows):
        t = pf.read_row_group(g)
        values, hashes = expected(p)
        assert t.column("prompt_id").to_pylist() == [p["id"]] * len(values)
        assert t.column("position").to_pylist() == p["positions"]
        assert t.column("next_token_id").to_pylist() == p["next"]
        assert np.array_equal(np.stack(t.column("logits").to_numpy(zero_copy_only=False)), values)
        assert t.column("row_hash").to_pylist() == hashes
        shift = p.get("shift")
        assert t.column("shift").to_pylist() == (shift.tolist() if shift is not None else [None] * len(values))
    assert pf.metadata.row_group(0).column(3).statistics.min == 3  # position's statistics are kept


def test_the_page_reader_and_verify_read_it_back(tmp_path):
    wh = Warehouse(tmp_path)
    wh.create()
    rows = prompts()
    write(tmp_path, rows, 2)
    index = shard_index(wh, "cell", 0)
    assert index.rows == sum(len(p["native"]) for p in rows) and index.vocab == VOCAB
    for p in rows:
        values, hashes = expected(p)
        assert index.prompts[p["id"]].hashes == hashes
        got = Rows(wh, index, p["id"], batch=5).take(np.arange(len(values)))  # (rows, vocab) raw logits
        shift = p.get("shift")
        assert np.array_equal(got, values if shift is None else values + shift[:, None])
    damage, checked, _ = verify_shard(wh, "cell", 0, index.rows)
    assert damage == [] and checked == index.rows


def test_duckdb_reads_the_values(tmp_path):
    Warehouse(tmp_path).create()
    rows = prompts()
    data = write(tmp_path, rows, 2)
    path = tmp_path / "shard.parquet"
    path.write_bytes(data)
    got = duckdb.sql(
        f"SELECT prompt_id, position, row_hash, logits FROM read_parquet('{path}') ORDER BY prompt_id, position"
    ).fetchall()
    want = [
        (p["id"], pos, h, v)
        for p in rows
        for pos, h, v in zip(p["positions"], *reversed(expected(p)))  # (hashes, values) by row
    ]
    assert len(got) == len(want)
    for (pid, pos, h, vals), (wpid, wpos, wh, wvals) in zip(got, want):
        assert (pid, pos, h) == (wpid, wpos, wh)
        assert np.array_equal(np.array(vals, np.float32), wvals)


def test_rows_without_values_and_rows_another_node_encoded_share_a_shard(tmp_path):
    Warehouse(tmp_path).create()
    p, q = prompts()[:2]
    w = ShardWriter(str(tmp_path), "run", "cell", 0, threads=2)
    w.add(PromptRows(p["id"], p["positions"], p["next"], p["native"]))
    w.add_encoded(
        encode_rows(rows_table("run", "cell", 0, PromptRows(q["id"], q["positions"], q["next"], q["native"])))
    )
    t = pq.read_table(tmp_path / w.commit())
    assert t.column("row_hash").to_pylist() == expected(p)[1] + expected(q)[1]
    w = ShardWriter(str(tmp_path), "run", "refs", 0, values=False, threads=2)
    w.add(PromptRows(p["id"], p["positions"], p["next"], p["native"]))
    t = pq.read_table(tmp_path / w.commit())
    assert t.column("logits").null_count == len(p["native"]) and t.column("row_hash").to_pylist() == expected(p)[1]


def test_a_slice_never_outgrows_its_buffer():
    # incompressible bits (NaNs included), and 4-value rows: levels bit-packed, not run-length
    for rows, vocab in ((1, 1 << 20), (1 << 16, 4), (5, 4099)):
        bits = np.random.default_rng(rows).integers(0, 1 << 32, (rows, vocab), dtype=np.uint32)
        t = pa.table({"logits": shard_encoding.list_column(bits.view(np.float32))}, schema=shard_encoding.SLICE_SCHEMA)
        assert len(shard_encoding.encode_part(t)) <= shard_encoding.slice_bound(rows * vocab)


def test_a_failed_slice_fails_the_add_and_the_shard_leaves_nothing(tmp_path, monkeypatch):
    Warehouse(tmp_path).create()
    p = prompts()[0]
    calls = []

    def broken(self, native, a, b):
        calls.append(a)
        raise OSError("no space left")

    monkeypatch.setattr(shard_encoding.SliceEncoder, "_slice", broken)
    w = ShardWriter(str(tmp_path), "run", "cell", 0, threads=2)
    with pytest.raises(OSError, match="no space left"):
        w.add(PromptRows(p["id"], p["positions"], p["next"], p["native"]))
    w.abort()
    assert calls and not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("*.parquet"))


def test_parts_out_of_the_files_column_order_are_refused():
    t = rows_table("run", "cell", 0, PromptRows("p", [0, 1], [1, None], logits(2, 9)))
    head, tail = (
        pa.table([t.column(k) for k in s.names], schema=s)
        for s in (shard_encoding.HEAD_SCHEMA, shard_encoding.TAIL_SCHEMA)
    )
    logit = pa.table([t.column("logits")], schema=shard_encoding.SLICE_SCHEMA)
    s = Splicer(io.BytesIO(), _template("logits", True))
    with pytest.raises(SpliceError, match="order"):
        s.add(Part.of(shard_encoding.encode_part(x)) for x in (head, tail, logit))
    s = Splicer(io.BytesIO(), _template("logits", True))
    with pytest.raises(SpliceError, match="columns"):
        s.add(Part.of(shard_encoding.encode_part(x)) for x in (head, logit))
    s = Splicer(io.BytesIO(), _template("logits", True))  # a dictionary and statistics are the whole chunk's
    with pytest.raises(SpliceError, match="dictionary page in pieces to join"):
        s.add(Part.of(shard_encoding.encode_part(x)) for x in (head, t.select(["logits_dtype"]), logit, tail))


def test_pages_pushed_to_disk_beside_the_writes_change_nothing_and_a_failed_push_fails_the_shard(tmp_path, monkeypatch):
    import store.location

    Warehouse(tmp_path).create()
    rows = prompts()
    want = write(tmp_path, rows, 2)
    pushed = []
    monkeypatch.setattr(store.location, "WRITEBACK_BYTES", 1)  # a push after every prompt
    monkeypatch.setattr(store.location.os, "fdatasync", lambda fd: pushed.append(fd))
    assert write(tmp_path, rows, 2) == want and pushed

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.location.os, "fdatasync", full)
    w = ShardWriter(str(tmp_path), "run", "other", 0, threads=2)
    with pytest.raises(OSError, match="No space left"):
        for p in rows:
            w.add(PromptRows(p["id"], p["positions"], p["next"], p["native"], p.get("shift")))
        w.commit()
    w.abort()  # the push's failure was raised once: abort only cleans up
    assert not list(tmp_path.rglob("*.part")) and not (tmp_path / "logits" / "other" / "r0.parquet").exists()
