"""A ``--turns all`` job's status reads each conversation's small chain state, not every answer (issue 44 part 3).

Given a real ``--turns all`` submit and a real ledger finalizing turns in every way a chain can stand — complete,
ended by a tool call, waiting on a dead-lettered turn, stranded (its successor not submitted), in progress, dead at
turn 0 — finalize.lua records each conversation's chain state with the answer; ``producer status`` reads it and
comes to the same verdicts as the walk along the answer records (the path of a job recorded without it), and
``retry``'s chain ends agree too. The state costs a few dozen bytes a conversation.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import redis
import redis.asyncio as aioredis

from producer.chain_state import chain_end_ids, read_chain_state
from producer.status import StatusReader
from producer.submit import submit
from producer.submit_options import SubmitOptions
from testing.datasets import conversation_rows, write_jsonl
from testing.harness import isolated_settings
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import FinalRow, Ledger
from workers.turns import NextTurn

JOB, TURNS, CONVERSATIONS = "cs", 2, 6


def _submitted(redis_url: str, tmp_path: Path) -> tuple[Settings, str]:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    data = write_jsonl(tmp_path / "chat.jsonl", conversation_rows(CONVERSATIONS, TURNS, 6, "Be brief."))
    submit(settings, SubmitOptions(paths=[data], job=JOB, tokenizer=str(tok), processes=1, turns="all"))
    return settings, "chat"


def _answer(**extra: str) -> str:
    return json.dumps({"role": "assistant", "content": "ok", **extra})


def test_status_reads_the_chain_state_and_agrees_with_the_walk_along_the_answers(
    redis_url: str, tmp_path: Path
) -> None:
    settings, ds = _submitted(redis_url, tmp_path)
    keys = settings.keys
    c = [f"{ds}/c{i}" for i in range(CONVERSATIONS)]

    async def finalize(ledger: Ledger, pid: str, turn: NextTurn) -> None:
        claim = await ledger.claim(JOB, pid)
        row = FinalRow(pid, 5, True, False, epoch=claim.epoch)
        done = await ledger.finalize(JOB, ds, [row], 100, 0.95, [turn], "cs-scratch", keys.turn_answers(JOB))
        assert done.new == 1, (pid, done)

    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        await client.set(keys.heartbeat("w1"), "1")
        ledger = Ledger(client, keys, "w1")
        try:
            # c0 complete: turn 0 goes on to turn 1, the last
            await finalize(ledger, f"{c[0]}/t0", NextTurn(f"{c[0]}/t0", _answer(), f"{c[0]}/t1", "h", b"m"))
            await finalize(ledger, f"{c[0]}/t1", NextTurn(f"{c[0]}/t1", _answer()))
            # c1 ended by a tool call at turn 0 (turn 1 dropped)
            ended = NextTurn(f"{c[1]}/t0", _answer(chain_end="tool_call"), drop=(f"{c[1]}/t1",))
            await finalize(ledger, f"{c[1]}/t0", ended)
            # c2 waits on turn 1, dead-lettered
            await finalize(ledger, f"{c[2]}/t0", NextTurn(f"{c[2]}/t0", _answer(), f"{c[2]}/t1", "h", b"m"))
            task = PromptTask(JOB, ds, f"{c[2]}/t1", 2, "0" * 16, pack_ids([1, 2]))
            await ledger.claim(JOB, task.prompt_id)
            assert await ledger.dead_letter(task, "context_overflow", "too long", attempts=1)
            # c3 stranded: its turn 1 was enqueued, then lost from the submitted prompts
            await finalize(ledger, f"{c[3]}/t0", NextTurn(f"{c[3]}/t0", _answer(), f"{c[3]}/t1", "h", b"m"))
            await client.hdel(keys.prompts(JOB), f"{c[3]}/t1")
            # c4 in progress (nothing finalized); c5 dead at turn 0
            task = PromptTask(JOB, ds, f"{c[5]}/t0", 5, "0" * 16, pack_ids([1, 2]))
            await ledger.claim(JOB, task.prompt_id)
            assert await ledger.dead_letter(task, "context_overflow", "too long", attempts=1)
        finally:
            await client.delete("cs-scratch")
            await client.aclose()

    asyncio.run(scenario())
    sync = redis.Redis.from_url(redis_url)
    # Then each finalized conversation has its chain state: a few dozen bytes
    states = read_chain_state(sync, keys, JOB)
    assert states is not None and sorted(states) == sorted([c[0], c[1], c[2], c[3]])
    assert (states[c[0]].prompt_id, states[c[0]].end) == (f"{c[0]}/t1", "complete")
    assert (states[c[1]].prompt_id, states[c[1]].end) == (f"{c[1]}/t0", "tool_call")
    assert states[c[2]].next_id == f"{c[2]}/t1" and not states[c[2]].end
    per_conversation = sum(len(v) for v in sync.hvals(keys.chain_state(JOB))) / len(states)
    assert per_conversation < 64, per_conversation
    # and status reads it, to the same verdicts as the walk along the answer records
    from_states = StatusReader(sync, settings, JOB).read(deep=True)["conversations"]
    expected = {"total": CONVERSATIONS, "complete": 1, "chain_ended": 1, "dead": 2, "stranded": 1, "in_progress": 1}
    assert {k: from_states[k] for k in expected} == expected, from_states
    assert from_states["ends"] == {"tool_call": 1} and from_states["stranded_ids"] == [f"{c[3]}/t1"]
    ends = chain_end_ids(sync, keys, JOB)
    assert ends == [f"{c[1]}/t0"]
    sync.delete(keys.chain_state(JOB))  # as a job recorded by workers that kept none
    assert read_chain_state(sync, keys, JOB) is None
    walked = StatusReader(sync, settings, JOB).read(deep=True)["conversations"]
    assert walked == from_states
    assert chain_end_ids(sync, keys, JOB) == ends
