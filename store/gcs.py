"""A warehouse on Google Cloud Storage (gs://bucket/prefix), or a GCS-compatible server.

Writes go through google-cloud-storage: a whole object per file (a single upload, or a resumable
upload that GCS makes visible only when finalised), and the writer lease (store/objdir.py)
through generation preconditions: ifGenerationMatch=0 creates it only if absent, =N replaces or
deletes only the version we hold. Reads go through pyarrow's GCS filesystem (ranged reads of
footers and column chunks; DuckDB reads Arrow datasets over it).

Credentials and project come from Google's standard chain (GOOGLE_APPLICATION_CREDENTIALS,
gcloud's application-default login, the metadata server). STORAGE_EMULATOR_HOST, the variable
every Google client honours, points both clients at an emulator (anonymous, as emulators are).
"""

from __future__ import annotations

import contextlib
import os

from common.errors import UserError, redact
from store.objdir import LEASE, ObjectDir, Taken

EMULATOR = "STORAGE_EMULATOR_HOST"


class GcsDir(ObjectDir):
    scheme = "gs"

    def __init__(self, bucket: str, prefix: str):
        super().__init__(bucket, prefix)
        try:
            from google.cloud import storage
        except ImportError:
            raise UserError("gs:// warehouses need google-cloud-storage: pip install 'logit-matrix[gcs]'") from None
        with self._errors("no credentials"):
            self.client = storage.Client()
        self._bucket = self.client.bucket(bucket)

    def _filesystem(self):
        from pyarrow import fs

        emulator = os.environ.get(EMULATOR)
        if emulator:
            scheme, _, host = emulator.partition("://") if "://" in emulator else ("http", "", emulator)
            return fs.GcsFileSystem(anonymous=True, scheme=scheme, endpoint_override=host.rstrip("/"))
        return fs.GcsFileSystem()  # the default credential chain

    def _blob(self, key: str):
        return self._bucket.blob(self._key(key))

    @contextlib.contextmanager
    def _errors(self, what: str, missing: str | None = None):
        """One line for a missing bucket, missing credentials, a refused or failed request.
        missing: an object that is not there is FileNotFoundError(missing), as a local read's."""
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth

        try:
            yield
        except api.NotFound as e:
            try:
                bucket_there = self._bucket.exists()
            except (api.GoogleAPIError, auth.GoogleAuthError, OSError):
                bucket_there = True  # cannot tell: say what the request said, not a guess
            if not bucket_there:
                raise UserError(redact(f"{self}: {what}: bucket {self.bucket!r} not found ({_message(e)})")) from None
            if missing is not None:  # the object is missing, not the bucket: as a local read says it
                raise FileNotFoundError(missing) from None
            raise UserError(redact(f"{self}: {what}: not found ({_message(e)})")) from None
        except (api.GoogleAPIError, auth.GoogleAuthError) as e:
            raise UserError(redact(f"{self}: {what}: {type(e).__name__}: {_message(e)}")) from None
        except OSError as e:  # the endpoint does not answer (requests' ConnectionError is one)
            raise UserError(redact(f"{self}: {what}: {type(e).__name__}: {_message(e)}")) from None

    def state(self) -> str:
        with self._errors("cannot list the bucket"):
            found = list(self.client.list_blobs(self.bucket, prefix=self._key(""), max_results=1))
        return "used" if found else "empty"

    def exists(self, key: str) -> bool:
        with self._errors(f"cannot read {key}"):
            return self._blob(key).exists()

    def read_bytes(self, key: str) -> bytes:
        with self._errors(f"cannot read {key}", missing=f"{self}/{key}"):
            return self._blob(key).download_as_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        with self._errors(f"cannot write {key}"):
            self._blob(key).upload_from_string(data)

    def list(self, prefix: str, suffix: str = ".parquet") -> list[str]:
        base = self._key("")
        with self._errors(f"cannot list {prefix}"):
            names = [b.name for b in self.client.list_blobs(self.bucket, prefix=self._key(prefix))]
        return sorted(n[len(base) :] for n in names if n.endswith(suffix))

    def delete(self, key: str) -> None:
        from google.api_core.exceptions import NotFound

        with self._errors(f"cannot delete {key}"), contextlib.suppress(NotFound):  # as on S3: gone is gone
            self._blob(key).delete()

    def move(self, key: str, to: str) -> None:
        """Server-side copy, then delete: the object is never absent from both places."""
        with self._errors(f"cannot move {key} to {to}"):
            self._bucket.copy_blob(self._blob(key), self._bucket, self._key(to))
            self._blob(key).delete()

    # -- the lease primitives (store/objdir.py): the object's generation is its version -----
    @contextlib.contextmanager
    def _precondition(self):
        from google.api_core.exceptions import PreconditionFailed

        try:
            yield
        except PreconditionFailed:
            raise Taken() from None

    def _put_lease(self, body: bytes, generation: int) -> int:
        blob = self._blob(LEASE)
        with self._precondition():
            blob.upload_from_string(body, content_type="application/json", if_generation_match=generation)
        return blob.generation

    def lease_create(self, body: bytes) -> int:
        return self._put_lease(body, 0)  # 0: only if no live object has that name

    def lease_get(self) -> tuple[bytes, int]:
        blob = self._blob(LEASE)
        with self._errors("cannot read the writer lease", missing=LEASE):
            body = blob.download_as_bytes()
        return body, blob.generation

    def lease_replace(self, body: bytes, token: int) -> int:
        return self._put_lease(body, token)

    def lease_delete(self, token: int) -> None:
        blob = self._blob(LEASE)
        with self._precondition():
            blob.reload()  # GCS checks the precondition below itself; emulators may not, so look first
            if blob.generation != token:
                raise Taken()
            blob.delete(if_generation_match=token)

    def upload(self, path: str, key: str) -> None:
        self._blob(key).upload_from_filename(path)  # resumable above 8 MiB: visible only once finalised


def _message(e: Exception) -> str:
    text = getattr(e, "message", None) or str(e) or type(e).__name__
    return text.splitlines()[0] if text.splitlines() else text
