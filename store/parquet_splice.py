"""One Parquet file assembled from row groups encoded apart: each row group's column chunks taken
from small Parquet files ("parts", each of one row group), the pieces of one column from several
parts joined into one column chunk, and the file's footer rebuilt over them.

A column chunk is a run of pages, and each data page stands alone: its own header, levels,
encoding, compression and CRC. So a column's rows can be encoded in slices by separate writers
(at once, on separate cores) and their pages laid end to end as one column chunk, provided each
slice was written with the column's settings and none has a dictionary page or statistics
(min/max over the whole chunk, which this module does not recompute: refused). What the footer
says of the joined chunk is summed: values, sizes, page counts by encoding, level histograms.

The footer is Parquet's FileMetaData (Thrift compact protocol, store/thrift_compact.py). Field ids
are those of the format's specification, parquet.thrift of https://github.com/apache/parquet-format:
FileMetaData 1 version, 2 schema, 3 num_rows, 4 row_groups, 5 key_value_metadata, 6 created_by,
7 column_orders; SchemaElement 4 name, 5 num_children; RowGroup 1 columns, 2 total_byte_size,
3 num_rows, 4 sorting_columns, 5 file_offset, 6 total_compressed_size, 7 ordinal; ColumnChunk
1 file_path, 2 file_offset, 3 meta_data, 4-7 the page index, 8-9 encryption; ColumnMetaData 2
encodings, 3 path_in_schema, 4 codec, 5 num_values, 6 total_uncompressed_size, 7
total_compressed_size, 9 data_page_offset, 10 index_page_offset, 11 dictionary_page_offset, 12
statistics, 13 encoding_stats (PageEncodingStats 1 page_type, 2 encoding, 3 count), 14-15 the bloom
filter, 16 size_statistics (SizeStatistics 1 unencoded_byte_array_data_bytes, 2
repetition_level_histogram, 3 definition_level_histogram), 17 geospatial statistics.

Schema, key-value metadata (ARROW:schema and the project's own keys), writer and column orders come
from a template: the file pyarrow writes for the full schema with no rows. Row groups whole from one
part each, in order, give the very bytes pyarrow's own writer gives (tested).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterable

from store.thrift_compact import BINARY, I32, I64, LIST, STRUCT, Encoded, Struct, TList, decode, encode

MAGIC = b"PAR1"
# ColumnChunk fields a spliced file cannot carry: an external file, the page index and bloom filter
# (written outside the chunk, after the row groups), encryption.
UNSPLICEABLE_CHUNK = {1: "file_path", 4: "a page index", 5: "a page index", 6: "a page index", 7: "a page index"}
UNSPLICEABLE_CHUNK |= {8: "encryption", 9: "encryption"}
UNSPLICEABLE_META = {14: "bloom filter", 15: "bloom filter"}
UNJOINABLE_META = {11: "a dictionary page", 12: "statistics", 17: "geospatial statistics"}


class SpliceError(ValueError):
    """Parts that cannot make one row group of this file."""


def footer(data: bytes | memoryview) -> Struct:
    """A whole Parquet file's FileMetaData."""
    view = memoryview(data)
    if len(view) < 12 or bytes(view[:4]) != MAGIC or bytes(view[-4:]) != MAGIC:
        raise SpliceError("not a Parquet file")
    (size,) = struct.unpack("<I", view[-8:-4])
    if size > len(view) - 12:
        raise SpliceError("a Parquet footer longer than its file")
    return decode(view[-8 - size : -8])


def leaf_paths(meta: Struct) -> list[tuple[bytes, ...]]:
    """Each leaf column's path, in schema order, from the flattened schema (SchemaElement list)."""
    out, names, left = [], [], []  # left: children still to come at each depth
    for el in meta.get(2).items[1:]:  # the first element is the root
        while left and left[-1] == 0:
            left.pop()
            names.pop()
        if left:
            left[-1] -= 1
        kids = el.get(5, 0)
        if kids:
            names.append(el.get(4))
            left.append(kids)
        else:
            out.append((*names, el.get(4)))
    return out


@dataclass
class Part:
    """A small Parquet file of at most one row group, its chunks read by column path."""

    data: memoryview
    rows: int
    chunks: dict[tuple[bytes, ...], Struct]  # path -> ColumnChunk
    group: Struct | None  # its RowGroup

    @staticmethod
    def of(data) -> "Part":
        """data: the file's bytes (any buffer)."""
        meta = footer(data)
        groups = meta.get(4).items
        if len(groups) > 1:
            raise SpliceError(f"a part of {len(groups)} row groups")
        if not groups:
            return Part(memoryview(data), 0, {}, None)
        chunks = {_path(c): c for c in groups[0].get(1).items}
        return Part(memoryview(data), groups[0].get(3), chunks, groups[0])


def _path(chunk: Struct) -> tuple[bytes, ...]:
    return tuple(chunk.get(3).get(3).items)


def _start(meta: Struct) -> int:
    """Where a column chunk's first page is: its dictionary page, else its first data page."""
    return meta.get(11) if 11 in meta else meta.get(9)


def _check(chunk: Struct, joined: bool) -> None:
    """Refuses a column chunk this module cannot move, or (joined: one of several pieces) join."""
    meta = chunk.get(3)
    name = b".".join(meta.get(3).items).decode()
    for fid, what in (*UNSPLICEABLE_CHUNK.items(), *UNSPLICEABLE_META.items()):
        if fid in (chunk if fid in UNSPLICEABLE_CHUNK else meta):
            raise SpliceError(f"column {name}: {what} cannot be spliced")
    for fid, what in UNJOINABLE_META.items() if joined else ():
        if fid in meta:
            raise SpliceError(f"column {name}: {what} in pieces to join")


def _summed(metas: list[Struct]) -> Struct:
    """The ColumnMetaData of pieces laid end to end (offsets still the first piece's)."""
    out = metas[0].copy()
    if len(metas) == 1:
        return out
    for m in metas[1:]:
        for fid in (1, 3, 4):  # type, path, codec
            if m.get(fid) != out.get(fid):
                raise SpliceError(f"pieces of column {b'.'.join(out.get(3).items).decode()} differ in field {fid}")
        for fid in (5, 6, 7):  # num_values, total_uncompressed_size, total_compressed_size
            out.set(fid, I64, out.get(fid) + m.get(fid))
        encodings = out.get(2).items + [e for e in m.get(2).items if e not in out.get(2).items]
        out.set(2, LIST, TList(I32, encodings))
    if 13 in out:
        out.set(13, LIST, TList(STRUCT, _page_counts([m.get(13) for m in metas])))
    if 16 in out:
        out.set(16, STRUCT, _size_stats([m.get(16) for m in metas]))
    return out


def _page_counts(lists: list[TList]) -> list[Struct]:
    """PageEncodingStats of joined pieces: the pages of each (page type, encoding) counted."""
    counts: dict[tuple[int, int], int] = {}
    for stats in lists:
        for s in stats.items:
            counts[(s.get(1), s.get(2))] = counts.get((s.get(1), s.get(2)), 0) + s.get(3)
    return [Struct({1: (I32, t), 2: (I32, e), 3: (I32, n)}) for (t, e), n in counts.items()]


def _size_stats(stats: list[Struct | None]) -> Struct:
    """SizeStatistics of joined pieces: byte counts summed, level histograms summed bucket by bucket."""
    if any(s is None for s in stats):
        raise SpliceError("size statistics on some pieces of a column only")
    out = stats[0].copy()
    if 1 in out:
        out.set(1, I64, sum(s.get(1) for s in stats))
    for fid in (2, 3):
        if fid in out:
            hists = [s.get(fid).items for s in stats]
            if len({len(h) for h in hists}) > 1:
                raise SpliceError("level histograms of different lengths")
            out.set(fid, LIST, TList(I64, [sum(b) for b in zip(*hists)]))
    return out


class Splicer:
    """Writes a Parquet file into an open binary file: the magic, then add()'s row groups as
    they come, then close()'s footer."""

    def __init__(self, f: BinaryIO, template: bytes):
        """template: a Parquet file of the full schema and no rows (its footer is this file's)."""
        self.f, self.meta = f, footer(template)
        if self.meta.get(4).items:
            raise SpliceError("a template with rows")
        self.paths = leaf_paths(self.meta)
        self.groups: list[Encoded] = []  # each row group's RowGroup, encoded once
        self.rows = 0
        f.write(MAGIC)
        self.pos = len(MAGIC)

    def add(self, parts: Iterable[Part]) -> None:
        """One row group from parts, taken one at a time (each part's pages are written before the
        next is asked for): their columns, part after part, must come in the file's column order,
        and a column's pieces in consecutive parts are joined into one column chunk. Between them
        a column's pieces hold the row group's rows, the same number for every column."""
        columns: list[tuple[Struct, int]] = []  # (ColumnChunk, rows) of each column written
        pieces: list[tuple[int, Struct]] = []  # the column being written: (rows, ColumnChunk) of each piece
        like, at = None, self.pos
        for part in parts:
            like = like or part.group
            for path, chunk in part.chunks.items():
                if pieces and path != _path(pieces[0][1]):
                    columns.append(self._column(pieces, at))
                    pieces, at = [], self.pos
                if not pieces and (len(columns) >= len(self.paths) or path != self.paths[len(columns)]):
                    raise SpliceError(f"column {b'.'.join(path).decode()} out of the file's column order")
                m = chunk.get(3)
                self.f.write(part.data[_start(m) : _start(m) + m.get(7)])
                self.pos += m.get(7)
                pieces.append((part.rows, chunk))
        if pieces:
            columns.append(self._column(pieces, at))
        if columns:
            self._group(like, columns)

    def _column(self, pieces: list[tuple[int, Struct]], at: int) -> tuple[Struct, int]:
        """(the ColumnChunk, the rows) of pieces written end to end from `at`."""
        for _, chunk in pieces:
            _check(chunk, len(pieces) > 1)
        metas = [c.get(3) for _, c in pieces]
        meta = _summed(metas)
        shift = at - _start(metas[0])
        for fid in (9, 10, 11):  # data, index and dictionary page offsets
            if fid in meta:
                meta.set(fid, I64, meta.get(fid) + shift)
        out = pieces[0][1].copy()
        if out.get(2):  # a deprecated offset: 0 where the writer wrote no metadata outside the footer
            out.set(2, I64, out.get(2) + shift)
        out.set(3, STRUCT, meta)
        return out, sum(n for n, _ in pieces)

    def _group(self, like: Struct, written: list[tuple[Struct, int]]) -> None:
        """The RowGroup of the columns written, its other fields as the first part's (the same writer's)."""
        columns, rows = [c for c, _ in written], {n for _, n in written}
        if len(columns) != len(self.paths) or len(rows) > 1:
            raise SpliceError(f"a row group of {len(columns)} of {len(self.paths)} columns, rows {sorted(rows)}")
        if 4 in like:
            raise SpliceError("a row group with sorting columns")
        group = like.copy()
        group.set(1, LIST, TList(STRUCT, columns))
        group.set(2, I64, sum(c.get(3).get(6) for c in columns))  # the columns' uncompressed bytes
        group.set(3, I64, rows.pop())
        group.set(5, I64, _start(columns[0].get(3)))
        group.set(6, I64, sum(c.get(3).get(7) for c in columns))
        if 7 in group:
            group.set(7, like.fields[7][0], len(self.groups))  # ordinal
        self.groups.append(Encoded(encode(group)))
        self.rows += group.get(3)

    def close(self, extra: dict[bytes, bytes] | None = None) -> None:
        """Writes the footer: the template's, with this file's rows and row groups, and the
        key-value pairs `extra` after the template's (FileMetaData 5, KeyValue 1 key, 2 value)."""
        meta = self.meta.copy()
        if extra:
            kv = meta.get(5)
            pairs = [Struct({1: (BINARY, k), 2: (BINARY, v)}) for k, v in extra.items()]
            meta.set(5, LIST, TList(STRUCT, (kv.items if kv else []) + pairs))
        meta.set(3, I64, self.rows)
        meta.set(4, LIST, TList(STRUCT, self.groups))
        data = encode(meta)
        self.f.write(data)
        self.f.write(struct.pack("<I", len(data)) + MAGIC)
