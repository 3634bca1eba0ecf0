"""`producer status` from counters (O(1) of the queue) agrees with the full scan through every transition.

A real submit enqueues two datasets; a real ledger (thinkfleet/state/ledger.py) claims, finalizes (with a next
turn), dead-letters; `producer retry` re-queues; drift planted in a counter is found and repaired by the check.
After each step the counters read (``read(deep=False)``) must equal the scan (``read(deep=True)``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from click.testing import CliRunner

from producer.cli import cli
from producer.state import _refill_done
from producer.status import CheckClock, StatusReader
from producer.submit import submit
from producer.submit_options import SubmitOptions
from testing.datasets import chat_rows, write_jsonl
from testing.harness import isolated_settings
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.keys import KombuKeys
from thinkfleet.broker.queues import decode_message
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.state.counters import check_counters, last_check
from thinkfleet.state.ledger import FinalRow, Ledger

JOB = "c"
COUNTS = ("total", "queued", "running", "done", "dead")


@pytest.fixture
def job(redis_url: str, tmp_path: Path) -> Settings:
    """Job "c": alpha 12 prompts, beta 8, submitted for real (queue, prompt hashes, dataset counters)."""
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    paths = [write_jsonl(tmp_path / "alpha.jsonl", chat_rows(12, words=6)),
             write_jsonl(tmp_path / "beta.jsonl", chat_rows(8, words=6, seed=1))]  # fmt: skip
    submit(settings, SubmitOptions(paths=paths, job=JOB, tokenizer=str(tok), processes=1))
    return settings


def _tasks(client: redis.Redis, settings: Settings) -> dict[str, PromptTask]:
    return {t.prompt_id: t for t in (decode_message(m) for m in client.lrange(settings.queue, 0, -1))}


def _counts(st: dict[str, Any]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    return {k: st[k] for k in COUNTS}, {n: {k: d[k] for k in COUNTS} for n, d in st["datasets"].items()}


def _agree(client: redis.Redis, settings: Settings) -> dict[str, Any]:
    """The counters read and the scan say the same; returns the counters read."""
    reader = StatusReader(client, settings, JOB)
    fast, deep = reader.read(deep=False), reader.read(deep=True)
    assert fast["mode"] == "counters" and deep["mode"] == "deep"
    assert _counts(fast) == _counts(deep)
    assert deep["unaccounted"] == 0
    return fast


async def _ledger(settings: Settings, worker: str = "w1") -> Ledger:
    client = aioredis.from_url(settings.redis_url)
    await client.set(settings.keys.heartbeat(worker), "1")  # alive: its claims count as running
    return Ledger(client, settings.keys, worker)


def _row(pid: str, epoch: int = 0) -> FinalRow:
    return FinalRow(pid, completion_tokens=50, has_think_end=True, truncated=False, epoch=epoch)


def test_counters_agree_with_the_scan_through_claims_finalizes_dead_letters_and_retry(
    job: Settings, redis_client: redis.Redis
) -> None:
    tasks = _tasks(redis_client, job)
    alpha = sorted(p for p in tasks if p.startswith("alpha/"))
    beta = sorted(p for p in tasks if p.startswith("beta/"))

    async def work() -> None:
        ledger = await _ledger(job)
        # Given 5 alpha and 2 beta stored, 2 beta dead-lettered and 3 alpha running (claimed by a live worker).
        for pid in alpha[:5] + beta[:2]:
            claim = await ledger.claim(JOB, pid)
            ds = tasks[pid].dataset
            await ledger.finalize(JOB, ds, [_row(pid, claim.epoch)], alarm_min_rows=1000, alarm_share=0.5)
        for pid in beta[2:4]:
            await ledger.claim(JOB, pid)
            assert await ledger.dead_letter(tasks[pid], "context_overflow", "too long", attempts=1)
        for pid in alpha[5:8]:
            await ledger.claim(JOB, pid)
        await ledger.r.aclose()

    asyncio.run(work())
    fast = _agree(redis_client, job)
    assert _counts(fast)[1] == {
        "alpha": {"total": 12, "queued": 4, "running": 3, "done": 5, "dead": 0},
        "beta": {"total": 8, "queued": 4, "running": 0, "done": 2, "dead": 2},
    }
    assert fast["unaccounted"] is None  # pending prompts were not looked for: only the scan knows
    # When the operator retries the dead letters (requeue.lua), the counters follow.
    result = CliRunner().invoke(cli, ["retry", JOB, "--json", "--redis-url", job.redis_url,
                                      "--key-prefix", job.key_prefix, "--queue", job.queue])  # fmt: skip
    assert result.exit_code == 0, result.output
    fast = _agree(redis_client, job)
    assert fast["datasets"]["beta"]["dead"] == 0 and fast["dead"] == 0


def test_a_next_turn_a_finalize_adds_counts_as_submitted(job: Settings, redis_client: redis.Redis) -> None:
    tasks = _tasks(redis_client, job)
    pid = sorted(p for p in tasks if p.startswith("alpha/"))[0]
    turn = SimpleNamespace(answer='{"role": "assistant"}', next_prompt_id=f"{pid}/t1", next_hash="h1",
                           next_message=b"not-a-kombu-message", drop=())  # fmt: skip

    async def work() -> None:
        ledger = await _ledger(job)
        claim = await ledger.claim(JOB, pid)
        answers = job.keys.turn_answers(JOB)
        await ledger.finalize(JOB, "alpha", [_row(pid, claim.epoch)], 1000, 0.5, turns=[turn], queue="scratch",
                              answers=answers)  # fmt: skip
        await ledger.r.aclose()

    asyncio.run(work())
    st = StatusReader(redis_client, job, JOB).read(deep=False)
    assert st["total"] == 21 and st["datasets"]["alpha"]["total"] == 13 and st["datasets"]["alpha"]["done"] == 1
    assert check_counters(redis_client, job.keys, JOB, ["alpha", "beta"]).ok


def test_the_check_finds_and_repairs_drift_and_status_shows_its_verdict(
    job: Settings, redis_client: redis.Redis
) -> None:
    # Given a counter that drifted (a hand edit, a bug): alpha says 7 done, the done set holds none.
    redis_client.hincrby(job.keys.dataset_counters(JOB, "alpha"), "done", 7)
    reader = StatusReader(redis_client, job, JOB)
    assert reader.read(deep=False)["datasets"]["alpha"]["done"] == 7
    # When the full check runs (status --deep), it reports the drift and repairs it (nothing moved meanwhile).
    deep = reader.read(deep=True)
    verdict = last_check(redis_client, job.keys, JOB)
    assert verdict is not None and verdict["counter_drift"] == {"alpha": {"done": 7}} and verdict["repaired"]
    assert deep["datasets"]["alpha"]["done"] == 0
    # Then the counters read agrees again, and carries the verdict of that check.
    fast = reader.read(deep=False)
    assert fast["datasets"]["alpha"]["done"] == 0 and fast["checked"]["unaccounted"] == 0
    assert check_counters(redis_client, job.keys, JOB).ok


def test_the_done_refill_of_a_submit_counts_only_what_it_adds(job: Settings, redis_client: redis.Redis) -> None:
    k = job.keys
    redis_client.sadd(k.done(JOB), "alpha/r0")
    redis_client.hincrby(k.dataset_counters(JOB, "alpha"), "done", 1)
    with redis_client.pipeline(transaction=True) as pipe:
        _refill_done(pipe, job, JOB, [("alpha/r0", "alpha"), ("alpha/r1", "alpha"), ("beta/r0", "beta")])
        assert pipe.execute() == [2]
    assert check_counters(redis_client, k, JOB, ["alpha", "beta"], repair=False).ok


def test_a_finished_jobs_overall_rate_is_over_its_run_not_until_now(job: Settings, redis_client: redis.Redis) -> None:
    # Given every prompt dead-lettered by hand 100 s to 40 s ago (the timeline says when rows were committed).
    k, now = job.keys, time.time()
    pids = [p.decode() for p in redis_client.hkeys(k.prompts(JOB))]
    redis_client.hset(k.dead(JOB), mapping={p: "{}" for p in pids})
    redis_client.hset(k.counters(JOB), mapping={"done": 60})
    redis_client.zadd(k.timeline(JOB), {f"{now - 100}:30:0": now - 100, f"{now - 40}:30:0": now - 40})
    st = StatusReader(redis_client, job, JOB).read(deep=False)
    assert st["finished"] and st["unaccounted"] == 0
    assert st["rates"]["elapsed_s"] == pytest.approx(60, abs=0.5)
    assert st["rates"]["overall_prompts_per_s"] == pytest.approx(1.0, abs=0.02)


def test_watch_writes_a_line_per_refresh_when_stdout_is_not_a_terminal(
    job: Settings, redis_client: redis.Redis
) -> None:
    k = job.keys
    redis_client.hset(k.dead(JOB), mapping={p: "{}" for p in redis_client.hkeys(k.prompts(JOB))})
    result = CliRunner().invoke(cli, ["status", JOB, "--watch", "--interval", "0.1", "--redis-url", job.redis_url,
                                      "--key-prefix", job.key_prefix, "--queue", job.queue])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"job {JOB} finished: 20/20 finished" in result.output and "dead 20" in result.output


def test_the_check_clock_keeps_full_checks_under_a_share_of_redis_time() -> None:
    clock = CheckClock(every_s=10.0, max_share=0.01)
    clock.ran(took_s=0.5)  # a check of 0.5 s: the next after 50 s, not 10
    assert clock.next_at - time.monotonic() == pytest.approx(50, abs=1)
    clock.ran(took_s=0.01)
    assert clock.next_at - time.monotonic() == pytest.approx(10, abs=1)


def test_a_large_job_is_read_from_counters_and_a_small_one_scanned(job: Settings, redis_client: redis.Redis) -> None:
    import producer.status as status

    reader = StatusReader(redis_client, job, JOB)
    assert reader.read()["mode"] == "deep"  # 20 prompts, 20 messages: the scan is cheap
    old = status.AUTO_DEEP_MESSAGES
    status.AUTO_DEEP_MESSAGES = 10
    try:
        assert reader.read()["mode"] == "counters"
    finally:
        status.AUTO_DEEP_MESSAGES = old
    json.dumps(reader.read())  # JSON-clean in both modes


def test_wait_checks_the_done_set_against_storage_a_chunk_at_a_time(job: Settings, redis_client: redis.Redis) -> None:
    # Given a finished job: 19 dead-lettered, 1 done in Redis that storage does not hold (nothing was stored).
    k = job.keys
    pids = sorted(p.decode() for p in redis_client.hkeys(k.prompts(JOB)))
    redis_client.hset(k.dead(JOB), mapping={p: "{}" for p in pids[1:]})
    redis_client.sadd(k.done(JOB), pids[0])
    args = ["wait", JOB, "--json", "--timeout", "30", "--redis-url", job.redis_url, "--key-prefix", job.key_prefix,
            "--queue", job.queue, "--output-uri", job.output_uri]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    # Then wait exits 3 and names it; once it is dead-lettered instead, wait exits 0.
    assert result.exit_code == 3, result.output
    assert pids[0] in result.output and '"missing_from_storage": 1' in result.output
    redis_client.srem(k.done(JOB), pids[0])
    redis_client.hset(k.dead(JOB), pids[0], "{}")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert '"missing_from_storage": 0' in result.output


def test_the_place_check_finds_what_the_scan_finds_holding_no_set(job: Settings, redis_client: redis.Redis) -> None:
    from thinkfleet.state.invariant import account
    from thinkfleet.state.places import check_places

    r, k = redis_client, job.keys
    raws = {decode_message(m).prompt_id: m for m in r.lrange(job.queue, 0, -1)}
    pids = sorted(raws)
    # Given one prompt delivered (unacked), one popped into a worker's transit list, one done, two lost.
    unacked = KombuKeys(job.key_prefix).unacked
    r.lrem(job.queue, 1, raws[pids[0]])
    r.hset(unacked, "tag-1", json.dumps([json.loads(raws[pids[0]]), "", job.queue]))
    r.lrem(job.queue, 1, raws[pids[1]])
    r.rpush(k.transit("w9"), raws[pids[1]])
    r.sadd(k.done(JOB), pids[2])
    for pid in pids[3:5]:
        r.lrem(job.queue, 1, raws[pid])
    # When the place check counts in Redis, it finds exactly what the full scan finds.
    found = check_places(r, job, JOB)
    assert found is not None
    assert found.unaccounted == 2 and found.unaccounted_ids == sorted(account(r, job, JOB).unaccounted)
    assert found.passes == 2 and not list(r.scan_iter(match=f"{job.key_prefix}:job:{JOB}:check:*"))


def test_wait_on_a_large_job_finds_a_lost_prompt_by_its_periodic_check(
    job: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import producer.status as status

    monkeypatch.setattr(status, "AUTO_DEEP_MESSAGES", 0)  # read from counters, as a job of 88k prompts is
    raw = next(m for m in redis_client.lrange(job.queue, 0, -1) if decode_message(m).prompt_id == "alpha/r3")
    redis_client.lrem(job.queue, 1, raw)
    args = ["wait", JOB, "--lost-after", "0.3", "--check-every", "0.1", "--interval", "0.1", "--timeout", "900",
            "--redis-url", job.redis_url, "--key-prefix", job.key_prefix, "--queue", job.queue]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 3, result.output
    assert "alpha/r3" in result.output and "re-enqueues" in result.output
    assert last_check(redis_client, job.keys, JOB)["unaccounted"] == 1  # type: ignore[index]


def test_wait_checks_early_when_the_broker_is_empty_and_prompts_are_pending(
    job: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import producer.status as status

    monkeypatch.setattr(status, "AUTO_DEEP_MESSAGES", -1)  # read from counters, as a large job is
    redis_client.delete(job.queue)  # every message gone, nothing running: all 20 lost
    args = ["wait", JOB, "--lost-after", "0.3", "--interval", "0.1", "--timeout", "900", "--redis-url",
            job.redis_url, "--key-prefix", job.key_prefix, "--queue", job.queue]  # fmt: skip
    # --check-every stays 300 s: the suspicion brings the check forward (the confirming one comes once the first's
    # cost allows, at most 1 % of the time: seconds here, more on a loaded box — hence the long --timeout)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 3, result.output
    assert "20 prompt(s)" in result.output
