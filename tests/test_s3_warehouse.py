"""The warehouse on a real S3-compatible HTTP server (moto's standalone server, started here).

Credentials reach boto3 and pyarrow through the standard AWS environment only. The secret used
here is made to look like one, and is searched for in every log and every small table.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import run_cli, sql, write_spec

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")
KEY_ID = "AKIALMTESTKEY7Q2XW9ZB"
SECRET = "lmS3cr3t/Zq8x7vT2kP9wR4mN6bV1cX3zL5hJ8gF"
BUCKET = "lm-warehouse"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto server on loopback, and the AWS environment that points at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.time() + 60
        while True:
            try:
                boto3.client("s3").create_bucket(Bucket=BUCKET)
                break
            except Exception:
                assert time.time() < deadline and proc.poll() is None, "moto server did not start"
                time.sleep(0.5)
        yield boto3.client("s3")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)


def keys(client, prefix: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


def lease(client, prefix: str, holder: str, expires_in: float) -> None:
    body = json.dumps({"holder": holder, "expires_at": time.time() + expires_in})
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/.lease.json", Body=body.encode())


def test_sweep_analysis_and_sql_on_s3(s3, tiny_model, short_corpus, swept, tmp_path):
    uri = f"s3://{BUCKET}/sweep"
    spec = write_spec(tmp_path / "spec.yaml", tiny_model, short_corpus, dtypes=["fp32"],
                      reference={"engine": "hf", "dtype": "fp32", "attention": "eager"})
    lease(s3, "sweep", "pid 1 on a-crashed-box", expires_in=-5)  # stale: the run takes it over
    logs = []
    r = run_cli("run", str(spec), "--warehouse", uri, "--json")
    logs.append(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["rows_delivery"]["node"] == 4  # the actors wrote to the bucket themselves
    listed = keys(s3, "sweep/")
    assert not any(".tmp-" in k or k.endswith(".part") for k in listed), listed
    assert "sweep/.lease.json" not in listed  # released
    assert sum(k.startswith("sweep/logits/") for k in listed) == 4
    cells = sql(uri, "select cell_id, status, bit_reproducible, rows_via from cells order by cell_id")
    assert [(c["status"], c["bit_reproducible"], c["rows_via"]) for c in cells] == [("done", True, "node")] * 2
    q = ("select l.cell_id, l.repeat, l.prompt_id, l.position, l.row_hash from logits l join cells c using (cell_id) "
         "where c.dtype = 'fp32' order by all")
    assert sql(uri, q) == sql(swept[1], q)  # the same rows as the local sweep, byte for byte
    # resume: nothing left to do
    again = run_cli("run", str(spec), "--warehouse", uri)
    logs.append(again.stdout + again.stderr)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    # analyze as Ray tasks that read the bucket themselves (not pinned to the driver's node)
    for cmd in (["analyze", "--workers", "2"], ["status"], ["report", "--out", str(tmp_path / "report")]):
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
    for cmd, ok in ((["card", sdpa, "--json", "--allow-undisclosed"], {0}), (["admit", sdpa], {0, 1}),
                    (["fixture", "export", eager, "--out", str(tmp_path / "fixture.json")], {0})):
        out = run_cli(*cmd, "--warehouse", uri)
        logs.append(out.stdout + out.stderr)
        assert out.returncode in ok, (cmd, out.stderr[-2000:])
    # a live lease: a second writer is refused, naming the holder, and nothing changes
    lease(s3, "sweep", "pid 4242 on the-other-driver", expires_in=600)
    before = keys(s3, "sweep/")
    spec2 = write_spec(tmp_path / "spec2.yaml", tiny_model, short_corpus, dtypes=["fp32"], repeats=3,
                       reference={"engine": "hf", "dtype": "fp32", "attention": "eager"})
    busy = run_cli("run", str(spec2), "--warehouse", uri)
    logs.append(busy.stdout + busy.stderr)
    assert busy.returncode == 2, busy.stderr[-2000:]
    assert "pid 4242 on the-other-driver" in busy.stderr.strip().splitlines()[-1] and "Traceback" not in busy.stderr
    assert keys(s3, "sweep/") == before
    # no credential anywhere: logs, runs.argv / spec_yaml, cells.settings / fingerprint
    tables = json.dumps(sql(uri, "select * from runs")) + json.dumps(sql(uri, "select * from cells"))
    for text in logs + [tables]:
        assert SECRET not in text and KEY_ID not in text


@pytest.mark.parametrize("where, needle", [
    ("gs://bucket/wh", "scheme 'gs' is not supported"),
    (f"s3://{KEY_ID}:{SECRET}@{BUCKET}/wh", "credentials or options in the URI are refused"),
    ("s3://no-such-bucket-here/wh", "NoSuchBucket"),
])
def test_bad_locations_are_one_line_exit_2(s3, where, needle):
    r = run_cli("sql", "select count(*) from cells", "--warehouse", where)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert SECRET not in r.stderr + r.stdout


def test_missing_credentials_are_one_line_exit_2(s3, tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    r = run_cli("status", "--warehouse", f"s3://{BUCKET}/sweep")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "credentials" in lines[0].lower(), lines
