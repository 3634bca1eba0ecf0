"""``--no-reasoning-spans``: rows store null reasoning/answer spans ("not recorded", never 0:0), and every
reader — the schema, verify's row checks, report, export — treats null as not recorded."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import reader
from storage.checks import row_problems
from storage.conversations import decode
from storage.exports import ExportError, export_job, load_tokenizer
from storage.report import summarize
from storage.schema import REASONING_SPAN_COLUMNS, SCHEMA, rows_to_table
from storage.spans import KIMI_TOKENS, compute_spans
from storage.writer import PartWriter
from testing.rows import make_row
from tests.test_storage_export import JOB, _manifest, _output, _prompt, _settings, _source, tokenizer_dir
from thinkfleet import kimi, profiles

__all__ = ["tokenizer_dir"]  # the module-scoped fixture, shared with test_storage_export

#: What a job record run with --no-reasoning-spans yields (thinkfleet.profiles.span_tokens): no think markers.
OFF = profiles.span_tokens(
    "kimi",
    {
        "think_start_id": kimi.THINK_START,
        "think_end_id": kimi.THINK_END,
        "tool_section_begin_id": kimi.TOOL_CALLS_SECTION_BEGIN,
        "tool_section_end_id": kimi.TOOL_CALLS_SECTION_END,
        "tool_call_begin_id": kimi.TOOL_CALL_BEGIN,
        "tool_call_end_id": kimi.TOOL_CALL_END,
    },
    (kimi.IM_END,),
    reasoning_spans=False,
)


def _rows(n: int = 6) -> list[dict]:
    rng = np.random.default_rng(3)
    return [make_row(f"p-{i}", input_ids=_prompt(rng), output_ids=_output(rng, i % 2)) for i in range(n)]


def test_a_job_without_reasoning_spans_stores_null_spans_not_zero() -> None:
    assert not OFF.reasoning_spans and OFF.think_start_id is None and OFF.tool_call_begin_id == kimi.TOOL_CALL_BEGIN
    computed = rows_to_table(_rows(), tokens=OFF).to_pylist()
    # A worker's row carries spans computed without think markers (0:0 …): stored null all the same.
    given = []
    for row in _rows():
        s = compute_spans(row["output_ids"], prompt_ends_with_think_start=False, **vars(OFF))
        given.append(
            {
                **row,
                **{c: getattr(s, c) for c in REASONING_SPAN_COLUMNS},
                "tool_call_spans": [],
                "stop_token": s.stop_token,
            }
        )
    for stored in (computed, rows_to_table(given, tokens=OFF).to_pylist()):
        for row in stored:
            assert all(row[c] is None for c in REASONING_SPAN_COLUMNS), row
            assert row["stop_token"] == kimi.IM_END
    # Tool-call spans are still found with the tokenizer's tool markers.
    assert [len(r["tool_call_spans"]) for r in computed] == [0, 1, 0, 1, 0, 1]
    # A job with spans stores values, never null.
    on = rows_to_table(_rows(), tokens=KIMI_TOKENS).to_pylist()
    assert all(r[c] is not None for r in on for c in REASONING_SPAN_COLUMNS)


def test_verify_takes_null_spans_as_not_recorded_and_flags_them_in_a_job_that_records_spans() -> None:
    table = rows_to_table(_rows(), tokens=OFF)
    problems, stats = row_problems(table, OFF)
    assert problems == {}
    assert (stats.thinking_rows, stats.think_end_rows) == (0, 0)  # no alarm without spans
    problems, _ = row_problems(table, KIMI_TOKENS)
    assert set(problems) == {f"p-{i}" for i in range(6)}
    assert all(
        p == ["reasoning/answer spans are null (not recorded) but the job records them"] for p in problems.values()
    )
    # Rows an older job without spans stored as 0:0 still pass (nothing to check in such a job).
    assert row_problems(rows_to_table(_rows(), tokens=replace(OFF, reasoning_spans=True)), OFF)[0] == {}


def test_old_parts_with_required_span_columns_read_back_next_to_new_ones(tmp_path: Path) -> None:
    """Parts written before schema 5 declared the span columns non-null; they read back with their values."""
    old_schema = pa.schema(
        [f.with_nullable(False) if f.name in REASONING_SPAN_COLUMNS else f for f in SCHEMA], metadata=SCHEMA.metadata
    )
    old = rows_to_table(_rows(3), tokens=KIMI_TOKENS).cast(old_schema)
    part = tmp_path / JOB / "dataset=ds" / "part-00000-old.parquet"
    part.parent.mkdir(parents=True)
    pq.write_table(old, part)
    PartWriter(str(tmp_path), "w2", tokens=OFF).write(JOB, "ds", [make_row(f"q-{i}", seed=i) for i in range(2)])
    view = reader.read_committed(str(tmp_path), JOB).to_pylist()
    by_id = {r["prompt_id"]: r for r in view}
    assert len(by_id) == 5
    assert all(by_id[f"p-{i}"]["reasoning_end"] is not None for i in range(3))
    assert all(by_id[f"q-{i}"]["reasoning_end"] is None for i in range(2))


def test_report_shows_no_reasoning_numbers_when_spans_were_not_recorded() -> None:
    summary = summarize(JOB, rows_to_table(_rows(), tokens=OFF))  # no job record: the nulls say it
    assert summary["reasoning_spans"] is False
    assert summary["reasoning_tokens"] is None and summary["think_end_rate"] is None
    assert summary["reasoning_share"] == {} and summary["rows"] == 6
    with_spans = summarize(JOB, rows_to_table(_rows(), tokens=KIMI_TOKENS))
    assert with_spans["reasoning_spans"] is True and with_spans["think_end_rate"] == 1.0


@pytest.fixture
def no_span_rows(tmp_path: Path) -> dict[str, dict]:
    rows = _rows(5)
    PartWriter(str(tmp_path / "out"), "w1", tokens=OFF).write(JOB, "ds", rows)
    return {r["prompt_id"]: r for r in rows}


def test_token_exports_train_on_the_whole_output_and_refuse_span_options(
    tmp_path: Path, no_span_rows: dict[str, dict]
) -> None:
    result = export_job(_settings(tmp_path), JOB, "eagle3", str(tmp_path / "e.parquet"))
    assert result.rows == 5
    for rec in pq.read_table(result.path).to_pylist():
        row = no_span_rows[rec["id"]]
        assert rec["loss_mask"] == [0] * len(row["input_ids"]) + [1] * len(row["output_ids"])
    for option in ({"exclude_reasoning": True}, {"min_reasoning_tokens": 3}):
        name = "--exclude-reasoning" if "exclude_reasoning" in option else "--min-reasoning-tokens"
        with pytest.raises(ExportError, match=f"{name} needs reasoning spans.*--no-reasoning-spans"):
            export_job(_settings(tmp_path), JOB, "specforge", str(tmp_path / "s.jsonl"), **option)
    assert not (tmp_path / "s.jsonl").exists()


def test_text_exports_put_the_whole_output_in_content_without_reasoning_content(
    tmp_path: Path, no_span_rows: dict[str, dict], tokenizer_dir: str
) -> None:
    _manifest(tmp_path, list(no_span_rows.values()))
    out = tmp_path / "m.jsonl"
    export_job(_settings(tmp_path), JOB, "messages", str(out), tokenizer=tokenizer_dir)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5
    tok = load_tokenizer(tokenizer_dir)
    for rec in records:
        row = no_span_rows[rec["id"]]
        *source, reply = rec["messages"]
        assert source == _source(row) and "reasoning_content" not in reply
        out_ids = row["output_ids"]
        # Everything up to the tool calls (reasoning and </think> included: where it ends is not recorded).
        end = out_ids.index(kimi.TOOL_CALL_BEGIN) if kimi.TOOL_CALL_BEGIN in out_ids else len(out_ids) - 1
        assert reply["content"] == decode(tok, out_ids[:end]) and "</think>" in reply["content"]
        assert ("tool_calls" in reply) == (kimi.TOOL_CALL_BEGIN in out_ids)
        assert rec["has_think_end"] is None
