"""Operator commands as transitions of the prompt state machine, against a real Redis (Lua scripts, no workers):
``producer cancel`` ends every parked message as a dead letter (or keeps it parked for a live run), and revisions
are fenced like epochs — ``mark_part`` and ``finalize`` refuse a run of a lower revision than the one ``producer
retry --truncated`` asked for."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import redis
import redis.asyncio as aioredis

from testing.fleet import dead_letters
from testing.harness import isolated_settings, make_prompts, producer_cli, submit_ids
from thinkfleet.broker.queues import decode_message
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.state import lifecycle as lc
from thinkfleet.state.ledger import FinalRow, Ledger
from thinkfleet.state.scripts import lua

PART = "file:///out/j/dataset=ds/part-1.parquet"


def _claim(client: redis.Redis, keys: Keys, job: str, pid: str, worker: str, part: str | None = None) -> None:
    """A claim as claim.lua + mark_part.lua leave it (a run of ``worker`` at epoch 7)."""
    client.hset(keys.claims(job), pid, json.dumps({"worker": worker, "part": part, "at": 1.0, "epoch": "7"}))


def test_cancel_dead_letters_parked_prompts_whose_claims_a_dead_worker_left(redis_url: str, tmp_path: Path) -> None:
    # Given a paused job of 8 prompts, all parked: a worker that died (no heartbeat) holds claims on p0..p2, one
    # naming the part it was committing (p2); a live worker runs p3; p4 was stored already (a stray copy).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    submit_ids(settings, "c", make_prompts(8, seed=11, length=8))
    assert lc.pause(client, settings, "c") == 8
    for pid in ("p00000", "p00001"):
        _claim(client, keys, "c", pid, "dead-worker")
    _claim(client, keys, "c", "p00002", "dead-worker", part=PART)
    client.hset(keys.deliveries("c"), "p00000", json.dumps({"x": 0, "k": 1, "ik": 0, "error": "WorkerLost"}))
    client.set(keys.heartbeat("live-worker"), "1")
    _claim(client, keys, "c", "p00003", "live-worker")
    client.sadd(keys.done("c"), "p00004")
    # When the job is cancelled.
    result = lc.cancel_detail(client, settings, "c")
    # Then every parked prompt no live run holds is dead-lettered `cancelled`, and the count is the dead letters.
    dead = dead_letters(client, keys, "c")
    expected = {f"p{i:05d}" for i in (0, 1, 2, 5, 6, 7)}
    assert set(dead) == expected
    assert {d["error_class"] for d in dead.values()} == {"cancelled"}
    assert result == lc.CancelResult(dead=6, finished=1, live=1)
    assert int(client.hget(keys.counters("c"), "dead")) == 6
    assert int(client.hget(keys.dataset_counters("c", "synthetic"), "dead")) == 6
    # The dead runs' claims go (no crash count left to charge a revived prompt) — except the one naming a part,
    # kept ownerless and settled so that the revived prompt is finalized from that part, not generated twice.
    assert set(client.hkeys(keys.claims("c"))) == {b"p00002", b"p00003"}
    kept = json.loads(client.hget(keys.claims("c"), "p00002"))
    assert kept["worker"] == "" and kept["settled"] and kept["part"] == PART
    assert not client.hexists(keys.deliveries("c"), "p00000")
    # The live run's message stays parked (that run ends the prompt); the stored prompt's copy is gone.
    parked = [decode_message(m).prompt_id for m in client.lrange(keys.parked("c"), 0, -1)]
    assert parked == ["p00003"]
    # And a second cancel after the live run ended clears its copy without a second dead letter.
    client.sadd(keys.done("c"), "p00003")
    client.hdel(keys.claims("c"), "p00003")
    assert lc.cancel_detail(client, settings, "c") == lc.CancelResult(finished=1)
    assert not client.llen(keys.parked("c"))
    assert int(client.hget(keys.counters("c"), "dead")) == 6


def test_cancel_racing_a_resume_leaves_each_message_parked_queued_or_dead(redis_url: str, tmp_path: Path) -> None:
    # Given a cancelled job whose parked messages a resume moves back meanwhile (simulated: moved before the
    # script runs on the slice the cancel read).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    submit_ids(settings, "r", make_prompts(4, seed=12, length=8))
    lc.pause(client, settings, "r")
    client.set(keys.job_state("r"), lc.CANCELLED)
    raws = client.lrange(keys.parked("r"), 0, -1)
    lc.unpark(client, settings, "r")  # the resume wins the race for every message
    script = client.register_script(lua("cancel"))
    args: list[object] = [keys.heartbeat("")]
    for raw in raws:
        task = decode_message(raw)
        args += [raw, task.prompt_id, lc.dead_record(task, "cancelled", "x", "t"), 1, task.revision]
    base = [keys.parked("r"), keys.dead("r"), keys.claims("r"), keys.counters("r"), keys.deliveries("r")]
    base += [keys.done("r"), keys.revisions("r")]
    states = script(keys=[*base, keys.dataset_counters("r", "synthetic")], args=args)
    # Then nothing is dead-lettered for messages the cancel no longer holds: they are queued again.
    assert states == [b"gone"] * 4
    assert not dead_letters(client, keys, "r")
    assert client.llen(settings.queue) == 4


def test_a_leftover_copy_of_an_older_revision_never_becomes_the_prompts_dead_letter(
    redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> None:
        # Given a prompt `producer retry --truncated` asked revision 1 of, a leftover copy of its revision-0 message
        # parked, and the job then cancelled (seen in the operator nemesis: the copy's dead letter was resent by
        # `retry --error-class cancelled` as revision 0, refused by every claim — the prompt never ended).
        settings = isolated_settings(redis_url, str(tmp_path / "out"))
        client = redis.Redis.from_url(redis_url)
        keys = settings.keys
        submit_ids(settings, "rv", make_prompts(2, seed=17, length=8))
        generation = json.loads(client.hget(keys.job("rv"), "generation"))
        client.hset(keys.revisions("rv"), mapping={"p00000": 1, "p00001": 1})
        lc.cancel(client, settings, "rv")  # the queued revision-0 messages: parked, then ended by the cancel
        # Then the cancel removed them without making either the prompt's dead letter.
        assert dead_letters(client, keys, "rv") == {}
        assert not client.llen(keys.parked("rv"))
        # And a worker popping such a copy (its cancel watch, a permanent failure) records no dead letter either.
        worker = await _ledger(redis_url, keys, "w")
        task = PromptTask("rv", "synthetic", "p00000", 0, "h", pack_ids([1, 2, 3]), generation=generation)
        assert not await worker.dead_letter(task, "cancelled", "job cancelled", 0)
        assert dead_letters(client, keys, "rv") == {}
        # While a copy of the revision asked for is dead-lettered as always.
        again = PromptTask("rv", "synthetic", "p00000", 0, "h", pack_ids([1, 2, 3]), revision=1, generation=generation)
        assert await worker.dead_letter(again, "cancelled", "job cancelled", 0)
        assert set(dead_letters(client, keys, "rv")) == {"p00000"}

    asyncio.run(scenario())


async def _ledger(redis_url: str, keys: Keys, worker: str) -> Ledger:
    client = aioredis.from_url(redis_url)
    await client.set(keys.heartbeat(worker), "1")
    return Ledger(client, keys, worker)


def test_a_run_of_an_older_revision_than_requested_is_fenced_at_mark_and_finalize(redis_url: str) -> None:
    async def scenario() -> None:
        keys = Keys("oprev")
        job = "j"
        # Given a revision-0 run of p1 that holds its claim at its epoch (a zombie paused while producer retry
        # --truncated took the prompt out of done and asked for revision 1; nobody claimed revision 1 yet).
        zombie = await _ledger(redis_url, keys, "zombie")
        await zombie.claim(job, "p1", revision=0)
        await zombie.r.hset(keys.revisions(job), "p1", 1)
        # When it marks and finalizes its revision-0 row.
        fenced = await zombie.mark_part(job, ["p1"], PART)
        late = await zombie.finalize(job, "ds", [FinalRow("p1", 5, True, True, revision=0)], 100, 0.95)
        # Then both refuse it (counted as fenced), and the revision-1 message is then claimed and stored.
        assert fenced == {"p1": "revision 1"}
        assert late.new == 0 and late.fenced == {"p1": "revision 1"}
        assert not await zombie.r.sismember(keys.done(job), "p1")
        assert int(await zombie.r.hget(keys.counters(job), "fenced")) == 2
        other = await _ledger(redis_url, keys, "other")
        claim = await other.claim(job, "p1", revision=1)
        assert claim.state == "new", "the fenced run let go of its own claim"
        assert await other.mark_part(job, ["p1"], PART) == {}
        assert (await other.finalize(job, "ds", [FinalRow("p1", 9, True, False, revision=1)], 100, 0.95)).new == 1

    asyncio.run(scenario())


def test_a_claim_redis_lost_is_not_taken_back_by_an_older_revision(redis_url: str) -> None:
    async def scenario() -> None:
        keys = Keys("oprev2")
        job = "j"
        # Given a revision-0 run whose claim is gone (finalized by another run, then producer retry --truncated
        # took the prompt out of done and asked for revision 1) — mark_part would take an unheld prompt back.
        zombie = await _ledger(redis_url, keys, "zombie")
        await zombie.claim(job, "p1", revision=0)
        await zombie.r.delete(keys.claims(job))
        await zombie.r.hset(keys.revisions(job), "p1", 1)
        # Then neither its mark nor its finalize takes it: the prompt waits for its revision-1 message.
        assert await zombie.mark_part(job, ["p1"], PART) == {"p1": "revision 1"}
        result = await zombie.finalize(job, "ds", [FinalRow("p1", 5, True, True)], 100, 0.95)
        assert result.fenced == {"p1": "revision 1"}
        assert not await zombie.r.hexists(keys.claims(job), "p1")
        assert not await zombie.r.sismember(keys.done(job), "p1")
        # And a row of the requested revision (or above) is finalized as before.
        await zombie.claim(job, "p1", revision=1)
        assert await zombie.mark_part(job, ["p1"], PART) == {}
        assert (await zombie.finalize(job, "ds", [FinalRow("p1", 5, True, False, revision=1)], 100, 0.95)).new == 1

    asyncio.run(scenario())


def test_a_purged_jobs_straggler_dead_letter_recreates_none_of_its_keys(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        # Given a worker running a prompt of a job that is then purged (`producer purge --force` while it runs).
        settings = isolated_settings(redis_url, str(tmp_path / "out"))
        client = redis.Redis.from_url(redis_url)
        keys = settings.keys
        submit_ids(settings, "pg", make_prompts(2, seed=13, length=8))
        generation = json.loads(client.hget(keys.job("pg"), "generation"))
        worker = await _ledger(redis_url, keys, "w")
        assert (await worker.claim("pg", "p00000", generation=generation)).state == "new"
        lc.purge(client, settings, "pg")
        assert not list(client.scan_iter(match=f"{keys.job('pg')}*"))
        # When its run ends in a permanent failure (or its stray copy names a job that is gone: unknown_job).
        task = PromptTask("pg", "synthetic", "p00000", 0, "h", pack_ids([1, 2, 3]), generation=generation)
        assert not await worker.dead_letter(task, "server_error", "HTTP 500 five times", 5)
        assert not await worker.dead_letter(task, "unknown_job", "no record", 0)
        # Then no key of the purged job comes back; the dead letters are recorded in the malformed list instead.
        assert not list(client.scan_iter(match=f"{keys.job('pg')}*"))
        recorded = [json.loads(m) for m in client.lrange(keys.malformed, 0, -1)]
        assert [r["error"].split(":")[0] for r in recorded] == ["purged_job", "purged_job"]
        # And a job submitted anew under the name (another generation) is not touched by the old message either.
        submit_ids(settings, "pg", make_prompts(2, seed=13, length=8))
        assert not await worker.dead_letter(task, "server_error", "late", 5)
        assert not client.hlen(keys.dead("pg"))

    asyncio.run(scenario())


def test_a_purged_jobs_straggler_commit_or_crash_recreates_none_of_its_keys(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        # Given three runs of a job's prompts when the job is purged: one committing, one generating, one crashing.
        settings = isolated_settings(redis_url, str(tmp_path / "out"))
        client = redis.Redis.from_url(redis_url)
        keys = settings.keys
        submit_ids(settings, "pg", make_prompts(3, seed=14, length=8))
        generation = json.loads(client.hget(keys.job("pg"), "generation"))
        worker = await _ledger(redis_url, keys, "w")
        for pid in ("p00000", "p00001", "p00002"):
            assert (await worker.claim("pg", pid, generation=generation)).state == "new"
        assert await worker.mark_part("pg", ["p00000"], PART) == {}
        lc.purge(client, settings, "pg")
        # When the first writes and finalizes its row, the second marks its part, and a third run crashes.
        late = await worker.finalize("pg", "synthetic", [FinalRow("p00000", 5, True, False)], 100, 0.95)
        assert late.new == 0 and late.fenced == {"p00000": "generation"}
        assert await worker.mark_part("pg", ["p00001"], PART) == {"p00001": "generation"}
        assert await worker.crashed("pg", "p00002", "RuntimeError: boom") == 0
        # Then no key of the purged job comes back (no fenced counter, no crash count).
        assert not list(client.scan_iter(match=f"{keys.job('pg')}*"))

    asyncio.run(scenario())


def test_purge_refuses_while_a_submit_or_retry_holds_the_jobs_lock_and_deletes_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    from producer.state import SubmitLock

    # Given a job and a submit (or retry) of it running: it holds the job's lock and stages its messages.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    submit_ids(settings, "pl", make_prompts(2, seed=15, length=8))
    client.delete(settings.queue)  # (nothing queued or running: purge would go ahead without --force)
    with SubmitLock(client, settings, "pl") as held:
        before = sorted(client.scan_iter(match=f"{keys.job('pl')}*"))
        # When the operator purges the job meanwhile.
        out = producer_cli(settings, "purge", "pl", in_process=True)
        # Then purge refuses, naming the lock, and deletes nothing: not the record, not the submit's lock.
        assert out.returncode != 0 and "another submit of job 'pl' holds its lock" in out.stderr, out
        assert sorted(client.scan_iter(match=f"{keys.job('pl')}*")) == before
        assert client.get(keys.submit_lock("pl")).decode() == held.token
    # And once the submit is over, purge goes ahead and leaves no key of the job, its lock included.
    out = producer_cli(settings, "purge", "pl", in_process=True)
    assert out.returncode == 0, out
    assert not list(client.scan_iter(match=f"{keys.job('pl')}*"))
    assert not client.sismember(keys.jobs, "pl")


def test_pause_never_overwrites_a_cancel_and_no_move_makes_state_for_an_unknown_job(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a cancelled job (a pause that read "active" just before the cancel, then set "paused", undid it).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    submit_ids(settings, "ps", make_prompts(2, seed=16, length=8))
    lc.cancel(client, settings, "ps")
    # When it is paused, then resumed and paused.
    try:
        lc.pause(client, settings, "ps")
        raise AssertionError("pause of a cancelled job went ahead")
    except lc.LifecycleError as exc:
        assert "cancelled" in str(exc) and "resume it first" in str(exc)
    # Then the cancel stands; after a resume the pause goes ahead.
    assert lc.get_state(client, settings, "ps") == lc.CANCELLED
    assert lc.move(client, settings, "ps", lc.ACTIVE, (lc.PAUSED, lc.CANCELLED)) == lc.CANCELLED
    lc.pause(client, settings, "ps")
    assert lc.get_state(client, settings, "ps") == lc.PAUSED
    # And a move of a job Redis does not know makes no state key for it.
    for op in (lc.pause, lc.resume, lc.cancel):
        try:
            op(client, settings, "nosuch")
            raise AssertionError(f"{op.__name__} of an unknown job went ahead")
        except lc.LifecycleError as exc:
            assert "no job 'nosuch'" in str(exc)
    assert not client.exists(keys.job_state("nosuch"))


def test_a_re_derived_next_turn_supersedes_the_leftover_copy_of_its_older_message(redis_url: str) -> None:
    async def scenario() -> None:
        from thinkfleet.broker.envelope import Envelope
        from thinkfleet.settings import Settings
        from workers.turns import NextTurn

        keys = Keys("opnext")
        job = "j"
        # Given turn 1 of a conversation stored at revision 0, and turn 0 re-run as revision 1 (retry --truncated):
        # its finalize re-derives turn 1 as revision 1, rendered from the new turn-0 answer.
        worker = await _ledger(redis_url, keys, "w")
        await worker.r.sadd(keys.done(job), "c/t1")
        await worker.r.hset(keys.prompts(job), "c/t1", "h-old")
        assert (await worker.claim(job, "c/t0", revision=1)).state == "new"
        envelope = Envelope(Settings(redis_url=redis_url, key_prefix="opnext", queue="opnext-q"))
        task = PromptTask(job, "ds", "c/t1", 0, "h-new", pack_ids([1, 2, 3]), revision=1)
        turn = NextTurn("c/t0", '{"content": "new"}', "c/t1", "h-new", envelope.encode(task))
        row = FinalRow("c/t0", 5, True, False, revision=1)
        done = await worker.finalize(job, "ds", [row], 100, 0.95, [turn], "opnext-q", keys.turn_answers(job))
        assert done.new == 1 and not await worker.r.sismember(keys.done(job), "c/t1")
        # Then a leftover copy of turn 1's revision-0 message (rendered from the old turn 0) is superseded, and the
        # re-derived revision-1 message runs.
        assert (await worker.claim(job, "c/t1", revision=0)).state == "superseded"
        assert (await worker.claim(job, "c/t1", revision=1)).state == "new"
        await worker.r.delete("opnext-q")

    asyncio.run(scenario())


def test_a_dead_letter_keeps_a_dead_runs_claim_naming_its_part_for_the_revived_claim(redis_url: str) -> None:
    async def scenario() -> None:
        keys = Keys("opdl")
        job = "j"
        # Given a run that named its part and died before its finalize (its row may be committed), and a worker
        # that pops the prompt's copy of a cancelled job: it dead-letters it before any claim of its own.
        dead_run = await _ledger(redis_url, keys, "dead-run")
        await dead_run.claim(job, "p1")
        assert await dead_run.mark_part(job, ["p1"], PART) == {}
        await dead_run.r.delete(keys.heartbeat("dead-run"))
        worker = await _ledger(redis_url, keys, "w")
        task = PromptTask(job, "ds", "p1", 0, "h", pack_ids([1, 2, 3]))
        assert await worker.dead_letter(task, "cancelled", "job cancelled", 0)
        # Then the claim stays, ownerless and settled, naming the part; after producer retry the next claim takes it
        # over without charging a death and finds the part (the pipeline finalizes from it when the row is there).
        kept = json.loads(await worker.r.hget(keys.claims(job), "p1"))
        assert kept["worker"] == "" and kept["settled"] and kept["part"] == PART
        await worker.r.hdel(keys.dead(job), "p1")  # what producer retry's requeue.lua does
        again = await worker.claim(job, "p1")
        assert again.state == "stale" and again.part == PART
        assert not await worker.r.hexists(keys.deliveries(job), "p1"), "no death charged"

    asyncio.run(scenario())
