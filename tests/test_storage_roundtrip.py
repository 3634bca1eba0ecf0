"""PartWriter → Parquet on disk → readers: exact ids, the committed view, atomic commits."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from storage import layout, reader
from storage.manifest import read_submitted, write_submitted
from storage.schema import SCHEMA, rows_to_table
from storage.writer import PartWriter
from testing.rows import kimi_output, kimi_prompt, make_row
from thinkfleet import kimi

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def test_ids_round_trip_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = [
        make_row(f"p-{i}", input_ids=kimi_prompt(rng, 50 + i), output_ids=kimi_output(rng, 100 + i, 7))
        for i in range(20)
    ]
    writer = PartWriter(str(tmp_path), "w1")
    part = writer.write("job", "ds", rows)
    table = pq.read_table(part)
    assert table.schema.equals(SCHEMA, check_metadata=False)
    assert table["input_ids"].to_pylist() == [r["input_ids"] for r in rows]
    assert table["output_ids"].to_pylist() == [r["output_ids"] for r in rows]
    # Spans were computed from the ids: reasoning is the tokens before </think>.
    for row, stored in zip(rows, table.to_pylist(), strict=True):
        out = row["output_ids"]
        assert stored["reasoning_start"] == 0
        assert out[stored["reasoning_end"]] == kimi.THINK_END and stored["has_think_end"]
        assert stored["stop_token"] == kimi.IM_END
        assert stored["completion_tokens"] == len(out)
        assert stored["finish_reason"] == "stop" and stored["finish_matched"] == str(kimi.IM_END)


def test_numpy_list_and_given_spans_make_the_same_table() -> None:
    rng = np.random.default_rng(2)
    rows = [make_row(f"p-{i}", output_ids=kimi_output(rng, 40, 5, tool_calls=i % 3)) for i in range(9)]
    as_lists = rows_to_table(rows)
    as_numpy = rows_to_table(
        [
            {**r, "input_ids": np.array(r["input_ids"]), "output_ids": np.array(r["output_ids"], dtype=np.int32)}
            for r in rows
        ]
    )
    given = rows_to_table([{**r, **_spans_of(as_lists, i)} for i, r in enumerate(rows)])
    for other in (as_numpy, given):
        assert other.drop(["created_at"]).equals(as_lists.drop(["created_at"]))


def _spans_of(table, i):
    row = table.slice(i, 1).to_pylist()[0]
    keys = ("reasoning_start", "reasoning_end", "has_think_end", "answer_start", "answer_end", "stop_token")
    return {k: row[k] for k in keys} | {"tool_call_spans": row["tool_call_spans"]}


def test_missing_required_column_names_the_row() -> None:
    row = make_row("p-1")
    del row["prompt_id"]
    with pytest.raises(ValueError, match="prompt_id"):
        rows_to_table([make_row("p-0"), row])


def test_out_of_range_token_id_is_refused() -> None:
    with pytest.raises(ValueError, match="int32"):
        rows_to_table([make_row("p-0", output_ids=[1, 2**40])])
    with pytest.raises(ValueError, match="negative"):
        rows_to_table([make_row("p-0", output_ids=np.array([1, -5], dtype=np.int32))])


def test_part_names_are_unique_and_in_the_dataset_dir(tmp_path: Path) -> None:
    writer = PartWriter(str(tmp_path), "host/a b")  # unsafe characters in the identity
    names = {writer.part_name("job", "my ds") for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert os.path.dirname(name) == str(tmp_path / "job" / "dataset=my%20ds")
        assert layout.is_part_name(os.path.basename(name)) and "host_a_b" in name


def test_write_refuses_rows_of_another_dataset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dataset"):
        PartWriter(str(tmp_path), "w1").write("job", "ds", [make_row("p-0", dataset="other")])


def test_committed_view_keeps_one_row_per_prompt(tmp_path: Path) -> None:
    uri = str(tmp_path)
    early = PartWriter(uri, "w-b")
    late = PartWriter(uri, "w-a")
    early.write("job", "ds", [make_row("p-1", worker="w-b", created_at=T0), make_row("p-2", created_at=T0)])
    # A redelivered copy of p-1, later: the earliest created_at wins.
    late.write("job", "ds", [make_row("p-1", worker="w-a", created_at=T0 + timedelta(seconds=5))])
    # p-2 retried at a higher revision: the highest revision wins even though it is later.
    late.write("job", "ds", [make_row("p-2", revision=1, worker="w-a", created_at=T0 + timedelta(hours=1))])
    committed = reader.read_committed(uri, "job")
    got = {r["prompt_id"]: (r["worker"], r["revision"]) for r in committed.to_pylist()}
    assert got == {"p-1": ("w-b", 0), "p-2": ("w-a", 1)}
    assert reader.stored_prompt_ids(uri, "job") == {"p-1", "p-2"}
    dups = reader.raw_duplicates(uri, "job")
    assert set(dups["prompt_id"].to_pylist()) == {"p-1"}  # p-2's revision 0 is superseded, not duplicated


def test_committed_view_tie_breaks_deterministically(tmp_path: Path) -> None:
    uri = str(tmp_path)
    for worker in ("w-z", "w-a", "w-m"):
        PartWriter(uri, worker).write("job", "ds", [make_row("p-1", worker=worker, created_at=T0)])
    assert reader.read_committed(uri, "job", columns=["worker"])["worker"].to_pylist() == ["w-a"]


def test_readers_ignore_temp_files_and_the_manifest(tmp_path: Path) -> None:
    uri = str(tmp_path)
    PartWriter(uri, "w1").write("job", "ds", [make_row("p-1")])
    ds_dir = tmp_path / "job" / "dataset=ds"
    (ds_dir / ".part-x.parquet.tmp-0001").write_bytes(b"half a file")  # a writer died mid-write
    write_submitted(uri, "job", [{"prompt_id": "p-1", "dataset": "ds", "row_index": 1, "content_hash": "h"}])
    assert reader.read_committed(uri, "job").num_rows == 1
    assert pq.read_table(str(tmp_path / "job")).num_rows == 1  # plain pyarrow skips them too
    (ds_dir / "part-stray.parquet.tmp").write_bytes(b"not a part")  # not ours, still not a part name
    assert reader.read_committed(uri, "job").num_rows == 1


def test_local_write_leaves_no_temp_file(tmp_path: Path) -> None:
    PartWriter(str(tmp_path), "w1").write("job", "ds", [make_row("p-1")])
    assert [p.name for p in (tmp_path / "job" / "dataset=ds").iterdir() if p.name.startswith(".")] == []


def test_failed_write_commits_nothing(tmp_path: Path) -> None:
    writer = PartWriter(str(tmp_path), "w1")
    part = writer.part_name("job", "ds")
    with pytest.raises(ValueError):
        writer.write("job", "ds", [make_row("p-1", output_ids=[1, 2**40])], part)
    assert not writer.exists(part)
    assert reader.read_committed(str(tmp_path), "job").num_rows == 0


def test_exists_tells_whether_an_intended_part_committed(tmp_path: Path) -> None:
    writer = PartWriter(str(tmp_path), "w1")
    intended = writer.part_name("job", "ds")
    assert not writer.exists(intended)
    assert writer.write("job", "ds", [make_row("p-1")], intended) == intended
    assert writer.exists(intended)


def test_manifest_keeps_the_latest_submit(tmp_path: Path) -> None:
    uri = str(tmp_path)
    write_submitted(uri, "job", [{"prompt_id": "a", "dataset": "ds", "row_index": 0, "content_hash": "h1"}])
    write_submitted(
        uri,
        "job",
        [
            {"prompt_id": "a", "dataset": "ds", "row_index": 0, "content_hash": "h2", "prompt_tokens": 9},
            {"prompt_id": "b", "dataset": "ds", "row_index": 1, "content_hash": "h3"},
        ],
    )
    table = read_submitted(uri, "job")
    assert {r["prompt_id"]: r["content_hash"] for r in table.to_pylist()} == {"a": "h2", "b": "h3"}
    assert read_submitted(uri, "nope").num_rows == 0


def test_job_names_that_are_not_one_visible_directory_are_refused(tmp_path: Path) -> None:
    writer = PartWriter(str(tmp_path), "w1")
    for job in ("../escape", "a/b", "_hidden", ".dot", ""):
        with pytest.raises(ValueError, match="job name"):
            writer.part_name(job, "ds")
