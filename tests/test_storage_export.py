"""``producer export``: EAGLE-3 records round-trip the ids exactly; the text formats decode the generated turn by
its spans and take the conversation before it from the submit manifest (tests/test_export_formats.py has the
other formats, sharding, S3, filters and the consumers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from storage.cli import export
from storage.exports import ExportError, export_job
from storage.manifest import write_submitted
from storage.writer import PartWriter
from testing.rows import make_row
from thinkfleet import kimi
from thinkfleet.settings import Settings

JOB = "job"
WORDS = 1000  # the test tokenizer knows t0…t999, three role names and Kimi's special tokens
SYSTEM, USER, ASSISTANT = 1000, 1001, 1002


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real HF fast tokenizer (word-level) with Kimi's special ids, saved like a model repo."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    roles = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    vocab = {f"t{i}": i for i in range(WORDS)} | roles | dict(kimi.SPECIAL_TOKENS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in kimi.SPECIAL_TOKENS])
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


def _words(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, WORDS, n).tolist()


def _prompt(rng: np.random.Generator) -> list[int]:
    return [
        kimi.IM_SYSTEM,
        SYSTEM,
        kimi.IM_MIDDLE,
        *_words(rng, 4),
        kimi.IM_END,
        kimi.IM_USER,
        USER,
        kimi.IM_MIDDLE,
        *_words(rng, 9),
        kimi.IM_END,
        kimi.IM_ASSISTANT,
        ASSISTANT,
        kimi.IM_MIDDLE,
        kimi.THINK_START,
    ]


def _output(rng: np.random.Generator, tool_call: bool) -> list[int]:
    ids = [*_words(rng, 12), kimi.THINK_END, *_words(rng, 5)]
    if tool_call:
        ids += [
            kimi.TOOL_CALLS_SECTION_BEGIN,
            kimi.TOOL_CALL_BEGIN,
            8,
            kimi.TOOL_CALL_ARGUMENT_BEGIN,
            *_words(rng, 3),
            kimi.TOOL_CALL_END,
            kimi.TOOL_CALLS_SECTION_END,
        ]
    return [*ids, kimi.IM_END]


@pytest.fixture
def job_rows(tmp_path: Path) -> dict[str, dict]:
    rng = np.random.default_rng(11)
    rows = [
        make_row(f"p-{i}", dataset=("a" if i < 4 else "b"), input_ids=_prompt(rng), output_ids=_output(rng, i % 2))
        for i in range(7)
    ]
    writer = PartWriter(str(tmp_path / "out"), "w1")
    writer.write(JOB, "a", rows[:4])
    writer.write(JOB, "b", rows[4:])
    writer.write(JOB, "a", rows[:1])  # a duplicate delivery: exported once
    return {r["prompt_id"]: r for r in rows}


def _source(row: dict) -> list[dict]:
    """The conversation a row's prompt was rendered from (here: words of its system and user turns)."""
    ids = row["input_ids"]
    system = " ".join(f"t{t}" for t in ids[3 : ids.index(kimi.IM_END)])
    user = " ".join(f"t{t}" for t in ids[ids.index(kimi.IM_USER) + 3 : -5])
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _manifest(tmp_path: Path, rows: list[dict], with_sources: bool = True) -> None:
    write_submitted(
        str(tmp_path / "out"),
        JOB,
        [
            {
                "prompt_id": r["prompt_id"],
                "dataset": r["dataset"],
                "row_index": 0,
                "content_hash": r["content_hash"],
                **({"messages": _source(r), "tools": None} if with_sources else {}),
            }
            for r in rows
        ],
    )


def _settings(tmp_path: Path) -> Settings:
    return Settings(output_uri=str(tmp_path / "out"), redis_url="redis://127.0.0.1:1/0")


def test_eagle3_parquet_round_trips_ids(tmp_path: Path, job_rows: dict[str, dict]) -> None:
    result = export_job(_settings(tmp_path), JOB, "eagle3", str(tmp_path / "e.parquet"))
    assert result.rows == len(job_rows)
    records = pq.read_table(result.path).to_pylist()
    assert sorted(r["id"] for r in records) == sorted(job_rows)
    for rec in records:
        row = job_rows[rec["id"]]
        assert rec["input_ids"] == row["input_ids"] + row["output_ids"]
        assert rec["prompt_len"] == len(row["input_ids"])
        assert rec["loss_mask"] == [0] * len(row["input_ids"]) + [1] * len(row["output_ids"])


def test_eagle3_can_exclude_reasoning_from_the_mask(tmp_path: Path, job_rows: dict[str, dict]) -> None:
    path = export_job(_settings(tmp_path), JOB, "eagle3", str(tmp_path / "e.jsonl"), exclude_reasoning=True).path
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        row = job_rows[rec["id"]]
        out_mask = rec["loss_mask"][rec["prompt_len"] :]
        think_end = row["output_ids"].index(kimi.THINK_END)
        assert rec["input_ids"] == row["input_ids"] + row["output_ids"]
        assert out_mask == [0] * (think_end + 1) + [1] * (len(row["output_ids"]) - think_end - 1)


def test_conversations_carry_the_source_turns_decoded_reasoning_and_exact_ids(
    tmp_path: Path, job_rows: dict[str, dict], tokenizer_dir: str
) -> None:
    _manifest(tmp_path, list(job_rows.values()))
    out = tmp_path / "conv.jsonl"
    args = [
        JOB,
        "--format",
        "conversations",
        "--out",
        str(out),
        "--tokenizer",
        tokenizer_dir,
        "--output-uri",
        str(tmp_path / "out"),
        "--redis-url",
        "redis://127.0.0.1:1/0",
    ]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(job_rows)
    for rec in lines:
        row = job_rows[rec["id"]]
        # prompt_ids, never input_ids: a top-level input_ids makes SpecForge demand a loss_mask.
        assert "input_ids" not in rec
        assert rec["prompt_ids"] == row["input_ids"] and rec["output_ids"] == row["output_ids"]
        *source, reply = rec["conversations"]
        assert source == _source(row)
        think_end = row["output_ids"].index(kimi.THINK_END)
        assert reply["role"] == "assistant"
        assert reply["reasoning_content"] == " ".join(f"t{t}" for t in row["output_ids"][:think_end])
        answer = row["output_ids"][think_end + 1 : think_end + 6]
        assert reply["content"] == " ".join(f"t{t}" for t in answer)
        if kimi.TOOL_CALL_BEGIN in row["output_ids"]:
            (call,) = reply["tool_calls"]
            args = row["output_ids"][row["output_ids"].index(kimi.TOOL_CALL_ARGUMENT_BEGIN) + 1 :][:3]
            assert call["id"] == call["function"]["name"] == "t8"
            assert call["function"]["arguments"] == " ".join(f"t{t}" for t in args)
        else:
            assert "tool_calls" not in reply


def test_text_formats_refuse_rows_whose_source_conversation_was_not_kept(
    tmp_path: Path, job_rows: dict[str, dict], tokenizer_dir: str
) -> None:
    _manifest(tmp_path, list(job_rows.values()), with_sources=False)  # a manifest from before sources were kept
    out = tmp_path / "m.jsonl"
    with pytest.raises(ExportError, match="Re-run the same `producer submit`"):
        export_job(_settings(tmp_path), JOB, "messages", str(out), tokenizer=tokenizer_dir)
    assert not out.exists() and not list(tmp_path.glob(".m.jsonl*"))


def test_conversations_without_a_tokenizer_says_how_to_fix(tmp_path: Path, job_rows: dict[str, dict]) -> None:
    args = [
        JOB,
        "--format",
        "conversations",
        "--output-uri",
        str(tmp_path / "out"),
        "--redis-url",
        "redis://127.0.0.1:1/0",
        "--out",
        str(tmp_path / "c.jsonl"),
    ]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 1 and "--tokenizer" in result.output
    assert not (tmp_path / "c.jsonl").exists()
