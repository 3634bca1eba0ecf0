"""Fencing tokens (thinkfleet/state/ledger.py + lua/claim, mark_part, finalize, release, dead_letter) against a
real Redis: a worker paused past its lease — a zombie — can neither write, finalize, dead-letter nor release a
prompt another run took over, and epochs only grow, also across a Redis that lost its data."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.state.ledger import Fence, FinalRow, Ledger

JOB = "j"
PART = "file:///out/j/dataset=ds/part-1.parquet"


@pytest.fixture()
def keys() -> Keys:
    return Keys(f"fence{uuid.uuid4().hex[:6]}")


def run(coro):
    return asyncio.run(coro)


async def _ledger(redis_url: str, keys: Keys, worker: str) -> Ledger:
    client = aioredis.from_url(redis_url)
    await client.set(keys.heartbeat(worker), "1")  # alive
    return Ledger(client, keys, worker)


async def _pause(ledger: Ledger) -> None:
    """SIGSTOP past the lease: its heartbeat expires; the process (and what it holds in memory) lives on."""
    await ledger.r.delete(ledger.keys.heartbeat(ledger.worker))


async def _resume(ledger: Ledger) -> None:
    await ledger.r.set(ledger.keys.heartbeat(ledger.worker), "1")


def _row(pid: str = "p1", epoch: int = 0) -> FinalRow:
    return FinalRow(pid, 5, True, False, epoch=epoch)


def test_a_zombie_cannot_finalize_what_another_run_took_over(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given worker a claimed p1, then was paused past its lease, and b took p1 over.
        a = await _ledger(redis_url, keys, "a")
        b = await _ledger(redis_url, keys, "b")
        first = await a.claim(JOB, "p1")
        await _pause(a)
        second = await b.claim(JOB, "p1")
        assert first.state == "new" and second.state == "stale"
        assert second.epoch > first.epoch, "a later claim always has a higher epoch"
        await _resume(a)
        # When the zombie wakes and tries to commit its row.
        fenced = await a.mark_part(JOB, ["p1"], PART)
        result = await a.finalize(JOB, "ds", [_row()], 100, 0.95)
        # Then neither the mark nor the finalize is taken, and nothing was counted.
        assert fenced == {"p1": f"{second.epoch}@b"}
        assert result.new == 0 and result.fenced == {"p1": f"{second.epoch}@b"}
        assert not await a.r.sismember(keys.done(JOB), "p1")
        assert await a.r.hget(keys.counters(JOB), "done") is None
        # And the run that holds the claim finalizes, and its epoch is the committed one.
        assert await b.mark_part(JOB, ["p1"], PART) == {}
        assert (await b.finalize(JOB, "ds", [_row()], 100, 0.95)).new == 1
        assert int(await b.r.hget(keys.committed_epochs(JOB), "p1")) == second.epoch
        # A zombie that comes back after the finalize is fenced by the done set (the epoch differs).
        late = await a.finalize(JOB, "ds", [_row(epoch=first.epoch)], 100, 0.95)
        assert late.new == 0 and late.fenced == {"p1": "done"}
        assert int(await a.r.hget(keys.counters(JOB), "done")) == 1
        assert int(await a.r.hget(keys.counters(JOB), "fenced")) == 3  # every refused step counts

    run(scenario())


def test_a_retried_finalize_of_the_committed_row_is_not_fenced(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given a finalize whose reply was lost (the worker retries it).
        a = await _ledger(redis_url, keys, "a")
        claim = await a.claim(JOB, "p1")
        await a.mark_part(JOB, ["p1"], PART)
        fence = a.held[(JOB, "p1")]
        assert (await a.finalize(JOB, "ds", [_row()], 100, 0.95)).new == 1
        a.held[(JOB, "p1")] = fence  # as it held it when it sent the first try
        # When it finalizes the same row again: it is told the row is in, not fenced.
        again = await a.finalize(JOB, "ds", [_row(epoch=claim.epoch)], 100, 0.95)
        assert again.new == 0 and again.fenced == {}

    run(scenario())


def test_epochs_grow_across_a_redis_that_lost_everything(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        before = await a.claim(JOB, "p1")
        # Redis restarts empty (or a replica behind it is promoted): the clock key and the claim are gone.
        await a.r.delete(keys.epoch_clock(JOB), keys.claims(JOB))
        after = await (await _ledger(redis_url, keys, "b")).claim(JOB, "p1")
        assert after.state == "new" and after.epoch > before.epoch

    run(scenario())


def test_a_claim_lost_with_redis_is_ours_again_while_nobody_finished_the_prompt(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given our claim vanished (Redis restarted empty while we generated) and nobody else claimed since.
        a = await _ledger(redis_url, keys, "a")
        await a.claim(JOB, "p1")
        await a.r.delete(keys.claims(JOB))
        # Then our row is still marked, written and finalized (an empty Redis must not cost finished work).
        assert await a.mark_part(JOB, ["p1"], PART) == {}
        assert (await a.finalize(JOB, "ds", [_row()], 100, 0.95)).new == 1

    run(scenario())


def test_a_zombie_cannot_dead_letter_or_release_another_runs_claim(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        b = await _ledger(redis_url, keys, "b")
        await a.claim(JOB, "p1")
        await _pause(a)
        taken = await b.claim(JOB, "p1")
        await _resume(a)
        task = PromptTask(JOB, "ds", "p1", 0, "h", pack_ids([1, 2, 3]))
        assert not await a.dead_letter(task, "context_overflow", "too long", 1)
        assert not await a.r.hexists(keys.dead(JOB), "p1")
        # The same name, a new life (a twin or a restart) cannot release it either: the epoch differs.
        twin = await _ledger(redis_url, keys, "b")
        twin.held[(JOB, "p1")] = Fence(str(taken.epoch - 1))
        await twin.release(JOB, "p1")
        assert await b.r.hexists(keys.claims(JOB), "p1"), "the live run's claim stays"
        assert (await b.finalize(JOB, "ds", [_row()], 100, 0.95)).new == 1

    run(scenario())


def test_a_message_of_an_older_revision_is_superseded(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given producer retry --truncated asked for revision 1 of p1.
        a = await _ledger(redis_url, keys, "a")
        await a.r.hset(keys.revisions(JOB), "p1", 1)
        # Then a leftover copy of the revision-0 message is refused without a claim, and revision 1 runs.
        old = await a.claim(JOB, "p1", revision=0)
        assert old.state == "superseded" and not await a.r.hexists(keys.claims(JOB), "p1")
        assert (await a.claim(JOB, "p1", revision=1)).state == "new"

    run(scenario())


def test_a_claim_under_our_name_that_no_run_holds_is_let_go(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given Redis rolled back to before our finalize: our claim (with its part) is back, we run nothing.
        a = await _ledger(redis_url, keys, "a")
        await a.r.sadd(keys.jobs, JOB)
        await a.claim(JOB, "p1")
        await a.mark_part(JOB, ["p1"], PART)
        await a.claim(JOB, "p2")
        a.held.pop((JOB, "p1"))
        # When the worker reconciles its claims with what it runs.
        assert await a.abandon_claims(lambda job, pid: False) == 1
        # Then another worker's copy takes p1 over at once, and finds the part to finalize from; p2 stays ours.
        b = await _ledger(redis_url, keys, "b")
        claim = await b.claim(JOB, "p1")
        assert claim.state == "stale" and claim.part == PART
        assert (await b.claim(JOB, "p2")).state == "busy"

    run(scenario())


def test_a_mine_claim_names_the_part_of_the_finalize_redis_lost(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        first = await a.claim(JOB, "p1")
        await a.mark_part(JOB, ["p1"], PART)
        a.held.clear()  # the finalize that Redis then lost
        again = await a.claim(JOB, "p1")
        assert again.state == "mine" and again.part == PART and again.epoch > first.epoch

    run(scenario())
