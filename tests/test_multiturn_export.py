"""``producer export`` of a ``--turns all`` job: 3-turn conversations submitted with the real CLI and the Kimi test
tokenizer, run to the end by one worker against the simulator (tests/test_multiturn.py runs the same job through a
worker's SIGKILL; the exports here need only its finished rows).

- ``messages``/``conversations``: each turn's record is the conversation up to that turn, with the model's own
  earlier answers (decoded from the stored rows of the earlier turns) in place of the dataset's, then the
  generated turn — and that history is exactly what the chat template rendered the turn's prompt from.
- ``eagle3``/``specforge`` ``--merge-turns``: one sample per conversation (see the tests below).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from producer.render import load_tokenizer, render_ids
from storage.conversations import ToolMarkers, output_message
from storage.exports import export_job
from storage.reader import read_committed
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import job_progress, stuck_report, wait_until
from testing.harness import producer_cli
from testing.module_fleet import fleet
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import plan_conversation, turn_messages

#: Enough conversations for every check to see several; three turns, so a later turn holds two earlier answers.
CONVERSATIONS, TURNS = 4, 3


@dataclass
class MultiTurnJob:
    """A finished ``--turns all`` job."""

    settings: Settings
    client: redis.Redis
    job: str
    data: Path
    tok_dir: Path


@pytest.fixture(scope="module")
def multiturn_job(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiTurnJob]:
    """The job run once for the module, on its own key prefix on the session's Redis."""
    tmp = tmp_path_factory.mktemp("multiturn-export")
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    rows = conversation_rows(CONVERSATIONS, TURNS, 10, "You are a careful assistant.", reasoning="x")
    data = write_jsonl(tmp / "chat.jsonl", rows)
    job, total = "multi", CONVERSATIONS * TURNS
    with fleet(redis_server.url(0), tmp, ("--time-scale", "1000"), max_inflight=4) as f:
        submitted = producer_cli(
            f.settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
            "--no-progress", "--max-new-tokens", "300", "--seed", "3", "--context-length", "131072",
            "--turns", "all", "--json",
            in_process=True,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        wait_until(
            lambda: job_progress(f.client, f.settings.keys, job)["done"] == total,
            180,
            what=f"{total} turns",
            explain=lambda: stuck_report(f.client, f.settings, job, f.workers),
        )
        client = redis.Redis.from_url(f.settings.redis_url)  # the fleet's closes with it
    yield MultiTurnJob(f.settings, client, job, data, tok_dir)
    client.close()


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


# -- eagle3 / specforge --merge-turns --------------------------------------------------------------------------
def _kimi_turns() -> list[dict]:
    """Two turns as Kimi renders them: turn 1's prompt holds turn 0's answer WITHOUT its reasoning (the
    template drops reasoning before the last user turn) and with an empty ``<think></think>``."""
    from testing.rows import make_row
    from thinkfleet import kimi

    think, think_end = kimi.THINK_START, kimi.THINK_END
    header = [kimi.IM_ASSISTANT, 7, kimi.IM_MIDDLE]
    prompt0 = [kimi.IM_SYSTEM, 1, kimi.IM_MIDDLE, 11, 12, kimi.IM_END, kimi.IM_USER, 2, kimi.IM_MIDDLE, 21, 22,
               kimi.IM_END, *header, think]  # fmt: skip
    reasoning0, content0 = [31, 32, 33, 34], [41, 42, 43, 44, 45]
    out0 = [*reasoning0, think_end, *content0, kimi.IM_END]
    prompt1 = [*prompt0[:-1], think, think_end, *content0, kimi.IM_END, kimi.IM_USER, 2, kimi.IM_MIDDLE, 51, 52,
               kimi.IM_END, *header, think]  # fmt: skip
    out1 = [61, 62, think_end, 71, 72, kimi.IM_END]
    common = {"dataset": "chat", "job": "kt", "conversation_id": "chat/k", "turn_count": 2}
    return [
        make_row("chat/k/t0", input_ids=prompt0, output_ids=out0, turn_index=0, **common),
        make_row("chat/k/t1", input_ids=prompt1, output_ids=out1, turn_index=1, **common),
    ]


def test_merge_turns_masks_the_earlier_answer_where_the_template_kept_it_verbatim() -> None:
    from storage.exports import merged_table
    from storage.schema import rows_to_table

    rows = _kimi_turns()
    table = rows_to_table(rows)
    skipped: dict[str, int] = {}
    merged = merged_table(table, skipped=skipped).to_pylist()
    assert len(merged) == 1 and skipped == {"merged_turns": 1}
    rec = merged[0]
    prompt1, out1, out0 = rows[1]["input_ids"], rows[1]["output_ids"], rows[0]["output_ids"]
    assert rec["id"] == "chat/k" and rec["input_ids"] == prompt1 + out1 and rec["prompt_len"] == len(prompt1)
    masked = [i for i, m in zip(rec["input_ids"], rec["loss_mask"], strict=True) if m]
    # </think>, the content and <|im_end|> of turn 0 appear verbatim; its reasoning is not in the prompt.
    assert masked == [*out0[4:], *out1]
    assert rec["loss_mask"][len(prompt1) :] == [1] * len(out1)
    # --exclude-reasoning: the reasoning block (through </think>) of every turn stays at 0.
    rec = merged_table(table, exclude_reasoning=True).to_pylist()[0]
    masked = [i for i, m in zip(rec["input_ids"], rec["loss_mask"], strict=True) if m]
    assert masked == [*out0[5:], *out1[3:]]
    # Per turn (no merge): two samples, each over its own output only.
    from storage.exports import eagle3_table

    per_turn = eagle3_table(table).to_pylist()
    assert [sum(r["loss_mask"]) for r in per_turn] == [len(out0), len(out1)]


def test_merge_turns_exports_one_sample_per_conversation(multiturn_job: MultiTurnJob, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from producer.cli import cli

    run = multiturn_job
    rows = _rows(run)
    out = tmp_path / "merged.jsonl"
    s = run.settings
    result = CliRunner().invoke(
        cli,
        ["export", run.job, "--format", "specforge", "--merge-turns", "--out", str(out), "--json",
         "--redis-url", s.redis_url, "--key-prefix", s.key_prefix, "--output-uri", s.output_uri],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == sorted(f"chat/c{c}" for c in range(CONVERSATIONS))
    for c in range(CONVERSATIONS):
        last = rows[f"chat/c{c}/t{TURNS - 1}"]
        rec = records[f"chat/c{c}"]
        n = len(last["input_ids"])
        assert rec["input_ids"] == last["input_ids"] + last["output_ids"]
        assert rec["loss_mask"][n:] == [1] * len(last["output_ids"])
        # Whatever is trained on in the prompt is a run of an earlier turn's own output ids.
        earlier = [rows[f"chat/c{c}/t{t}"]["output_ids"] for t in range(TURNS - 1)]
        i = 0
        while i < n:
            if rec["loss_mask"][i]:
                j = i
                while j < n and rec["loss_mask"][j]:
                    j += 1
                run_ids = rec["input_ids"][i:j]
                assert any(_contains(out, run_ids) for out in earlier), (c, i, j)
                i = j
            else:
                i += 1
    # Per turn (the default) still gives one sample per turn.
    per_turn = tmp_path / "per-turn.jsonl"
    export_job(run.settings, run.job, "specforge", str(per_turn))
    assert len(per_turn.read_text().splitlines()) == CONVERSATIONS * TURNS
    # --merge-turns is refused for the text formats.
    import pytest

    from storage.exports import ExportError

    with pytest.raises(ExportError, match="merge-turns"):
        export_job(run.settings, run.job, "messages", str(tmp_path / "m.jsonl"), tokenizer=str(run.tok_dir),
                   merge_turns=True)  # fmt: skip


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))
