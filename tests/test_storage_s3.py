"""The same storage on S3: a real moto server on loopback, spoken to over HTTP by pyarrow."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from storage import reader
from storage.compact import compact_job
from storage.manifest import read_submitted, write_submitted
from storage.writer import PartWriter
from testing.fleet import free_port
from testing.rows import make_row
from thinkfleet.settings import Settings

BUCKET = "thinkfleet-test"


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # Moto keeps one in-process backend for every server it starts: reset it, or a test sees the
    # objects an earlier test in the same session left in the bucket.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def _keys(endpoint: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", []))


def test_s3_round_trip(s3_endpoint: str) -> None:
    uri = f"s3://{BUCKET}/runs"
    writer = PartWriter(uri, "w1", s3_endpoint)
    rows = [make_row(f"p-{i}", seed=i) for i in range(10)]
    intended = writer.part_name("job", "ds")
    assert intended.startswith(f"s3://{BUCKET}/runs/job/dataset=ds/part-")
    assert not writer.exists(intended)
    assert writer.write("job", "ds", rows[:6], intended) == intended
    assert writer.exists(intended)
    writer.write("job", "ds", rows[4:])  # p-4, p-5 delivered twice
    write_submitted(
        uri,
        "job",
        [
            {"prompt_id": r["prompt_id"], "dataset": "ds", "row_index": 0, "content_hash": r["content_hash"]}
            for r in rows
        ],
        s3_endpoint,
    )

    # Only committed objects are visible: no temp objects, nothing half-written.
    keys = _keys(s3_endpoint)
    assert len(keys) == 3 and all(k.endswith(".parquet") for k in keys)

    committed = reader.read_committed(uri, "job", s3_endpoint_url=s3_endpoint)
    assert committed["prompt_id"].to_pylist() == sorted(r["prompt_id"] for r in rows)
    by_id = {r["prompt_id"]: r for r in rows}
    for stored in committed.to_pylist():
        assert stored["output_ids"] == by_id[stored["prompt_id"]]["output_ids"]
    assert reader.stored_prompt_ids(uri, "job", s3_endpoint_url=s3_endpoint) == set(by_id)
    assert set(reader.raw_duplicates(uri, "job", s3_endpoint_url=s3_endpoint)["prompt_id"].to_pylist()) == {
        "p-4",
        "p-5",
    }
    assert read_submitted(uri, "job", s3_endpoint).num_rows == 10

    # Compaction on S3: same committed view, old parts gone, and the intent still "exists".
    settings = Settings(output_uri=uri, s3_endpoint_url=s3_endpoint)
    compact_job(settings, "job")
    after = reader.read_committed(uri, "job", s3_endpoint_url=s3_endpoint)
    assert after.equals(committed.select(after.column_names))
    assert reader.raw_duplicates(uri, "job", s3_endpoint_url=s3_endpoint).num_rows == 0
    # (pyarrow leaves an empty "dataset=ds/" directory marker behind a delete; readers skip it.)
    assert len([k for k in _keys(s3_endpoint) if "/dataset=" in k and k.endswith(".parquet")]) == 1
    assert writer.exists(intended)
