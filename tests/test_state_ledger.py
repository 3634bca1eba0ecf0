"""The prompt state machine (thinkfleet/state/ledger.py + lua/) against a real Redis, transition by
transition: claims, hand-backs, crashes, deaths, suspects, poison, and the ambiguous commit."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.state.ledger import FinalRow, Ledger
from thinkfleet.state.scripts import lua

JOB = "j"


@pytest.fixture()
def keys() -> Keys:
    return Keys(f"led{uuid.uuid4().hex[:6]}")


def _task(pid: str = "p1") -> PromptTask:
    return PromptTask(JOB, "ds", pid, 0, "h", pack_ids([1, 2, 3]))


def run(coro):
    return asyncio.run(coro)


async def _ledger(redis_url: str, keys: Keys, worker: str, max_deliveries: int = 3) -> Ledger:
    client = aioredis.from_url(redis_url)
    await client.set(keys.heartbeat(worker), "1")  # alive
    return Ledger(client, keys, worker, max_deliveries)


async def _die(ledger: Ledger) -> None:
    """The worker is SIGKILLed: its heartbeat expires, its claims stay as they were."""
    await ledger.r.delete(ledger.keys.heartbeat(ledger.worker))


def test_a_clean_hand_back_charges_nothing(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        for _ in range(10):
            assert (await a.claim(JOB, "p1")).state == "new"
            await a.release(JOB, "p1")
        assert await a.r.hget(keys.deliveries(JOB), "p1") is None

    run(scenario())


def test_exceptions_make_poison_after_max_deliveries(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        assert (await a.claim(JOB, "p1")).state == "new"
        assert await a.crashed(JOB, "p1", "KeyError: 'x'") == 1
        assert (await a.claim(JOB, "p1")).state == "new"
        assert await a.crashed(JOB, "p1", "KeyError: 'x'") == 2
        # One short of the limit: its next run is isolated.
        assert (await a.claim(JOB, "p1")).state == "suspect"
        assert (await a.claim(JOB, "p1", isolated=True)).state == "new"
        assert await a.crashed(JOB, "p1", "KeyError: 'x'") == 3  # the runtime dead-letters it now
        assert await a.dead_letter(_task(), "poison:KeyError", "3 raised", 3)
        assert await a.r.hget(keys.deliveries(JOB), "p1") is None
        assert (await a.claim(JOB, "p1")).state == "dead"

    run(scenario())


def test_a_culprit_that_kills_every_worker_is_poison_and_bystanders_are_not(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        deaths = 0
        # Kill 1: worker w0 holds the culprit and a bystander.
        w = await _ledger(redis_url, keys, "w0")
        for pid in ("culprit", "bystander"):
            assert (await w.claim(JOB, pid)).state == "new"
        await _die(w)
        deaths += 1
        # Kill 2: w1 takes both over again (each death is charged once, at the takeover).
        w = await _ledger(redis_url, keys, "w1")
        for pid in ("culprit", "bystander"):
            assert (await w.claim(JOB, pid)).state == "stale"
        await _die(w)
        deaths += 1
        # Now both are suspects: w2 runs the culprit isolated; the bystander waits unclaimed.
        w = await _ledger(redis_url, keys, "w2")
        assert (await w.claim(JOB, "bystander")).state == "suspect"
        assert (await w.claim(JOB, "culprit")).state == "suspect"
        assert (await w.claim(JOB, "culprit", isolated=True)).state == "stale"
        await _die(w)  # kill 3, during the culprit's isolated run
        deaths += 1
        w = await _ledger(redis_url, keys, "w3")
        assert (await w.claim(JOB, "culprit")).state == "suspect", "one isolated death is not proof"
        assert (await w.claim(JOB, "culprit", isolated=True)).state == "stale"
        await _die(w)  # kill 4, isolated again
        deaths += 1
        w = await _ledger(redis_url, keys, "w4")
        poison = await w.claim(JOB, "culprit")
        assert poison.state == "poison" and poison.previous is not None
        assert poison.previous["ik"] == 2 and poison.previous["error"].startswith("WorkerLost")
        assert deaths == 3 + 1  # max_deliveries + 1
        # The bystander was never charged for the culprit's isolated deaths: it runs and is stored.
        suspect = await w.claim(JOB, "bystander")
        assert suspect.state == "suspect" and (suspect.previous or {}).get("ik") == 0
        assert (await w.claim(JOB, "bystander", isolated=True)).state == "stale"
        await w.finalize(JOB, "ds", [FinalRow("bystander", 5, True, False)], 100, 0.95)
        assert (await w.claim(JOB, "bystander")).state == "done"
        assert await w.r.hget(keys.deliveries(JOB), "bystander") is None

    run(scenario())


def test_a_bystander_killed_in_three_unrelated_deaths_is_not_poison(redis_url: str, keys: Keys) -> None:
    """The SIGKILL ×3 scenario: three external kills, the same prompt on the victim every time."""

    async def scenario() -> None:
        for i in range(3):
            w = await _ledger(redis_url, keys, f"v{i}")
            state = (await w.claim(JOB, "p1")).state
            if state == "suspect":
                state = (await w.claim(JOB, "p1", isolated=True)).state
            assert state in ("new", "stale")
            await _die(w)
        w = await _ledger(redis_url, keys, "survivor")
        assert (await w.claim(JOB, "p1")).state == "suspect"
        assert (await w.claim(JOB, "p1", isolated=True)).state == "stale"

    run(scenario())


def test_a_hand_back_after_the_part_was_named_keeps_the_part_for_the_next_claim(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        b = await _ledger(redis_url, keys, "b")
        assert (await a.claim(JOB, "p1")).state == "new"
        await a.mark_part(JOB, ["p1"], "file:///out/j/dataset=ds/part-1.parquet")
        await a.release(JOB, "p1")  # the write may have landed: the claim must remember where
        claim = await b.claim(JOB, "p1")
        assert claim.state == "stale" and claim.part == "file:///out/j/dataset=ds/part-1.parquet"
        assert await b.r.hget(keys.deliveries(JOB), "p1") is None, "a settled claim charges no death"

    run(scenario())


def test_a_restart_under_the_same_name_charges_the_death_of_its_previous_life(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        await a.r.sadd(keys.jobs, JOB)
        assert (await a.claim(JOB, "p1")).state == "new"
        again = await _ledger(redis_url, keys, "a")  # same name, new process: heartbeat fresh
        assert await again.abandon_claims() == 1
        assert (await again.claim(JOB, "p1")).state == "stale"
        record = json.loads(await a.r.hget(keys.deliveries(JOB), "p1"))
        assert record["k"] == 1 and record["x"] == 0

    run(scenario())


def test_dead_letter_is_recorded_once(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        assert await a.dead_letter(_task(), "context_overflow", "too long", 1)
        assert not await a.dead_letter(_task(), "context_overflow", "too long", 1)
        assert int(await a.r.hget(keys.counters(JOB), "dead")) == 1

    run(scenario())


def test_a_rollback_of_our_terminal_writes_is_seen_by_our_mark_and_dead_letters_are_recorded_again(
    redis_url: str, keys: Keys
) -> None:
    async def scenario() -> None:
        # Given a worker that finalized one prompt and dead-lettered another, and Redis's state saved after the first.
        a = await _ledger(redis_url, keys, "a")
        await a.r.hset(keys.job(JOB), "name", json.dumps(JOB))  # a job record: a purged job has none
        assert not await a.lost_finalizes(JOB), "nothing written yet: nothing to have lost"
        assert (await a.claim(JOB, "p1")).state == "new"
        await a.finalize(JOB, "ds", [FinalRow("p1", 5, True, False)], 100, 0.95)
        assert not await a.lost_finalizes(JOB)
        saved = await a.r.hget(keys.finalize_marks(JOB), "a")
        assert (await a.claim(JOB, "p2")).state == "new"
        assert await a.dead_letter(_task("p2"), "bad_output", "the row cannot be stored", 1)
        assert not await a.lost_finalizes(JOB)
        # When Redis comes back from that state: the dead letter, the claim and the mark after it are gone.
        await a.r.hdel(keys.dead(JOB), "p2")
        await a.r.hset(keys.finalize_marks(JOB), "a", saved)
        # Then the worker's mark is older than its latest write: it knows, and records the dead letter again.
        assert await a.lost_finalizes(JOB)
        assert await a.unresolved(JOB, ["p1", "p2"]) == ["p2"]
        assert await a.redo_dead_letters(JOB) == 1
        assert json.loads(await a.r.hget(keys.dead(JOB), "p2"))["error_class"] == "bad_output"
        await a.remark(JOB)
        assert not await a.lost_finalizes(JOB)
        # And another life under the same name (another nonce) never takes its mark for ours.
        b = Ledger(a.r, keys, "a")
        assert not await b.lost_finalizes(JOB), "b finalized nothing of this job"
        # And a purged job (no record) is never finalized again: nothing would bring its keys back.
        await a.r.hset(keys.finalize_marks(JOB), "a", saved)
        await a.r.delete(keys.job(JOB))
        assert not await a.lost_finalizes(JOB)

    run(scenario())


def test_a_rollback_is_seen_even_after_a_later_finalize_wrote_a_newer_mark(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given a worker that finalized p1 and then p2, and Redis's state saved between the two.
        a = await _ledger(redis_url, keys, "a")
        await a.r.hset(keys.job(JOB), "name", json.dumps(JOB))
        for pid in ("p1", "p2"):
            assert (await a.claim(JOB, pid)).state == "new"
            await a.finalize(JOB, "ds", [FinalRow(pid, 5, True, False)], 100, 0.95)
            if pid == "p1":
                saved = await a.r.hget(keys.finalize_marks(JOB), "a")
        # When Redis comes back from that state (p2's finalize and its mark lost) and, before the worker looks, it
        # finalizes p3: its mark is the latest again.
        await a.r.srem(keys.done(JOB), "p2")
        await a.r.hset(keys.finalize_marks(JOB), "a", saved)
        assert (await a.claim(JOB, "p3")).state == "new"
        await a.finalize(JOB, "ds", [FinalRow("p3", 5, True, False)], 100, 0.95)
        # Then the loss is still seen (p3's write found the mark behind p2's), and cleared once made good.
        assert await a.lost_finalizes(JOB)
        assert await a.unresolved(JOB, ["p1", "p2", "p3"]) == ["p2"]
        await a.remark(JOB)
        assert not await a.lost_finalizes(JOB)
        # And finalizes landing out of order (concurrent calls) never look like a loss.
        for pid in ("p4", "p5"):
            assert (await a.claim(JOB, pid)).state == "new"
        late = a._next_mark(JOB)[1]  # p4's call, which Redis answers after p5's
        await a.finalize(JOB, "ds", [FinalRow("p5", 5, True, False)], 100, 0.95)
        # (the mark alone, as p4's finalize would write it: through the same Lua piece)
        await a.r.eval(lua("_mark") + "\nwrite_mark(KEYS[1], ARGV[1], ARGV[2])", 1, keys.finalize_marks(JOB), "a", late)
        assert not await a.lost_finalizes(JOB)
        assert (await a.r.hget(keys.finalize_marks(JOB), "a")).decode().endswith(f":{a._mark_seq}"), "not regressed"

    run(scenario())


def test_a_replayed_finalize_leaves_the_fence_of_a_live_run_of_the_same_prompt(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        # Given a prompt this process finalized once (its fence remembered) and now runs again under a new claim.
        a = await _ledger(redis_url, keys, "a")
        assert (await a.claim(JOB, "p1")).state == "new"
        old = a.fence(JOB, "p1")
        await a.r.hdel(keys.claims(JOB), "p1")  # (as a rollback leaves it: the old claim gone)
        assert (await a.claim(JOB, "p1")).state == "new"
        live = a.fence(JOB, "p1")
        assert old is not None and live is not None and live != old
        # When a finalize of the old row is replayed under the old fence (GroupCommitter.replay), and the live run
        # marks its part while that finalize waits on Redis (the two run concurrently in one process).
        replay = asyncio.ensure_future(
            a.finalize(JOB, "ds", [FinalRow("p1", 5, True, False)], 100, 0.95, fences={"p1": old})
        )
        marked = await a.mark_part(JOB, ["p1"], "part-live")
        finalized = await replay
        # Then the live run marked under its own fence (not fenced by its own claim), the replay is fenced by the
        # live claim, and the live run still holds its fence for its own finalize.
        assert marked == {}
        assert "p1" in finalized.fenced
        assert a.fence(JOB, "p1") == live

    run(scenario())


async def _record(ledger: Ledger, pid: str) -> dict:
    raw = await ledger.r.hget(ledger.keys.deliveries(JOB), pid)
    return json.loads(raw) if raw else {}


def test_suspects_run_together_and_a_group_that_dies_again_is_split_in_halves(redis_url: str, keys: Keys) -> None:
    """Group testing: last-chance prompts share one group per worker; a death halves each member's group, and
    only deaths alone in their group (ik) can make poison — the culprit is still found, its group's others run."""

    async def scenario() -> None:
        pids = [f"p{i}" for i in range(4)]
        # Two unrelated deaths of workers holding all four: each is one crash short of max_deliveries now.
        for name in ("v0", "v1"):
            w = await _ledger(redis_url, keys, name)
            for pid in pids:
                assert (await w.claim(JOB, pid)).state in ("new", "stale")
            await _die(w)
        # All four run at once in one worker's group (not one at a time): each claim is ours.
        w = await _ledger(redis_url, keys, "g1")
        for size, pid in enumerate(pids, 1):
            assert (await w.claim(JOB, pid)).state == "suspect"
            assert (await w.claim(JOB, pid, isolated=True, group_size=size)).state == "stale"
        assert await w.r.scard(keys.suspect_group(w.group)) == 4
        await _die(w)  # the group of four dies: split, nobody is proven anything
        w = await _ledger(redis_url, keys, "g2")
        for pid in pids:
            suspect = await w.claim(JOB, pid)
            assert suspect.state == "suspect"
            assert suspect.previous is not None and suspect.previous["g"] == 2 and suspect.previous["ik"] == 0
        # A group over a member's cap is refused (claimed again once it fits); two fit.
        assert (await w.claim(JOB, "p0", isolated=True, group_size=3)).state == "suspect"
        assert (await w.claim(JOB, "p0", isolated=True, group_size=1)).state == "stale"
        assert (await w.claim(JOB, "p1", isolated=True, group_size=2)).state == "stale"
        # p2 and p3 run too and are stored (a run leaves the group when it ends).
        for pid in ("p2", "p3"):
            assert (await w.claim(JOB, pid, isolated=True, group_size=1)).state == "stale"
            await w.finalize(JOB, "ds", [FinalRow(pid, 5, True, False)], 100, 0.95)
            await w.leave_group(JOB, pid)
        await _die(w)  # p0 (the culprit) kills its group of two
        # Then each runs alone: p1 completes, p0 dies alone twice and is poison.
        w = await _ledger(redis_url, keys, "g3")
        split = await w.claim(JOB, "p1")  # a death is charged when its claim is taken over
        assert split.state == "suspect" and split.previous is not None and split.previous["g"] == 1
        assert (await w.claim(JOB, "p1", isolated=True, group_size=1)).state == "stale"
        await w.finalize(JOB, "ds", [FinalRow("p1", 5, True, False)], 100, 0.95)
        for alone in (1, 2):
            w = await _ledger(redis_url, keys, f"alone{alone}")
            assert (await w.claim(JOB, "p0", isolated=True, group_size=1)).state == "stale"
            await _die(w)
        poison = await (await _ledger(redis_url, keys, "last")).claim(JOB, "p0")
        assert poison.state == "poison" and poison.previous is not None and poison.previous["ik"] == 2
        assert await w.r.smembers(keys.done(JOB)) == {b"p1", b"p2", b"p3"}

    run(scenario())


def test_a_worker_paused_past_its_lease_takes_back_the_death_charged_to_its_prompt(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        a = await _ledger(redis_url, keys, "a")
        mine = await a.claim(JOB, "p1")
        assert mine.state == "new"
        await _die(a)  # paused past its lease: its heartbeat expired
        b = await _ledger(redis_url, keys, "b")
        assert (await b.claim(JOB, "p1")).state == "stale"
        assert (await _record(b, "p1"))["k"] == 1, "a lapsed lease looks like a death when the claim is taken over"
        # Another worker, or another claim of ours, cannot take the charge back; a's own claim can, once.
        c = await _ledger(redis_url, keys, "c")
        assert not await c.came_back(JOB, "p1", mine.epoch)
        assert not await a.came_back(JOB, "p1", mine.epoch + 1)
        await a.r.set(keys.heartbeat("a"), "1")  # a comes back
        assert await a.came_back(JOB, "p1", mine.epoch)
        assert not await a.came_back(JOB, "p1", mine.epoch)
        assert await a.r.hget(keys.deliveries(JOB), "p1") is None, "no death is charged to p1"
        assert (await b.claim_owner(JOB, "p1")) == "b", "the run that took it over keeps it"

    run(scenario())


def test_a_came_back_worker_takes_back_its_split_but_not_a_later_death(redis_url: str, keys: Keys) -> None:
    async def scenario() -> None:
        for name in ("v0", "v1"):  # one crash short of max_deliveries
            w = await _ledger(redis_url, keys, name)
            for pid in ("p1", "p2"):
                await w.claim(JOB, pid)
            await _die(w)
        a = await _ledger(redis_url, keys, "a")
        held = {}
        for size, pid in enumerate(("p1", "p2"), 1):
            assert (await a.claim(JOB, pid)).state == "suspect"
            held[pid] = await a.claim(JOB, pid, isolated=True, group_size=size)
        await _die(a)  # paused
        b = await _ledger(redis_url, keys, "b")
        assert (await b.claim(JOB, "p1", isolated=True, group_size=1)).state == "stale"
        assert (await _record(b, "p1"))["g"] == 1
        assert await a.came_back(JOB, "p1", held["p1"].epoch)
        record = await _record(b, "p1")
        assert record["k"] == 2 and "g" not in record and record["ik"] == 0

    run(scenario())
