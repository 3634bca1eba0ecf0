"""``producer compact``: fewer files, the same committed view, safe to interrupt."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from storage import compact as compact_mod
from storage import reader
from storage.cli import compact
from storage.compact import compact_job
from storage.writer import PartWriter
from testing.rows import make_row
from thinkfleet.settings import Settings

JOB = "job"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _parts(root: Path, dataset: str) -> list[str]:
    return sorted(p.name for p in (root / JOB / f"dataset={dataset}").glob("part-*.parquet"))


def _many_small_parts(root: Path) -> list[str]:
    """Two datasets of one-row parts, with a redelivered duplicate and a retried revision."""
    intents = []
    for w in ("w1", "w2"):
        writer = PartWriter(str(root), w)
        for i in range(8):
            dataset = "a" if i % 2 else "b"
            part = writer.part_name(JOB, dataset)
            intents.append(part)
            when = T0 + timedelta(seconds=i + (10 if w == "w2" else 0))
            writer.write(JOB, dataset, [make_row(f"p-{i}", dataset=dataset, worker=w, seed=i, created_at=when)], part)
    PartWriter(str(root), "w3").write(JOB, "a", [make_row("p-1", dataset="a", revision=2, worker="w3", seed=99)])
    return intents


def _settings(root: Path) -> Settings:
    return Settings(output_uri=str(root))


def _view(root: Path) -> pa.Table:
    return reader.read_committed(str(root), JOB)


def test_compaction_preserves_the_committed_view(tmp_path: Path) -> None:
    intents = _many_small_parts(tmp_path)
    before = _view(tmp_path)
    assert reader.raw_duplicates(str(tmp_path), JOB).num_rows > 0

    result = compact_job(_settings(tmp_path), JOB)

    assert _view(tmp_path).equals(before)  # every column, every byte of every id
    assert reader.raw_duplicates(str(tmp_path), JOB).num_rows == 0
    assert len(_parts(tmp_path, "a")) == len(_parts(tmp_path, "b")) == 1
    assert {d.dataset: d.rows_after for d in result.datasets} == {"a": 4, "b": 4}
    writer = PartWriter(str(tmp_path), "w1")
    assert all(writer.exists(p) for p in intents)  # recorded intents still read as committed
    assert compact_job(_settings(tmp_path), JOB).datasets[0].skipped  # a second run has nothing to do


def test_compaction_can_split_into_several_files(tmp_path: Path) -> None:
    _many_small_parts(tmp_path)
    before = _view(tmp_path)
    compact_job(_settings(tmp_path), JOB, max_rows_per_file=3)
    assert len(_parts(tmp_path, "a")) == 2
    assert _view(tmp_path).equals(before)


def test_interrupted_compaction_loses_and_duplicates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _many_small_parts(tmp_path)
    before = _view(tmp_path)
    real_delete = compact_mod._delete
    deleted: list[str] = []

    def crash_after_two(loc, path):  # the process dies mid-cleanup
        if len(deleted) == 2:
            raise KeyboardInterrupt
        deleted.append(path)
        real_delete(loc, path)

    monkeypatch.setattr(compact_mod, "_delete", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        compact_job(_settings(tmp_path), JOB)
    assert len(_parts(tmp_path, "a")) + len(_parts(tmp_path, "b")) > 2  # old parts still on disk…
    assert _view(tmp_path).equals(before)  # …but superseded: the view is unchanged
    # Dataset a was compacted (then cleanup died): no copies; b was not reached yet.
    assert reader.raw_duplicates(str(tmp_path), JOB, datasets=["a"]).num_rows == 0

    monkeypatch.setattr(compact_mod, "_delete", real_delete)
    compact_job(_settings(tmp_path), JOB)  # the rerun finishes the job
    assert len(_parts(tmp_path, "a")) == len(_parts(tmp_path, "b")) == 1
    assert _view(tmp_path).equals(before)


def test_parts_committed_during_compaction_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _many_small_parts(tmp_path)
    real_scan = reader.scan_parts
    late = make_row("p-late", dataset="a", seed=5)

    def scan_then_commit(loc, paths, columns):  # a worker commits meanwhile
        table = real_scan(loc, paths, columns)
        PartWriter(str(tmp_path), "w9").write(JOB, "a", [late])
        return table

    monkeypatch.setattr(reader, "scan_parts", scan_then_commit)
    compact_job(_settings(tmp_path), JOB, datasets=["a"])
    monkeypatch.setattr(reader, "scan_parts", real_scan)
    assert len(_parts(tmp_path, "a")) == 2  # the compacted file and the late part
    assert "p-late" in reader.stored_prompt_ids(str(tmp_path), JOB)


def test_compact_cli_reports_each_dataset(tmp_path: Path) -> None:
    _many_small_parts(tmp_path)
    result = CliRunner().invoke(compact, [JOB, "--output-uri", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "a: 9 parts, 9 rows -> 4 rows" in result.output


def _conversations(root: Path, turns: int = 12) -> dict[str, tuple[str, int, int]]:
    """Two ``--turns all`` conversations, one part per turn row, one turn delivered twice, and a single-turn row."""
    want: dict[str, tuple[str, int, int]] = {}
    writer = PartWriter(str(root), "w1")
    for c, conv in enumerate(("alpha-0", "alpha-1")):
        for t in range(turns):
            pid = f"{conv}/t{t}"
            row = make_row(pid, dataset="a", seed=t, row_index=c, conversation_id=conv, turn_index=t, turn_count=turns)
            writer.write(JOB, "a", [row])
            want[pid] = (conv, t, turns)
    again = make_row("alpha-1/t3", dataset="a", seed=3, row_index=1, conversation_id="alpha-1", turn_index=3)
    PartWriter(str(root), "w2").write(JOB, "a", [{**again, "turn_count": turns}])  # a redelivered turn
    writer.write(JOB, "a", [make_row("alpha-9", dataset="a", row_index=9)])  # a single-turn row: no conversation
    return want


def test_compaction_keeps_every_turn_row_once_with_its_conversation_columns(tmp_path: Path) -> None:
    want = _conversations(tmp_path)
    before = _view(tmp_path)
    assert reader.raw_duplicates(str(tmp_path), JOB).num_rows == 2

    compact_job(_settings(tmp_path), JOB)

    after = _view(tmp_path)
    assert after.equals(before) and len(_parts(tmp_path, "a")) == 1
    assert reader.raw_duplicates(str(tmp_path), JOB).num_rows == 0
    rows = pq.read_table(tmp_path / JOB / "dataset=a" / _parts(tmp_path, "a")[0]).to_pylist()
    turns = {r["prompt_id"]: (r["conversation_id"], r["turn_index"], r["turn_count"]) for r in rows}
    assert len(rows) == len(turns) == len(want) + 1
    assert {k: v for k, v in turns.items() if k != "alpha-9"} == want
    assert turns["alpha-9"] == (None, None, None)
    # The file lists each conversation's turns in order (t2 before t10), conversations in source order.
    listed = [r["prompt_id"] for r in rows if r["conversation_id"] == "alpha-1"]
    assert listed == [f"alpha-1/t{t}" for t in range(12)]
