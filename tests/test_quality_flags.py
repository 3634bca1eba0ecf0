"""Quality flags (issue 46): each rule of storage/quality.py on synthetic and real-shaped outputs, the stored columns,
older parts computed alike on read, ``verify``'s counts, and the exports' ``--drop-flag`` leaving out exactly the
flagged rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from storage.cli import export
from storage.exports import ExportError, export_job
from storage.flags import FLAG_NAMES, count_flags, parse_flags, table_flags
from storage.quality import LOOP_FULL_IDS, LOOP_MAX_PERIOD, loop_period
from storage.schema import QUALITY_COLUMNS, rows_to_table
from storage.writer import PartWriter
from testing.rows import kimi_prompt, make_row
from thinkfleet import kimi
from thinkfleet.settings import Settings
from thinkfleet.tokens import KIMI_TOKENS

JOB = "job"
RNG = np.random.default_rng(46)


def words(n: int) -> list[int]:
    """Ordinary ids with no marker and no accidental repetition at the end (a permutation, then more)."""
    return (RNG.permutation(5000)[: min(n, 5000)].tolist() * (n // 5000 + 1))[:n]


def looped(prefix: int, period: int, tail: int) -> list[int]:
    cycle = words(period)
    return words(prefix) + (cycle * (tail // period + 1))[:tail]


# -- the loop rule -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("period", [1, 2, 17, LOOP_MAX_PERIOD])
def test_a_long_output_ending_in_a_cycle_is_a_loop_with_its_period(period: int) -> None:
    body = np.array(looped(3000, period, max(LOOP_FULL_IDS, 4 * period)), dtype=np.int64)
    assert loop_period(body) == period


def test_a_cycle_longer_than_the_longest_period_is_no_loop() -> None:
    body = np.array(looped(3000, LOOP_MAX_PERIOD + 1, 2000), dtype=np.int64)
    assert loop_period(body) == 0


def test_a_long_output_needs_256_repeated_ids_and_a_short_one_a_quarter() -> None:
    # 10,000 ids ending in 250 repeated ids: under 256 and under a quarter — not a loop; 300: a loop.
    assert loop_period(np.array(looped(9750, 5, 250), dtype=np.int64)) == 0
    assert loop_period(np.array(looped(9700, 5, 300), dtype=np.int64)) == 5
    # 200 ids: a quarter is 50 ids.
    assert loop_period(np.array(looped(160, 4, 40), dtype=np.int64)) == 0
    assert loop_period(np.array(looped(145, 4, 55), dtype=np.int64)) == 4


def test_a_short_repeated_tail_is_formatting_not_a_loop() -> None:
    # Three trailing newlines at the end of an 8-id answer: fewer than 32 ids.
    assert loop_period(np.array([*words(5), 198, 198, 198], dtype=np.int64)) == 0
    assert loop_period(np.array([7] * 31, dtype=np.int64)) == 0
    assert loop_period(np.array([7] * 32, dtype=np.int64)) == 1


def test_a_loop_escaped_with_a_stop_token_counts_one_escaped_with_text_does_not() -> None:
    stopped = [*looped(500, 3, 300), kimi.IM_END]
    escaped = looped(500, 3, 300) + words(40) + [kimi.IM_END]
    table = rows_to_table([make_row("p-0", output_ids=stopped), make_row("p-1", output_ids=escaped)])
    assert table["loop"].to_pylist() == [True, False]
    assert table["loop_period"].to_pylist() == [3, None]


# -- the span flags --------------------------------------------------------------------------------------------------
def flags_of(output_ids: list[int], *, thinking: bool = True, finish: str = "stop") -> dict[str, bool]:
    row = make_row("p-0", input_ids=kimi_prompt(RNG, 20, thinking=thinking), output_ids=output_ids)
    row["finish_reason"] = finish
    table = rows_to_table([row])
    return {name: values[0] for name, values in table_flags(table, KIMI_TOKENS).items()}


def raised(flags: dict[str, bool]) -> set[str]:
    return {name for name, on in flags.items() if on}


def test_an_ordinary_answer_carries_no_flag() -> None:
    assert raised(flags_of([*words(40), kimi.THINK_END, *words(20), kimi.IM_END])) == set()


def test_reasoning_never_closed_is_no_think_end_and_cut_off_is_also_truncated() -> None:
    assert raised(flags_of(words(60), finish="length")) == {"truncated", "no_think_end"}
    assert raised(flags_of([*words(60), kimi.IM_END])) == {"no_think_end"}


def test_closed_reasoning_with_nothing_after_is_an_empty_answer() -> None:
    assert raised(flags_of([*words(30), kimi.THINK_END, kimi.IM_END])) == {"empty_answer"}
    # Thinking off: an output of only the stop token is an empty answer too; a tool call is an answer.
    assert raised(flags_of([kimi.IM_END], thinking=False)) == {"empty_answer"}


def tool_section(*, call_end: bool = True, section_end: bool = True, calls: int = 1) -> list[int]:
    ids = [kimi.TOOL_CALLS_SECTION_BEGIN]
    for _ in range(calls):
        ids += [kimi.TOOL_CALL_BEGIN, 8, kimi.TOOL_CALL_ARGUMENT_BEGIN, *words(3)]
        ids += [kimi.TOOL_CALL_END] if call_end else []
    return ids + ([kimi.TOOL_CALLS_SECTION_END] if section_end else [])


def test_a_whole_tool_call_parses_a_cut_one_or_an_unclosed_section_does_not() -> None:
    head = [*words(20), kimi.THINK_END, *words(4)]
    assert raised(flags_of([*head, *tool_section(), kimi.IM_END])) == set()
    assert raised(flags_of([*head, *tool_section(call_end=False), kimi.IM_END])) == {"tool_call_unparsed"}
    assert raised(flags_of([*head, *tool_section(section_end=False), kimi.IM_END])) == {"tool_call_unparsed"}
    assert raised(flags_of([*head, *tool_section(calls=0), kimi.IM_END])) == {"tool_call_unparsed"}
    # Straight from thinking into a tool section (no </think>): the call parses, the reasoning was never closed.
    assert raised(flags_of([*words(20), *tool_section(), kimi.IM_END])) == {"no_think_end"}


def test_flags_are_null_where_reasoning_spans_are_not_recorded() -> None:
    from dataclasses import replace

    table = rows_to_table([make_row("p-0")], tokens=replace(KIMI_TOKENS, reasoning_spans=False))
    assert table["no_think_end"].to_pylist() == [None]
    assert table["empty_answer"].to_pylist() == [None]
    assert table["loop"].to_pylist() == [False]


# -- older parts ---------------------------------------------------------------------------------------------------
def real_shaped_rows() -> list[dict]:
    """A batch like a real job's: long ordinary answers, a degenerate loop to the length limit, an unclosed
    reasoning cut off, an empty answer, a cut tool call."""
    outputs = [
        [*words(900), kimi.THINK_END, *words(300), kimi.IM_END],
        looped(1500, 2, 600),  # a two-token loop to the limit (tokenspeed #1305's shape)
        words(2048),
        [*words(400), kimi.THINK_END, kimi.IM_END],
        [*words(200), kimi.THINK_END, *tool_section(call_end=False), kimi.IM_END],
        [*words(700), kimi.THINK_END, *words(120), kimi.IM_END],
    ]
    finish = ["stop", "length", "length", "stop", "stop", "stop"]
    rows = []
    for i, (out, fin) in enumerate(zip(outputs, finish, strict=True)):
        row = make_row(f"p-{i}", input_ids=kimi_prompt(RNG, 30), output_ids=out)
        row["finish_reason"] = fin
        rows.append(row)
    return rows


EXPECTED = {"truncated": 2, "loop": 1, "no_think_end": 2, "empty_answer": 1, "tool_call_unparsed": 1}


def test_rows_of_an_older_part_get_the_flags_the_rows_of_a_new_one_store() -> None:
    table = rows_to_table(real_shaped_rows())
    stored = table_flags(table, KIMI_TOKENS)
    assert count_flags(stored) == EXPECTED
    old = table.drop_columns(list(QUALITY_COLUMNS))  # a part of schema 11 has no flag columns
    computed = table_flags(old, KIMI_TOKENS)
    for name in FLAG_NAMES:
        assert computed[name].tolist() == stored[name].tolist(), name


# -- verify and the exports ----------------------------------------------------------------------------------------
@pytest.fixture
def stored_job(tmp_path: Path) -> tuple[Settings, dict[str, dict]]:
    rows = real_shaped_rows()
    PartWriter(str(tmp_path / "out"), "w1").write(JOB, "ds", rows)
    settings = Settings(output_uri=str(tmp_path / "out"), redis_url="redis://127.0.0.1:1/0")
    return settings, {r["prompt_id"]: r for r in rows}


def test_drop_flag_exports_exactly_the_unflagged_rows(
    stored_job: tuple[Settings, dict[str, dict]], tmp_path: Path
) -> None:
    settings, rows = stored_job
    result = export_job(settings, JOB, "eagle3", str(tmp_path / "e.jsonl"), drop_flags=["loop", "empty_answer"])
    ids = [json.loads(line)["id"] for line in Path(result.path).read_text().splitlines()]
    assert sorted(ids) == ["p-0", "p-2", "p-4", "p-5"]
    assert result.skipped == {"loop": 1, "empty_answer": 1}
    every = export_job(settings, JOB, "eagle3", str(tmp_path / "all.jsonl"), drop_flags=list(FLAG_NAMES[1:]),
                       drop_truncated=True)  # fmt: skip
    kept = [json.loads(line)["id"] for line in Path(every.path).read_text().splitlines()]
    assert kept == ["p-0", "p-5"]
    assert sum(every.skipped.values()) == len(rows) - 2


def test_drop_flag_on_the_command_line_and_an_unknown_flag_is_refused(
    stored_job: tuple[Settings, dict[str, dict]], tmp_path: Path
) -> None:
    settings, _ = stored_job
    env = {"THINKFLEET_OUTPUT_URI": settings.output_uri, "THINKFLEET_REDIS_URL": settings.redis_url}
    out = tmp_path / "s.jsonl"
    ok = CliRunner().invoke(export, [JOB, "--format", "specforge", "--out", str(out), "--drop-flag", "truncated,loop"],
                            env=env)  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "left out 2 rows: truncated" in ok.output
    assert len(out.read_text().splitlines()) == 4
    with pytest.raises(ExportError, match="unknown quality flag loops"):
        export_job(settings, JOB, "eagle3", str(tmp_path / "x.jsonl"), drop_flags=["loops"])
    with pytest.raises(ValueError, match="one of truncated, loop"):
        parse_flags("loop,nope")
