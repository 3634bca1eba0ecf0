"""Every input format becomes the same conversations; every bad input names file, row and fix."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.inputs import Columns, InputError, Problem, read_dataset
from testing.datasets import write_jsonl

ROWS = [
    {
        "id": "a",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "old"},
        ],
    },
    {"id": "b", "messages": [{"role": "user", "content": "two"}]},
]
EXPECTED = [
    [{"role": "system", "content": "S"}, {"role": "user", "content": "one"}],
    [{"role": "user", "content": "two"}],
]


def read(path: Path, **kwargs) -> tuple[list, list[Problem]]:
    problems: list[Problem] = []
    ds = read_dataset(path, problems=problems, **kwargs)
    return ds.prompts, problems


def test_jsonl_rows_become_prompts_cut_after_the_last_user_turn(tmp_path: Path) -> None:
    prompts, problems = read(write_jsonl(tmp_path / "chat.jsonl", ROWS))
    assert not problems
    assert [p.messages for p in prompts] == EXPECTED
    assert [p.prompt_id for p in prompts] == ["chat/a", "chat/b"]
    assert [p.row_index for p in prompts] == [0, 1]
    assert prompts[0].location == f"{tmp_path / 'chat.jsonl'}:1"


def test_json_list_parquet_csv_and_save_to_disk_read_the_same(tmp_path: Path) -> None:
    (tmp_path / "j.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    with (tmp_path / "c.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["id", "messages"])
        w.writeheader()
        for r in ROWS:
            w.writerow({"id": r["id"], "messages": json.dumps(r["messages"])})
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    for name in ("j.json", "p.parquet", "c.csv", "hf"):
        prompts, problems = read(tmp_path / name)
        assert not problems, name
        assert [p.messages for p in prompts] == EXPECTED, name
        assert [p.prompt_id.split("/")[1] for p in prompts] == ["a", "b"], name


def test_a_directory_of_files_is_one_dataset_in_name_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "shards" / "part-0.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "shards" / "part-1.jsonl", ROWS[1:])
    prompts, problems = read(tmp_path / "shards", columns=Columns(id=""))
    assert not problems
    assert [p.prompt_id for p in prompts] == ["shards/0", "shards/1"]


def test_sharegpt_and_prompt_columns_with_system_and_tools(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    write_jsonl(
        tmp_path / "sg.jsonl",
        [
            {
                "system": "S",
                "tools": json.dumps(tools),
                "conversations": [
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": "more"},
                    {"from": "gpt", "value": "drop me"},
                ],
            }
        ],
    )
    prompts, problems = read(tmp_path / "sg.jsonl")
    assert not problems
    assert [m["role"] for m in prompts[0].messages] == ["system", "user", "assistant", "user"]
    assert prompts[0].tools == tools
    write_jsonl(tmp_path / "pr.jsonl", [{"question": "q?", "sys": "S"}])
    prompts, problems = read(tmp_path / "pr.jsonl", columns=Columns(prompt="question", system="sys"))
    assert prompts[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "q?"}]


def test_tool_results_end_a_prompt_and_reasoning_and_tool_calls_are_kept(tmp_path: Path) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    write_jsonl(
        tmp_path / "t.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "think"},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                    {"role": "assistant", "content": "final"},
                ]
            }
        ],
    )
    prompts, _ = read(tmp_path / "t.jsonl")
    assert [m["role"] for m in prompts[0].messages] == ["user", "assistant", "tool"]
    assert prompts[0].messages[1]["tool_calls"] == [call]
    assert prompts[0].messages[1]["reasoning_content"] == "think"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"messages": [{"role": "user", "content": "ok"}', "not valid JSON"),
        ('{"messages": []}', "empty conversation"),
        ('{"messages": [{"role": "user", "content": 5}]}', "non-string content"),
        ('{"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "x"}]}', "no user turn"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "role 'wizard'"),
        ('{"prompt": "wrong column"}', "column 'messages' is missing"),
        ("[1, 2]", "not an object"),
    ],
)
def test_bad_rows_name_file_line_and_fix(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n' + line + "\n")
    prompts, problems = read(path, columns=Columns(id=""))
    assert len(prompts) == 1
    assert len(problems) == 1
    assert problems[0].location == f"{path}:2"
    assert reason in problems[0].reason
    assert "--skip-invalid" in problems[0].reason


def test_unknown_or_missing_columns_stop_the_read(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "x.jsonl", [{"text": "no conversation here"}])
    with pytest.raises(InputError, match=r"no conversation column.*--messages-column"):
        read(tmp_path / "x.jsonl")
    with pytest.raises(InputError, match=r"no column 'chat'.*--messages-column"):
        read(tmp_path / "x.jsonl", columns=Columns(messages="chat"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(InputError, match="unknown format"):
        read(tmp_path / "x.txt")


def test_duplicate_ids_are_problems(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[1], ROWS[1]])
    prompts, problems = read(path)
    assert len(prompts) == 1
    assert "duplicate id 'b'" in problems[0].reason and f"{path}:1" in problems[0].reason
