"""What every object-store warehouse shares (store/s3.py, store/gcs.py): the writer lease and
whole-object staging. A store gives four lease primitives and one upload; this file does the rest.

The lease is one object taken with a conditional create, holding a holder and an expiry, renewed
while held (a third of its life), and taken over once stale, again conditionally: two drivers
that race for it cannot both win, whatever the store (S3: ETag + If-None-Match/If-Match; GCS:
object generation + ifGenerationMatch). A lease whose holder ran in this machine's process
table (same host, boot and pid namespace) and whose process is gone is taken over at once: a
writer killed with SIGKILL never released it, and waiting out its expiry protects nobody.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

from common.errors import UserError, redact

LEASE = ".lease.json"
LEASE_S = float(os.environ.get("LOGIT_MATRIX_LEASE_S", "120"))  # a holder renews every third of it


class Taken(Exception):
    """A conditional write lost: the lease object exists, or is not the version we hold."""


class ObjectDir:
    """Base of an object-store location. Subclasses give: _filesystem() (pyarrow's),
    lease_create(body) -> token, lease_get() -> (body, token), lease_replace(body, token) -> token,
    lease_delete(token), upload(local_path, key), and the plain key operations of store/location.py."""

    remote = True
    scheme = ""  # s3, gs: what the location's URI starts with

    def __init__(self, bucket: str, prefix: str):
        self.bucket, self.prefix = bucket, prefix
        self._fs = None

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    @property
    def fs(self):
        """pyarrow's filesystem for the store, made on first use (reads go through it)."""
        if self._fs is None:
            self._fs = self._filesystem()
        return self._fs

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def path(self, key: str) -> str:
        """The path pyarrow's filesystem knows the object by."""
        return f"{self.bucket}/{self._key(key)}"

    def stage(self, key: str) -> "ObjectStage":
        return ObjectStage(self, key)

    def mkdirs(self, prefix: str) -> None:
        """Object stores have no directories."""

    def sweep_tmp(self) -> list[str]:
        return []  # nothing is ever staged in the bucket

    @contextlib.contextmanager
    def lock(self, holder: str, log=lambda m: None):
        lease = Lease(self, holder, log)
        lease.take()
        try:
            yield
        except BaseException:
            lease.release()
            raise
        lease.release()
        if lease.error is not None:  # the work finished, but another writer may have overlapped it
            raise UserError(
                redact(
                    f"{self}: the writer lease could not be renewed during the run "
                    f"({type(lease.error).__name__}: {str(lease.error).splitlines()[0]})"
                )
            )


def _machine() -> dict:
    """What names this process's machine and process table: the host, this boot, the pid namespace."""

    def read(path: str, how=lambda p: Path(p).read_text().strip()) -> str | None:
        try:
            return how(path)
        except OSError:
            return None

    return {
        "host": socket.gethostname(),
        "boot_id": read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": read("/proc/self/ns/pid", os.readlink),
    }


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a pid the
    kernel gave again to another process starts at another time. None: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def dead_here(held: dict) -> bool:
    """Whether the lease's writer ran in this machine's process table (same host, boot and pid
    namespace) and its process is gone. Anything else (another host, a reboot, another container,
    a lease that does not say) is not ours to judge: only expiry frees it."""
    pid, here = held.get("pid"), _machine()
    if not isinstance(pid, int) or None in here.values() or any(held.get(k) != v for k, v in here.items()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process, alive
        return False
    started = _started(pid)  # alive: the writer itself, unless the kernel gave its pid to another process
    return started is not None and held.get("pid_started") is not None and started != held["pid_started"]


class Lease:
    """One writer at a time on an object store (see the module docstring)."""

    def __init__(self, where: ObjectDir, holder: str, log=lambda m: None):
        self.where, self.holder, self.log = where, holder, log
        self.token = None  # the store's version of the object we wrote (ETag, generation)
        self.error: Exception | None = None  # a renewal that failed
        self.stop = threading.Event()
        self.thread = None

    def _body(self) -> bytes:
        pid = os.getpid()
        return json.dumps(
            {
                "holder": self.holder,
                "expires_at": time.time() + LEASE_S,
                "pid": pid,
                "pid_started": _started(pid),
                **_machine(),
            }
        ).encode()

    def take(self) -> None:
        with self.where._errors("cannot take the writer lease"):
            try:
                self.token = self.where.lease_create(self._body())
            except Taken:
                try:
                    self._take_over()
                except FileNotFoundError:  # released between our create and our read: create again
                    self.token = self.where.lease_create(self._body())
        self.thread = threading.Thread(target=self._renew, daemon=True, name="warehouse-lease")
        self.thread.start()

    def _take_over(self) -> None:
        body, token = self.where.lease_get()
        held = json.loads(body)
        where = f" on {held['host']}" if held.get("host") else ""
        if held.get("expires_at", 0) > time.time():
            if not dead_here(held):
                raise UserError(
                    f"{self.where}: another matrix run is writing to this warehouse "
                    f"({held.get('holder', 'unknown')}{where}, lease valid for "
                    f"{held['expires_at'] - time.time():.0f}s more)"
                )
            self.log(
                f"{self.where}: taking over the writer lease of {held.get('holder', 'unknown')}{where}: "
                "that process is gone"
            )
        try:
            self.token = self.where.lease_replace(self._body(), token)
        except Taken:  # someone else took it over between our read and our write
            raise UserError(f"{self.where}: another matrix run took over the stale writer lease first") from None

    def _renew(self) -> None:
        while not self.stop.wait(LEASE_S / 3):
            try:
                self.token = self.where.lease_replace(self._body(), self.token)
            except Exception as e:  # kept for the holder to report (lock()), not printed from a thread
                self.error = e
                return

    def release(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        with contextlib.suppress(Taken):  # not ours any more: another writer holds it, leave it be
            self.where.lease_delete(self.token)


class ObjectStage:
    """A local temp file to write the whole file to; commit() uploads it as one object, which is
    visible only once complete (a single PUT, or a multipart/resumable upload the store finalises)."""

    def __init__(self, where: ObjectDir, key: str):
        self.where, self.key = where, key
        self.dir = Path(tempfile.mkdtemp(prefix="logit-matrix-"))
        self.tmp = self.dir / Path(key).name

    def commit(self) -> None:
        try:
            with self.where._errors(f"cannot upload {self.key}"):
                self.where.upload(str(self.tmp), self.key)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
