"""``producer export`` of a ``--turns all`` job (the e2e run of tests/test_multiturn.py, reused).

- ``messages``/``conversations``: each turn's record is the conversation up to that turn, with the model's own
  earlier answers (decoded from the stored rows of the earlier turns) in place of the dataset's, then the
  generated turn — and that history is exactly what the chat template rendered the turn's prompt from.
- ``eagle3``/``specforge`` ``--merge-turns``: one sample per conversation (see the tests below).
"""

from __future__ import annotations

import json
from pathlib import Path

from producer.render import load_tokenizer, render_ids
from storage.conversations import ToolMarkers, output_message
from storage.export import export_job
from storage.reader import read_committed
from tests import test_multiturn
from tests.test_multiturn import CONVERSATIONS, TURNS, MultiTurnJob
from thinkfleet.state.job import JobRecord
from workers.turns import plan_conversation, turn_messages

multiturn_job = test_multiturn.multiturn_job  # the fixture: one run of the e2e job for this module


def _rows(run: MultiTurnJob) -> dict[str, dict]:
    return {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, run.job).to_pylist()}


def _answer(tok: object, row: dict, markers: ToolMarkers, reasoning: bool = True) -> dict:
    spans = [(s["start"], s["end"]) for s in row["tool_call_spans"]]
    reasoning_span = (row["reasoning_start"], row["reasoning_end"])
    answer_span = (row["answer_start"], row["answer_end"])
    return output_message(tok, row["output_ids"], reasoning_span, answer_span, spans, markers, reasoning)


def test_messages_of_a_later_turn_are_the_conversation_with_the_models_answers(
    multiturn_job: MultiTurnJob, tmp_path: Path
) -> None:
    run = multiturn_job
    out = tmp_path / "messages.jsonl"
    result = export_job(run.settings, run.job, "messages", str(out), tokenizer=str(run.tok_dir))
    assert result.rows == CONVERSATIONS * TURNS, result
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    rows = _rows(run)
    tok = load_tokenizer(str(run.tok_dir))
    record = JobRecord.load(run.client, run.settings.keys, run.job)
    assert record is not None
    markers = ToolMarkers.of(record)
    source = [json.loads(line) for line in run.data.read_text().splitlines()]
    for c, conv_row in enumerate(source):
        conv = plan_conversation(conv_row["messages"])
        assert conv is not None
        answers = [_answer(tok, rows[f"chat/c{c}/t{t}"], markers) for t in range(TURNS)]
        for t in range(TURNS):
            pid = f"chat/c{c}/t{t}"
            messages = records[pid]["messages"]
            assert messages == [*turn_messages(conv, answers[:t]), answers[t]], pid
            # The history is what the template rendered the turn's prompt from.
            assert render_ids(tok, messages[:-1], None, record.chat_template_kwargs) == rows[pid]["input_ids"]
            assert sum(m["role"] == "assistant" for m in messages) == t + 1
            assert all("dataset's answer" not in (m.get("content") or "") for m in messages)

    # conversations: the same list under its key; --exclude-reasoning drops reasoning from every model turn.
    out2 = tmp_path / "conversations.jsonl"
    export_job(run.settings, run.job, "conversations", str(out2), tokenizer=str(run.tok_dir), exclude_reasoning=True)
    conv_records = {r["id"]: r for r in map(json.loads, out2.read_text().splitlines())}
    last = conv_records[f"chat/c0/t{TURNS - 1}"]["conversations"]
    assert [m["role"] for m in last].count("assistant") == TURNS
    assert all("reasoning_content" not in m for m in last if m["role"] == "assistant")
    assert [m["content"] for m in last] == [m["content"] for m in records[f"chat/c0/t{TURNS - 1}"]["messages"]]
