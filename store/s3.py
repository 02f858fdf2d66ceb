"""A warehouse on S3 or any S3-compatible server (MinIO, Ceph, moto, R2 ...).

Writes go through boto3: a whole object per file (put_object, or upload_file's multipart upload,
which boto3 aborts on failure), and the writer lease through conditional PUTs (If-None-Match to
take it, If-Match to renew or take over a stale one). Reads go through pyarrow's S3 filesystem,
so Parquet footers and column chunks are fetched by range and DuckDB reads Arrow datasets.
Both take credentials, region and endpoint (AWS_ENDPOINT_URL) from the standard AWS chain.
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


class S3Dir:
    remote = True

    def __init__(self, bucket: str, prefix: str):
        self.bucket, self.prefix = bucket, prefix
        try:
            import boto3
        except ImportError:
            raise UserError("s3:// warehouses need boto3: pip install 'logit-matrix[s3]'") from None
        self.client = boto3.client("s3")
        self._fs = None

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def fs(self):
        if self._fs is None:
            from pyarrow import fs

            kw = {}
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or self.client.meta.region_name
            if region:
                kw["region"] = region
            # boto3 resolved the endpoint from the AWS chain (AWS_ENDPOINT_URL, config); pyarrow's
            # constructor does not read it, so an S3-compatible server is named to it explicitly
            endpoint = self.client.meta.endpoint_url
            if endpoint and not endpoint.split("://")[-1].endswith("amazonaws.com"):
                scheme, _, host = endpoint.partition("://")
                kw.update(endpoint_override=host.rstrip("/"), scheme=scheme)
            self._fs = fs.S3FileSystem(**kw)
        return self._fs

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def path(self, key: str) -> str:
        """The path pyarrow's filesystem knows the object by."""
        return f"{self.bucket}/{self._key(key)}"

    def _fail(self, what: str, e: Exception) -> UserError:
        """One line for an unreachable bucket, missing credentials, a refused request."""
        code = getattr(e, "response", {}).get("Error", {}).get("Code")
        return UserError(redact(f"{self}: {what}: {code + ': ' if code else ''}{str(e).splitlines()[0]}"))

    @contextlib.contextmanager
    def _errors(self, what: str):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError) as e:
            raise self._fail(what, e) from None

    def state(self) -> str:
        with self._errors("cannot list the bucket"):
            r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1)
        return "used" if r.get("KeyCount", 0) else "empty"

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._fail(f"cannot read {key}", e) from None

    def read_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise FileNotFoundError(f"{self}/{key}") from None
            raise self._fail(f"cannot read {key}", e) from None

    def write_bytes(self, key: str, data: bytes) -> None:
        with self._errors(f"cannot write {key}"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def stage(self, key: str) -> "S3Stage":
        return S3Stage(self, key)

    def list(self, prefix: str, suffix: str = ".parquet") -> list[str]:
        out, base = [], self._key("")
        with self._errors(f"cannot list {prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                              Prefix=self._key(prefix)):
                out += [o["Key"][len(base):] for o in page.get("Contents", []) if o["Key"].endswith(suffix)]
        return sorted(out)

    def delete(self, key: str) -> None:
        with self._errors(f"cannot delete {key}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def move(self, key: str, to: str) -> None:
        """Server-side copy, then delete: the object is never absent from both places."""
        with self._errors(f"cannot move {key} to {to}"):
            self.client.copy({"Bucket": self.bucket, "Key": self._key(key)}, self.bucket, self._key(to))
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def mkdirs(self, prefix: str) -> None:
        """Object stores have no directories."""

    def sweep_tmp(self) -> list[str]:
        return []  # nothing is ever staged in the bucket

    @contextlib.contextmanager
    def lock(self, holder: str):
        lease = Lease(self, holder)
        lease.take()
        try:
            yield
        except BaseException:
            lease.release()
            raise
        lease.release()
        if lease.error is not None:  # the work finished, but another writer may have overlapped it
            raise UserError(redact(f"{self}: the writer lease could not be renewed during the run "
                                   f"({type(lease.error).__name__}: {str(lease.error).splitlines()[0]})"))


class Lease:
    """One writer at a time on an object store: an object taken with a conditional create, with a
    holder and an expiry, renewed while held, and taken over only once it has gone stale."""

    def __init__(self, where: S3Dir, holder: str):
        self.where, self.key = where, where._key(LEASE)
        self.holder = f"{holder} on {socket.gethostname()}"
        self.etag = None
        self.error: Exception | None = None  # a renewal that failed
        self.stop = threading.Event()
        self.thread = None

    def _put(self, **cond) -> str:
        body = json.dumps({"holder": self.holder, "expires_at": time.time() + LEASE_S}).encode()
        return self.where.client.put_object(Bucket=self.where.bucket, Key=self.key, Body=body, **cond)["ETag"]

    def take(self) -> None:
        from botocore.exceptions import ClientError

        with self.where._errors("cannot take the writer lease"):
            try:
                self.etag = self._put(IfNoneMatch="*")
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise
                self._take_over()
        self.thread = threading.Thread(target=self._renew, daemon=True, name="warehouse-lease")
        self.thread.start()

    def _take_over(self) -> None:
        r = self.where.client.get_object(Bucket=self.where.bucket, Key=self.key)
        held = json.loads(r["Body"].read())
        if held.get("expires_at", 0) > time.time():
            raise UserError(f"{self.where}: another matrix run is writing to this warehouse "
                            f"({held.get('holder', 'unknown')}, lease valid for "
                            f"{held['expires_at'] - time.time():.0f}s more)")
        self.etag = self._put(IfMatch=r["ETag"])  # fails if someone else took it over first

    def _renew(self) -> None:
        while not self.stop.wait(LEASE_S / 3):
            try:
                self.etag = self._put(IfMatch=self.etag)
            except Exception as e:  # kept for the holder to report (lock()), not printed from a thread
                self.error = e
                return

    def release(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        head = self.where.client.head_object(Bucket=self.where.bucket, Key=self.key)
        if head["ETag"] == self.etag:  # still ours
            self.where.client.delete_object(Bucket=self.where.bucket, Key=self.key)


class S3Stage:
    """A local temp file to write the whole file to; commit() uploads it as one object."""

    def __init__(self, where: S3Dir, key: str):
        self.where, self.key = where, key
        self.dir = Path(tempfile.mkdtemp(prefix="logit-matrix-"))
        self.tmp = self.dir / Path(key).name

    def commit(self) -> None:
        try:
            with self.where._errors(f"cannot upload {self.key}"):
                self.where.client.upload_file(str(self.tmp), self.where.bucket, self.where._key(self.key))
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
