"""Where a warehouse lives: a local directory, or an object-store prefix (`s3://bucket/prefix`,
`gs://bucket/prefix`).

Both offer the warehouse the same few operations on keys ("cells/x.parquet"), with the same
guarantee: a file is visible only when complete. Locally: a temp file, fsync, rename. On S3:
one object written whole (a single PUT, or boto3's multipart upload, aborted on failure), so
there is no partial object and no temp leftover (GCS likewise: store/gcs.py). Credentials come
from the store's own chain (environment, ~/.aws or application-default credentials, instance
role): a URI that carries any is refused, and no message of ours prints them (common.errors.redact).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

from common.errors import UserError

if TYPE_CHECKING:
    from store.objdir import ObjectDir

TMP_PREFIX = ".tmp-"
PROBE = ".probe"  # a run's nonce: which nodes reach the warehouse themselves (Warehouse.reaches)
WRITEBACK_BYTES = 64 << 20  # written since the last push to disk before the next (Writeback)


STORES = {
    "s3": ("store.s3", "S3Dir", "the AWS environment or config (AWS_PROFILE, AWS_ENDPOINT_URL, ...)"),
    "gs": (
        "store.gcs",
        "GcsDir",
        "Google's application-default credentials (GOOGLE_APPLICATION_CREDENTIALS, "
        "gcloud auth application-default login)",
    ),
}


def open_location(where: str | os.PathLike) -> "LocalDir | ObjectDir":
    where = str(where)
    if "://" not in where:
        return LocalDir(Path(where))
    scheme, rest = where.split("://", 1)
    if scheme == "file":
        return LocalDir(Path(rest))
    if scheme not in STORES:
        raise UserError(
            f"--warehouse {scheme}://...: the scheme {scheme!r} is not supported "
            "(a directory, file://DIR, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)"
        )
    module, cls, chain = STORES[scheme]
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket or "?" in rest:
        # never echo it: the URI may hold a key
        raise UserError(
            f"--warehouse {scheme}://...: credentials or options in the URI are refused; give them through {chain}"
        )
    if not bucket:
        raise UserError(f"--warehouse {where}: no bucket named")
    import importlib

    return getattr(importlib.import_module(module), cls)(bucket, prefix.strip("/"))


def fsync_replace(tmp: Path, final: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


class Writeback:
    """An open file's pages pushed to disk behind its writer, one fdatasync at a time on a thread of
    its own, so the fsync that makes the file durable (fsync_replace) finds little left: a large
    shard's commit does not wait on the disk for all of it. A push starts once WRITEBACK_BYTES more
    are written (a sync also flushes the disk's cache: not one per small prompt)."""

    def __init__(self, f: BinaryIO):
        self.f, self.pushed = f, 0
        self._pool: ThreadPoolExecutor | None = None
        self._push: Future | None = None

    def kick(self, written: int) -> None:
        """After a write, the file's size written: starts a push unless one is under way or too
        little is new. A failed push raises once, here or in wait()."""
        if written - self.pushed < WRITEBACK_BYTES or (self._push is not None and not self._push.done()):
            return
        done, self._push = self._push, None
        if done is not None:
            done.result()
        self.f.flush()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="writeback")
        self._push, self.pushed = self._pool.submit(getattr(os, "fdatasync", os.fsync), self.f.fileno()), written

    def wait(self) -> None:
        """Waits out the push under way (before the file is closed); its failure raises."""
        push, self._push = self._push, None
        try:
            if push is not None:
                push.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class LocalDir:
    """A warehouse directory on this machine."""

    remote = False

    def __init__(self, root: Path):
        self.root = root
        self.fs = None  # pyarrow reads local paths itself

    def __str__(self) -> str:
        return str(self.root)

    def path(self, key: str) -> str:
        return str(self.root / key)

    def state(self) -> str:
        """missing | empty | used | not a directory"""
        if not self.root.exists():
            return "missing"
        if not self.root.is_dir():
            return "not a directory"
        return "used" if any(self.root.iterdir()) else "empty"

    def exists(self, key: str) -> bool:
        return (self.root / key).is_file()

    def read_bytes(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        write_whole(self, key, lambda tmp: tmp.write_bytes(data))

    def stage(self, key: str) -> "LocalStage":
        return LocalStage(self.root / key)

    def list(self, prefix: str, suffix: str = ".parquet") -> list[str]:
        d = self.root / prefix
        if not d.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in d.rglob(f"*{suffix}")
            if p.is_file() and not p.name.startswith(TMP_PREFIX)
        )

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def move(self, key: str, to: str) -> None:
        (self.root / to).parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.root / key, self.root / to)

    def mkdirs(self, prefix: str) -> None:
        (self.root / prefix).mkdir(parents=True, exist_ok=True)

    def sweep_tmp(self) -> list[str]:
        """Remove temp files left by a killed writer (never visible to readers)."""
        gone = [p for p in self.root.rglob(f"{TMP_PREFIX}*") if p.is_file()]
        for p in gone:
            p.unlink()
        return [str(p.relative_to(self.root)) for p in gone]

    @contextlib.contextmanager
    def lock(self, holder: str, log=lambda m: None):
        """flock: the kernel drops it when the holder dies, so a dead writer never blocks the next."""
        import fcntl

        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                raise UserError(f"{self.root}: another matrix run is writing to this warehouse ({other})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder} on {os.uname().nodename}".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing releases the flock


class LocalStage:
    """A temp file beside `final` to write the whole file to; commit() makes it `final`."""

    def __init__(self, final: Path):
        final.parent.mkdir(parents=True, exist_ok=True)
        self.final = final
        self.tmp = final.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}-{final.name}.part"

    def commit(self) -> None:
        fsync_replace(self.tmp, self.final)

    def abort(self) -> None:
        self.tmp.unlink(missing_ok=True)


def write_whole(loc, key: str, write: Callable[[Path], None]) -> None:
    """write(tmp) writes the whole file; it becomes `key` only if that succeeds."""
    st = loc.stage(key)
    try:
        with named_io_errors(loc.path(key)):
            write(st.tmp)
            st.commit()
    except BaseException:
        st.abort()
        raise


@contextlib.contextmanager
def named_io_errors(path: str):
    """An I/O error (a full disk) names the file it was writing: pyarrow's own says neither the
    file nor, in its strerror, anything but "Error writing bytes to file"."""
    try:
        yield
    except OSError as e:
        if e.errno and not e.filename:
            raise OSError(e.errno, os.strerror(e.errno), path) from e
        raise
