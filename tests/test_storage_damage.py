"""Damaged storage is found, named and survived: real Parquet parts, truncated, emptied and bit-flipped on disk.

Every read verifies page checksums; a part that does not decode is quarantined (``{job}/_quarantine/``, with a
record of what it held) and the read goes on over the rest; ``producer verify`` fails naming it and its prompts;
``producer retry --missing`` and a re-submit regenerate them. Fenced rows (a stale claim's writes) are reported,
not failed, and compacted away.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner

from producer.retry import NO_PROMPT_LEFT, retry, retry_missing
from storage import layout, listing, quarantine, reader
from storage.cli import compact, verify
from storage.compact import compact_job
from storage.manifest import write_submitted
from storage.schema import IDS_CRC32, OUTPUT_IDS, SCHEMA, rows_to_table
from storage.verify import verify_job
from storage.writer import PartWriter
from testing.rows import make_row
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, content_hash
from thinkfleet.settings import Settings
from thinkfleet.state.invariant import queued_prompt_ids

JOB = "job"
KEYS = Keys("tfd")


def _settings(tmp_path: Path, redis_url: str = "redis://127.0.0.1:1/0") -> Settings:
    return Settings(output_uri=str(tmp_path), redis_url=redis_url, key_prefix=KEYS.prefix)


def _rows(prefix: str, n: int, seed: int = 0, **kw: object) -> list[dict]:
    rows = [make_row(f"{prefix}-{i}", seed=seed + i, **kw) for i in range(n)]
    for r in rows:  # real content hashes: a salvaged prompt is checked against them
        r["content_hash"] = content_hash(r["input_ids"])
    return rows


def _write_parts(tmp_path: Path, groups: list[list[dict]], worker: str = "w1") -> list[str]:
    writer = PartWriter(str(tmp_path), worker)
    return [writer.write(JOB, "ds", rows) for rows in groups]


def _submit(client: redis.Redis, rows: list[dict], done: bool = True) -> None:
    client.hset(KEYS.prompts(JOB), mapping={r["prompt_id"]: r["content_hash"] for r in rows})
    client.hset(KEYS.prompt_dataset(JOB), mapping={r["prompt_id"]: r["dataset"] for r in rows})
    if done:
        client.sadd(KEYS.done(JOB), *[r["prompt_id"] for r in rows])


def _chunk_range(part: str, column: str = OUTPUT_IDS) -> tuple[int, int]:
    """Byte range of ``column``'s column chunk in a one-row-group part."""
    rg = pq.read_metadata(part).row_group(0)
    chunk = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema.startswith(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    return start, start + chunk.total_compressed_size


def _flip(part: str, offset: int, bit: int) -> None:
    data = bytearray(Path(part).read_bytes())
    data[offset] ^= 1 << bit
    Path(part).write_bytes(bytes(data))


def _page_body(part: str) -> tuple[int, int]:
    """The compressed body of the single data page of output_ids (after its header): what the page CRC covers."""
    lo, hi = _chunk_range(part)
    data = Path(part).read_bytes()
    return data.index(b"\x28\xb5\x2f\xfd", lo), hi  # the zstd frame's magic starts the body


def _quarantined_files(tmp_path: Path) -> list[str]:
    base = tmp_path / JOB / quarantine.QUARANTINE_DIR
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) if base.exists() else []


# -- reads go on over the rest ----------------------------------------------------------------------------------
def test_zero_byte_truncated_and_bad_footer_parts_are_quarantined_and_every_read_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    groups = [_rows(f"g{k}", 3, seed=10 * k) for k in range(4)]
    parts = _write_parts(tmp_path, groups)
    Path(parts[0]).write_bytes(b"")  # zero bytes
    data = Path(parts[1]).read_bytes()
    Path(parts[1]).write_bytes(data[: len(data) // 2])  # truncated
    data = Path(parts[2]).read_bytes()
    Path(parts[2]).write_bytes(data[:-8] + b"\0\0\0\0PAR1")  # a footer length that points nowhere
    good = {r["prompt_id"] for r in groups[3]}

    with caplog.at_level(logging.ERROR, logger="storage.quarantine"):
        table = reader.read_committed(str(tmp_path), JOB, columns=["prompt_id", "output_ids"])
    assert set(table["prompt_id"].to_pylist()) == good
    assert table["output_ids"].to_pylist() == [r["output_ids"] for r in groups[3]]
    # Loud, and naming each part.
    for part in parts[:3]:
        assert any(part in rec.getMessage() and "DAMAGED PART" in rec.getMessage() for rec in caplog.records), part
    # Moved out of the dataset directory, a record next to each.
    names = [Path(p).name for p in parts[:3]]
    assert _quarantined_files(tmp_path) == sorted(
        [f"dataset=ds/{n}" for n in names] + [f"dataset=ds/{n}.json" for n in names]
    )
    assert [p.path for p in listing.list_parts(layout.locate(str(tmp_path)), JOB)] == [parts[3]]
    # The other readers, and the raw tools, read the rest too.
    assert reader.stored_prompt_ids(str(tmp_path), JOB) == good
    assert set(reader.read_keys(str(tmp_path), JOB)["prompt_id"].to_pylist()) == good
    assert set(pq.read_table(tmp_path / JOB)["prompt_id"].to_pylist()) == good  # _quarantine is hidden
    records = quarantine.list_quarantined(layout.locate(str(tmp_path)), JOB)
    assert [r["part"] for r in records] == parts[:3]
    assert all(r["prompt_ids"] is None and r["present"] for r in records)  # no footer: prompts unknown
    assert "0 bytes" in records[0]["reason"]


def test_a_flipped_bit_in_a_page_quarantines_the_part_naming_its_prompts(tmp_path: Path) -> None:
    groups = [_rows("a", 4), _rows("b", 4, seed=50)]
    parts = _write_parts(tmp_path, groups)
    lo, hi = _page_body(parts[0])
    _flip(parts[0], (lo + hi) // 2, 3)
    table = reader.read_committed(str(tmp_path), JOB)
    assert set(table["prompt_id"].to_pylist()) == {r["prompt_id"] for r in groups[1]}
    (record,) = quarantine.list_quarantined(layout.locate(str(tmp_path)), JOB)
    assert record["part"] == parts[0]
    assert "CRC" in record["reason"]
    assert record["prompt_ids"] == sorted(r["prompt_id"] for r in groups[0]) and record["rows"] == 4


def test_a_damaged_footer_column_name_is_not_read_as_a_null_column(tmp_path: Path) -> None:
    """A bit flipped in a column's name in the footer would make that column read as null (the epoch: the
    fenced row would win); the part's schema says it is not one PartWriter wrote."""
    rows = _rows("a", 3)
    for r in rows:
        r["epoch"] = 5
    (part,) = _write_parts(tmp_path, [rows])
    data = bytearray(Path(part).read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    name = data.index(b"epoch", footer)  # the schema's element name
    data[name] ^= 1  # "epoch" -> "dpoch"
    Path(part).write_bytes(bytes(data))
    assert pq.read_table(pa.BufferReader(bytes(data))).column_names.count("dpoch") == 1  # plain pyarrow is fooled
    assert reader.read_committed(str(tmp_path), JOB).num_rows == 0
    (record,) = quarantine.list_quarantined(layout.locate(str(tmp_path)), JOB)
    assert "dpoch" in record["reason"]


def test_forty_single_bit_flips_in_output_ids_pages_none_reads_back_altered_and_verify_catches_each(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    rng = random.Random(20)
    caught = 0
    for k in range(40):
        root = tmp_path / f"flip-{k}"
        rows = _rows(f"f{k}", 6, seed=k)
        (part,) = _write_parts(root, [rows])
        lo, hi = _page_body(part)
        _flip(part, rng.randrange(lo, hi), rng.randrange(8))
        table = reader.read_committed(str(root), JOB, columns=["prompt_id", "input_ids", "output_ids"])
        altered = [
            r["prompt_id"]
            for r, got in zip(rows, table.to_pylist(), strict=False)
            if got["output_ids"] != r["output_ids"] or got["input_ids"] != r["input_ids"]
        ]
        assert not altered, f"flip {k}: read back silently altered: {altered}"
        redis_client.flushdb()
        _submit(redis_client, rows)
        report = verify_job(_settings(root, redis_url), JOB)
        assert not report.ok, f"flip {k}: verify passed"
        if report.quarantined or report.checksum_mismatch:
            caught += 1
    assert caught == 40


def test_random_bit_flips_anywhere_in_a_part_never_read_back_altered(tmp_path: Path) -> None:
    """Anywhere: footer, page headers (outside the page CRC), dictionary pages. Each flip reads back as written
    or the part is quarantined; none reads back different."""
    rows = _rows("x", 6)
    (part,) = _write_parts(tmp_path, [rows])
    clean = Path(part).read_bytes()
    want = reader.read_committed(str(tmp_path), JOB)
    rng = random.Random(7)
    outcomes = {"same": 0, "quarantined": 0}
    lo, _ = _chunk_range(part)
    offsets = [rng.randrange(len(clean)) for _ in range(120)] + [rng.randrange(lo, lo + 40) for _ in range(60)]
    for offset in offsets:
        data = bytearray(clean)
        data[offset] ^= 1 << rng.randrange(8)
        for leftover in (tmp_path / JOB / quarantine.QUARANTINE_DIR).rglob("*"):
            if leftover.is_file():
                leftover.unlink()
        Path(part).write_bytes(bytes(data))
        got = reader.read_committed(str(tmp_path), JOB)
        if got.num_rows == 0:
            outcomes["quarantined"] += 1
        else:
            assert got.equals(want), f"a flip at byte {offset} read back altered"
            outcomes["same"] += 1
    assert outcomes["quarantined"] > 100, outcomes


def test_a_page_header_flip_that_drops_ids_is_caught_by_the_row_checksum(tmp_path: Path) -> None:
    """The page CRC covers the page body, not its header: a flipped bit in the header's value count cuts the
    last list short with every CRC intact. The row's ids_crc32 catches it."""
    rows = _rows("h", 8)
    (part,) = _write_parts(tmp_path, [rows])
    clean = Path(part).read_bytes()
    lo, body = _page_body(part)
    found = None
    for offset in range(lo - (body - lo), body):  # the header before the body
        for bit in range(8):
            data = bytearray(clean)
            data[offset] ^= 1 << bit
            try:  # as pyarrow reads it with page checksums verified
                checked = quarantine.open_checked(pa.py_buffer(bytes(data)))
                columns = ["prompt_id", "input_ids", "output_ids"]
                table = pa.Table.from_batches(list(quarantine.conformed_batches(checked, columns)))
            except Exception:
                continue
            if table["output_ids"].to_pylist() != [r["output_ids"] for r in rows]:
                found = bytes(data)
                break
        if found:
            break
    if found is None:
        pytest.skip("no header flip here alters the ids without an error")
    Path(part).write_bytes(found)
    assert reader.read_committed(str(tmp_path), JOB).num_rows == 0
    (record,) = quarantine.list_quarantined(layout.locate(str(tmp_path)), JOB)
    assert "ids_crc32" in record["reason"]


# -- the writer's questions -------------------------------------------------------------------------------------
def test_exists_and_final_counts_do_not_call_a_damaged_part_committed(tmp_path: Path) -> None:
    writer = PartWriter(str(tmp_path), "w1")
    rows = _rows("e", 3)
    good = writer.write(JOB, "ds", rows)
    assert writer.exists(good)
    assert writer.final_counts(JOB, "ds", good, "e-1")["completion_tokens"] == len(rows[1]["output_ids"])
    data = Path(good).read_bytes()
    Path(good).write_bytes(data[:-30])  # truncated
    assert writer.final_counts(JOB, "ds", good, "e-1") is None
    assert not writer.exists(good)
    flipped = writer.write(JOB, "ds", _rows("f", 3, seed=9))
    lo, _ = _page_body(flipped)
    _flip(flipped, lo + 5, 0)
    assert not writer.exists(flipped)  # every page checked, not only the footer
    assert [r["part"] for r in quarantine.list_quarantined(writer.loc, JOB)] == [good, flipped]


def test_a_damaged_compacted_file_replaces_nothing_and_the_parts_it_listed_are_live_again(tmp_path: Path) -> None:
    groups = [_rows("c", 2), _rows("d", 2, seed=5)]
    parts = _write_parts(tmp_path, groups)
    loc = layout.locate(str(tmp_path))
    table = reader.scan_parts(loc, parts, SCHEMA.names)
    path = layout.compacted_part_path(loc, JOB, "ds", 0)
    replaced = json.dumps(sorted(Path(p).name for p in parts)).encode()
    PartWriter(str(tmp_path), layout.COMPACT_TAG).write(
        JOB, "ds", table.select(SCHEMA.names), path, metadata={layout.COMPACTED_FROM_KEY: replaced}
    )
    assert [p.path for p in listing.list_parts(loc, JOB)] == [path]  # an interrupted compaction: old parts left
    Path(path).write_bytes(Path(path).read_bytes()[:100])
    assert [p.path for p in listing.list_parts(loc, JOB)] == parts
    assert reader.stored_prompt_ids(str(tmp_path), JOB) == {r["prompt_id"] for g in groups for r in g}
    assert quarantine.list_quarantined(loc, JOB)[0]["part"] == path


# -- verify -----------------------------------------------------------------------------------------------------
def _verify_cli(tmp_path: Path, redis_url: str, *extra: str) -> tuple[int, str]:
    args = [JOB, "--output-uri", str(tmp_path), "--redis-url", redis_url, "--key-prefix", KEYS.prefix, *extra]
    result = CliRunner().invoke(verify, args)
    return result.exit_code, result.output


def test_verify_fails_naming_the_quarantined_part_and_its_prompts_then_passes_once_they_are_stored_again(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    groups = [_rows("v", 3), _rows("w", 3, seed=40)]
    parts = _write_parts(tmp_path, groups)
    _submit(redis_client, groups[0] + groups[1])
    lo, _ = _page_body(parts[0])
    _flip(parts[0], lo + 7, 2)
    code, out = _verify_cli(tmp_path, redis_url, "--json")
    assert code == 1
    report = json.loads(out)
    assert not report["ok"]
    (q,) = report["quarantined"]
    assert q["part"] == parts[0] and q["prompt_ids"] == ["v-0", "v-1", "v-2"] and q["lost"] == q["prompt_ids"]
    assert not q["recovered"]
    assert report["missing"] == ["v-0", "v-1", "v-2"] and report["lost_rows"] == ["v-0", "v-1", "v-2"]
    assert report["checksum_mismatch"] == [] and report["fenced_rows"] == 0
    code, text = _verify_cli(tmp_path, redis_url)
    assert code == 1 and "QUARANTINED PARTS: 1" in text and parts[0] in text and "v-1" in text
    assert "MISSING: 3" in text
    # Regenerated (as a worker would store them again): recovered, verify passes, the file is still named.
    _write_parts(tmp_path, [groups[0]], worker="w2")
    code, text = _verify_cli(tmp_path, redis_url)
    assert code == 0, text
    assert "quarantined parts whose prompts are stored again: 1" in text


def test_verify_fails_on_a_row_whose_ids_crc32_does_not_match(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    rows = _rows("k", 4)
    table = rows_to_table(rows, defaults={"job": JOB, "dataset": "ds", "worker": "w1", "worker_host": "h"})
    crc = table[IDS_CRC32].to_pylist()
    crc[2] ^= 1
    bad = table.set_column(table.schema.get_field_index(IDS_CRC32), IDS_CRC32, pa.array(crc, pa.int64()))
    _submit(redis_client, rows)
    # As a reader sees it: the part is not what was written, so it is quarantined, and verify fails.
    PartWriter(str(tmp_path), "w1").write(JOB, "ds", bad)
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert not report.ok and report.quarantined and "k-2" in report.quarantined[0]["reason"]
    # checksum_mismatches itself names the row (verify's own recomputation over the committed view).
    from storage.checks import checksum_mismatches

    assert checksum_mismatches(bad) == ["k-2"]
    old = bad.set_column(bad.schema.get_field_index(IDS_CRC32), IDS_CRC32, pa.nulls(4, pa.int64()))
    assert checksum_mismatches(old) == []  # rows before schema 6 carry none: not checked


def test_fenced_rows_are_reported_not_failed_and_compaction_removes_them(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    rows = _rows("z", 4)
    for r in rows:
        r["epoch"] = 10
    stale = [dict(r, epoch=3, worker="zombie") for r in rows[:2]]
    _write_parts(tmp_path, [rows])
    _write_parts(tmp_path, [stale], worker="zombie")  # a paused worker's write, landed after the finalized one
    _submit(redis_client, rows)
    code, out = _verify_cli(tmp_path, redis_url, "--json")
    report = json.loads(out)
    assert code == 0, out
    assert report["fenced_rows"] == 2 and report["fenced"] == ["z-0", "z-1"]
    assert report["duplicated"] == [] and report["stored_rows"] == 6 and report["committed"] == 4
    code, text = _verify_cli(tmp_path, redis_url)
    assert code == 0 and "fenced: 2 rows" in text
    committed = reader.read_committed(str(tmp_path), JOB, columns=["prompt_id", "epoch", "worker"])
    assert committed["epoch"].to_pylist() == [10] * 4 and "zombie" not in committed["worker"].to_pylist()

    result = CliRunner().invoke(compact, [JOB, "--output-uri", str(tmp_path), "--redis-url", redis_url])
    assert result.exit_code == 0 and "2 fenced rows dropped" in result.output
    raw = pq.read_table(tmp_path / JOB)
    assert raw.num_rows == 4 and set(raw["epoch"].to_pylist()) == {10}
    assert json.loads(_verify_cli(tmp_path, redis_url, "--json")[1])["fenced_rows"] == 0


def test_verify_counts_manifest_prompts_unknown_to_redis_as_missing(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    rows = _rows("m", 6)
    _write_parts(tmp_path, [rows[:4]])
    write_submitted(str(tmp_path), JOB, rows)  # the manifest knows all 6
    _submit(redis_client, rows[:4])  # Redis lost the last two (a rollback to an older dump)
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.unknown_to_redis == ["m-4", "m-5"]
    assert report.missing == ["m-4", "m-5"] and report.submitted == 6 and not report.ok


def test_verify_counts_a_prompt_done_in_redis_without_a_row_as_missing(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    rows = _rows("n", 3)
    _write_parts(tmp_path, [rows[:2]])
    _submit(redis_client, rows[:2])
    redis_client.sadd(KEYS.done(JOB), "n-2")  # done, never submitted as far as Redis knows, no row
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.lost_rows == ["n-2"] and report.missing == ["n-2"] and not report.ok


# -- compaction -------------------------------------------------------------------------------------------------
def test_compaction_survives_a_damaged_part_and_does_not_claim_to_replace_it(tmp_path: Path) -> None:
    groups = [_rows(f"p{k}", 2, seed=k * 3) for k in range(3)]
    parts = _write_parts(tmp_path, groups)
    Path(parts[1]).write_bytes(b"")
    result = compact_job(_settings(tmp_path), JOB)
    (d,) = result.datasets
    assert d.quarantined == [parts[1]] and d.rows_after == 4 and len(d.files_written) == 1
    meta = pq.read_metadata(d.files_written[0]).metadata[layout.COMPACTED_FROM_KEY]
    assert Path(parts[1]).name not in json.loads(meta)
    assert reader.stored_prompt_ids(str(tmp_path), JOB) == {r["prompt_id"] for g in (groups[0], groups[2]) for r in g}
    assert _quarantined_files(tmp_path) == [
        f"dataset=ds/{Path(parts[1]).name}",
        f"dataset=ds/{Path(parts[1]).name}.json",
    ]


# -- regenerating what was lost ---------------------------------------------------------------------------------
def _queued(client: redis.Redis, settings: Settings) -> list[PromptTask]:
    import base64

    import msgpack

    out = []
    for raw in client.lrange(settings.queue, 0, -1):
        message = json.loads(raw)
        args, _kwargs, _embed = msgpack.unpackb(base64.b64decode(message["body"]), raw=False)
        out.append(PromptTask.from_args(args))
    return sorted(out, key=lambda t: t.prompt_id)


def test_retry_missing_resends_the_prompts_of_a_quarantined_part_and_names_what_it_cannot(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = _settings(tmp_path, redis_url)
    flipped = _rows("r", 3)
    flipped[1]["revision"] = 1  # a --truncated re-run's row: re-sent at its revision with its budget
    flipped[1]["sampling_params"] = {"max_new_tokens": 4096, "temperature": 1.0}
    truncated, fine = _rows("t", 2, seed=30), _rows("u", 2, seed=60)
    parts = _write_parts(tmp_path, [flipped, truncated, fine])
    _submit(redis_client, flipped + truncated + fine)
    redis_client.hset(KEYS.counters(JOB), "done", 7)
    _, hi = _page_body(parts[0])
    _flip(parts[0], hi - 3, 6)  # output_ids damaged: the prompts still decode
    Path(parts[1]).write_bytes(Path(parts[1]).read_bytes()[:-20])  # footer gone: nothing decodes

    result = CliRunner().invoke(
        retry, [JOB, "--missing", "--json", "--redis-url", redis_url, "--output-uri", str(tmp_path),
                "--key-prefix", KEYS.prefix],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["prompt_ids"] == ["r-0", "r-1", "r-2"]
    assert payload["skipped"] == {"t-0": NO_PROMPT_LEFT, "t-1": NO_PROMPT_LEFT}
    tasks = _queued(redis_client, settings)
    assert [t.prompt_id for t in tasks] == ["r-0", "r-1", "r-2"]
    for task, row in zip(tasks, flipped, strict=True):
        assert task.input_ids == row["input_ids"] and task.content_hash == row["content_hash"]
        assert task.revision == row.get("revision", 0) and task.dataset == "ds"
    assert tasks[1].overrides == {"max_new_tokens": 4096}
    done = {m.decode() for m in redis_client.smembers(KEYS.done(JOB))}
    assert done == {"u-0", "u-1"}  # out of done: the re-sent ones run, the others wait for a re-submit
    assert int(redis_client.hget(KEYS.counters(JOB), "done")) == 2
    assert queued_prompt_ids(redis_client, settings, JOB) == {"r-0", "r-1", "r-2"}
    # Nothing more to do while they are in flight.
    assert list(retry_missing(settings, JOB)) == []


def test_retry_missing_refuses_a_location_that_holds_nothing_of_the_job(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    rows = _rows("s", 2)
    _submit(redis_client, rows)
    from producer.state import StateError

    with pytest.raises(StateError, match="holds no part"):
        retry_missing(_settings(tmp_path / "elsewhere", redis_url), JOB)
    assert redis_client.scard(KEYS.done(JOB)) == 2


# -- S3 ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import urllib.request

    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    from testing.fleet import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="dmg")
    yield endpoint
    server.stop()


def test_a_damaged_part_on_s3_is_quarantined_through_the_filesystem(s3_endpoint: str) -> None:
    import boto3

    uri = "s3://dmg/runs"
    writer = PartWriter(uri, "w1", s3_endpoint)
    bad = writer.write(JOB, "ds", _rows("q", 2))
    writer.write(JOB, "ds", _rows("o", 2, seed=8))
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    key = bad[len("s3://dmg/") :]
    body = client.get_object(Bucket="dmg", Key=key)["Body"].read()
    client.put_object(Bucket="dmg", Key=key, Body=body[: len(body) // 3])
    assert reader.stored_prompt_ids(uri, JOB, s3_endpoint_url=s3_endpoint) == {"o-0", "o-1"}
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="dmg")["Contents"])
    name = key.rsplit("/", 1)[1]
    assert f"runs/{JOB}/_quarantine/dataset=ds/{name}" in keys and key not in keys
    (record,) = quarantine.list_quarantined(layout.locate(uri, s3_endpoint), JOB)
    assert record["part"] == bad and record["present"]


def test_a_resubmit_re_enqueues_a_done_prompt_whose_row_was_in_a_quarantined_part(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    from producer.submit import submit
    from producer.submit_options import SubmitOptions
    from testing.datasets import chat_rows, write_jsonl
    from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir

    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(6, words=10))

    def opts() -> SubmitOptions:
        return SubmitOptions(paths=[path], job="j", tokenizer=str(tok_dir), processes=1)

    submit(settings, opts())
    first = {t.prompt_id: t for t in _queued(redis_client, settings)}
    redis_client.delete(settings.queue)  # all six ran: stored, done, acked
    writer = PartWriter(settings.output_uri, "w1")
    parts = [
        writer.write("j", "alpha", [make_row(f"alpha/r{i}", dataset="alpha", job="j", seed=i) for i in group])
        for group in ((0, 1, 2), (3, 4, 5))
    ]
    redis_client.sadd(settings.keys.done("j"), *first)
    redis_client.hset(settings.keys.counters("j"), "done", 6)
    lo, _ = _page_body(parts[1])
    _flip(parts[1], lo + 3, 1)
    assert submit(settings, opts()).enqueued == 0  # the prompt ids still read: nothing known lost yet
    assert reader.check_parts(settings.output_uri, "j") == [parts[1]]  # (verify does this) quarantined

    report = submit(settings, opts())
    assert report.enqueued == 3
    again = _queued(redis_client, settings)
    assert [t.prompt_id for t in again] == ["alpha/r3", "alpha/r4", "alpha/r5"]
    assert all(t.input_ids == first[t.prompt_id].input_ids for t in again)
    assert {m.decode() for m in redis_client.smembers(settings.keys.done("j"))} == {"alpha/r0", "alpha/r1", "alpha/r2"}
    assert int(redis_client.hget(settings.keys.counters("j"), "done")) == 3
    assert submit(settings, opts()).enqueued == 0  # queued now: not again
