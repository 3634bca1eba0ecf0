"""A submit finds duplicate ids in constant-size records per id (issue 24: a dict of strings held ~190 bytes a
row), and still names the duplicate's file and row and where the id was first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer import inputs
from producer.inputs import Problem, SeenIds, iter_prompts, open_dataset


def _chat(i: int, row_id: str) -> dict:
    return {"id": row_id, "messages": [{"role": "user", "content": f"question {i}"}]}


@pytest.mark.parametrize("chunk", [3, 1 << 16])
def test_duplicates_are_reported_with_file_and_row(tmp_path: Path, monkeypatch, chunk: int) -> None:
    # Given a JSONL whose ids repeat far apart (past several of SeenIds' arrays when chunk is small)
    monkeypatch.setattr(inputs, "_SEEN_CHUNK", chunk)
    ids = [f"r{i}" for i in range(40)] + ["r3", "r39", "r0", "new", "new"]
    path = tmp_path / "alpha.jsonl"
    path.write_text("".join(json.dumps(_chat(i, x)) + "\n" for i, x in enumerate(ids)))
    # When its prompts are read
    problems: list[Problem] = []
    prompts = list(iter_prompts(open_dataset(path), problems=problems))
    # Then every first occurrence is a prompt, and each repeat is a problem naming both places
    assert [p.prompt_id for p in prompts] == [f"alpha/r{i}" for i in range(40)] + ["alpha/new"]
    where = {p.prompt_id: p.location for p in prompts}
    assert [(p.location, p.reason) for p in problems] == [
        (f"{path}:41", f"duplicate id 'r3' (first at {where['alpha/r3']}); ids must be unique"),
        (f"{path}:42", f"duplicate id 'r39' (first at {where['alpha/r39']}); ids must be unique"),
        (f"{path}:43", f"duplicate id 'r0' (first at {where['alpha/r0']}); ids must be unique"),
        (f"{path}:45", f"duplicate id 'new' (first at {where['alpha/new']}); ids must be unique"),
    ]
    assert where["alpha/r3"] == f"{path}:4"


def test_locations_come_back_exactly(monkeypatch) -> None:
    monkeypatch.setattr(inputs, "_SEEN_CHUNK", 2)
    locs = ["a.jsonl:1", "b.parquet row 0", "c.json item 12", "d.csv:007", "no number", "e:" + "9" * 25, "f:10"]
    seen = SeenIds()
    for n, loc in enumerate(locs):
        assert seen.seen_at(f"id{n}", loc) is None
    for n, loc in enumerate(locs):
        assert seen.seen_at(f"id{n}", "elsewhere:1") == loc
    assert seen.seen_at("id-new", "x:1") is None
