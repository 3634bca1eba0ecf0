"""The multi-turn checker: every turn of every conversation stored, and turn i+1 rendered from the committed turn i.

Shared by the ``--turns all`` tests and the operator nemesis (tests/test_reliability_operator_nemesis.py): given the
dataset a job was submitted from, its record and its committed rows, each turn's ``input_ids`` must be the chat
template's rendering of the conversation with the model's own answers (decoded from the stored ids of turns
0..i-1) in place of the dataset's, and each ``output_ids`` the simulator's deterministic answer to that prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from producer.render import load_tokenizer, render_ids
from sglang_sim.content import expected_generation
from storage.conversations import ToolMarkers, output_message
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import plan_conversation, turn_messages


def chain_problems(
    data: Path,
    dataset: str,
    tok_dir: Path,
    record: JobRecord,
    rows: dict[str, dict[str, Any]],
    exact_outputs: bool = True,
) -> list[str]:
    """What is wrong with the committed ``rows`` (prompt id → row) of a ``--turns all`` job submitted from ``data``
    (a JSONL of ``{id, messages}``, plain conversations without tools): [] when every chain is whole and exact — it
    runs to its last turn, or to a row whose ``chain_end`` records why it ended there (the model called a tool).

    ``exact_outputs``: each ``output_ids`` is also the simulator's deterministic answer, for the sampling params the
    row records (a ``retry --truncated`` revision: its own budget). Off for a simulator that draws every request's
    answer anew (``--sample-per-request``): then only the chain is checked — turn i+1 from the committed turn i."""
    tok = load_tokenizer(str(tok_dir))
    markers = ToolMarkers.of(record)
    problems: list[str] = []
    for line in data.read_text().splitlines():
        source = json.loads(line)
        conv = plan_conversation(source["messages"])
        if conv is None:
            problems.append(f"{source['id']}: the dataset row plans no conversation")
            continue
        answers: list[dict[str, Any]] = []
        for t in range(len(conv["users"])):
            pid = f"{dataset}/{source['id']}/t{t}"
            row = rows.get(pid)
            if row is None:
                problems.append(f"{pid}: not stored (turn {t} of {len(conv['users'])})")
                break
            want_prompt = render_ids(tok, turn_messages(conv, answers), None, record.chat_template_kwargs)
            if list(row["input_ids"]) != want_prompt:
                problems.append(f"{pid}: input_ids are not the template's rendering of the committed turns")
            if exact_outputs:
                params = json.loads(row["sampling_params"]) if row.get("sampling_params") else record.sampling_params
                want = expected_generation(list(row["input_ids"]), params)
                if list(row["output_ids"]) != list(want.output_ids):
                    problems.append(f"{pid}: output_ids differ from the simulator's answer")
            spans = [(s["start"], s["end"]) for s in row["tool_call_spans"] or []]
            reasoning, answer = (row["reasoning_start"], row["reasoning_end"]), (row["answer_start"], row["answer_end"])
            answers.append(output_message(tok, row["output_ids"], reasoning, answer, spans, markers))
            if row.get("chain_end"):  # ended with a recorded reason (a tool call, …) or complete: nothing owed
                break
    return problems
