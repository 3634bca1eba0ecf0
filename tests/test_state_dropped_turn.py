"""A later turn a chain drops (its earlier turn now ends the chain) cannot run from a leftover copy (issue 44 part 4).

finalize.lua takes the dropped turns out of the job (``prompts``) and raises each one's revision in the same step,
so a copy of its message still queued is *superseded* at its claim (claim.lua), and a copy already running is
fenced at its finalize (``revision N``): neither adds the turn to ``done``, which stays within ``prompts`` — what
``remaining`` and ``producer wait`` count. Against a real Redis and the real ledger.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import redis
import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from thinkfleet.state.ledger import FinalRow, Ledger
from workers.turns import NextTurn

JOB, DATASET = "chat", "ds"
T0, T1, T2, T3 = (f"{DATASET}/c0/t{i}" for i in range(4))


def _row(pid: str, epoch: int) -> FinalRow:
    return FinalRow(pid, completion_tokens=10, has_think_end=True, truncated=False, epoch=epoch)


def _given_a_conversation_whose_later_turns_were_derived(client: redis.Redis, keys: Keys) -> None:
    """Four turns submitted (an earlier chain derived turns 1–3), turn 0 done with its answer recorded."""
    turns = [T0, T1, T2, T3]
    client.hset(keys.prompts(JOB), mapping={p: f"{i:016x}" for i, p in enumerate(turns)})
    client.hset(keys.prompt_dataset(JOB), mapping=dict.fromkeys(turns, DATASET))
    client.hset(keys.counters(JOB), mapping={"submitted": 4, "done": 1})
    client.hset(keys.dataset_counters(JOB, DATASET), mapping={"submitted": 4, "done": 1})
    client.sadd(keys.done(JOB), T0)
    client.hset(keys.turn_answers(JOB), T0, json.dumps({"role": "assistant", "content": "a0"}))


def test_a_leftover_copy_of_a_dropped_turn_is_superseded_and_done_stays_within_prompts(redis_url: str) -> None:
    keys = Keys(f"drop{uuid.uuid4().hex[:6]}")
    sync = redis.Redis.from_url(redis_url)
    _given_a_conversation_whose_later_turns_were_derived(sync, keys)

    async def scenario() -> dict[str, str]:
        client = aioredis.from_url(redis_url)
        await client.set(keys.heartbeat("w1"), "1")
        await client.set(keys.heartbeat("w2"), "1")
        ledger, other = Ledger(client, keys, "w1"), Ledger(client, keys, "w2")
        try:
            # Given a copy of turn 3's message already running on another worker
            running = await other.claim(JOB, T3)
            assert running.state == "new"
            # When turn 1 is (re-)run and its answer now calls a tool: the chain ends there, turns 2 and 3 dropped
            claim = await ledger.claim(JOB, T1)
            ended = json.dumps({"role": "assistant", "content": "a1", "chain_end": "tool_call"})
            turn = NextTurn(T1, ended, drop=(T2, T3))
            finalized = await ledger.finalize(
                JOB, DATASET, [_row(T1, claim.epoch)], 100, 0.95, turns=[turn], queue="scratch",
                answers=keys.turn_answers(JOB),
            )  # fmt: skip
            assert finalized.new == 1
            # Then a leftover copy of turn 2 (revision 0, still queued) is skipped at its claim as superseded
            leftover = await ledger.claim(JOB, T2, revision=0)
            assert leftover.state == "superseded", leftover
            # and the running copy of turn 3 is fenced at its finalize, not added to done
            late = await other.finalize(JOB, DATASET, [_row(T3, running.epoch)], 100, 0.95)
            assert late.new == 0 and late.fenced == {T3: "revision 1"}, late
            return {p.decode(): v.decode() for p, v in (await client.hgetall(keys.revisions(JOB))).items()}
        finally:
            await client.aclose()

    revisions = asyncio.run(scenario())
    # the dropped turns' revisions were raised in the finalize that dropped them
    assert revisions == {T2: "1", T3: "1"}
    done = {m.decode() for m in sync.smembers(keys.done(JOB))}
    prompts = {m.decode() for m in sync.hkeys(keys.prompts(JOB))}
    assert done == {T0, T1} and done <= prompts == {T0, T1}
    counters = {k.decode(): int(v) for k, v in sync.hgetall(keys.counters(JOB)).items() if v.lstrip(b"-").isdigit()}
    assert counters["done"] == 2 and counters["submitted"] == 2, counters
