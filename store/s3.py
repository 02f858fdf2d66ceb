"""A warehouse on S3 or any S3-compatible server (MinIO, Ceph, moto, R2 ...).

Writes go through boto3: a whole object per file (put_object, or upload_file's multipart upload,
which boto3 aborts on failure), and the writer lease (store/objdir.py) through conditional PUTs
(If-None-Match to take it, If-Match to renew or take over a stale one). Reads go through pyarrow's S3 filesystem,
so Parquet footers and column chunks are fetched by range and DuckDB reads Arrow datasets.
Both take credentials, region and endpoint (AWS_ENDPOINT_URL) from the standard AWS chain.
"""

from __future__ import annotations

import contextlib
import os

from common.errors import UserError, redact
from store.objdir import LEASE, ObjectDir, Taken


class S3Dir(ObjectDir):
    scheme = "s3"

    def __init__(self, bucket: str, prefix: str):
        super().__init__(bucket, prefix)
        try:
            import boto3
        except ImportError:
            raise UserError("s3:// warehouses need boto3: pip install 'logit-matrix[s3]'") from None
        self.client = boto3.client("s3")

    def _filesystem(self):
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
        return fs.S3FileSystem(**kw)

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

    def list(self, prefix: str, suffix: str = ".parquet") -> list[str]:
        out, base = [], self._key("")
        with self._errors(f"cannot list {prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            ):
                out += [o["Key"][len(base) :] for o in page.get("Contents", []) if o["Key"].endswith(suffix)]
        return sorted(out)

    def delete(self, key: str) -> None:
        with self._errors(f"cannot delete {key}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def move(self, key: str, to: str) -> None:
        """Server-side copy, then delete: the object is never absent from both places."""
        with self._errors(f"cannot move {key} to {to}"):
            self.client.copy({"Bucket": self.bucket, "Key": self._key(key)}, self.bucket, self._key(to))
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    # -- the lease primitives (store/objdir.py): the object's ETag is its version -----------
    def _conditional(self, **kw) -> str:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self._key(LEASE), **kw)["ETag"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise Taken() from None
            raise

    def lease_create(self, body: bytes) -> str:
        return self._conditional(Body=body, IfNoneMatch="*")

    def lease_get(self) -> tuple[bytes, str]:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(LEASE))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise FileNotFoundError(LEASE) from None
            raise
        return r["Body"].read(), r["ETag"]

    def lease_replace(self, body: bytes, token: str) -> str:
        return self._conditional(Body=body, IfMatch=token)

    def lease_delete(self, token: str) -> None:
        if self.client.head_object(Bucket=self.bucket, Key=self._key(LEASE))["ETag"] != token:
            raise Taken()
        self.client.delete_object(Bucket=self.bucket, Key=self._key(LEASE))

    def upload(self, path: str, key: str) -> None:
        self.client.upload_file(path, self.bucket, self._key(key))  # multipart above 8 MiB, aborted on failure
