"""Job priority on the Redis broker: kombu's priority lists (0 is the highest, the default; 9 the lowest).

A job's messages are committed onto the list of its priority, saying that priority in
``properties.priority``; the transit pop (workers/transit.py) takes the highest-priority list first;
pause/resume, ``producer retry`` and the transit sweeper keep each message on its own list.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

from producer.enqueue import Stager, job_priority
from producer.jobrecord import submit_priority
from producer.retry import _requeue
from producer.submit_options import SubmitOptions
from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import IdJob, fast_env, isolated_settings, make_prompts, register_ids
from testing.record import check_job
from thinkfleet.broker.envelope import Envelope
from thinkfleet.broker.keys import priority_list, priority_lists
from thinkfleet.broker.queues import queue_keys
from thinkfleet.broker.transit import TransitSweeper
from thinkfleet.settings import Settings
from thinkfleet.state import lifecycle as lc
from thinkfleet.state.invariant import account
from thinkfleet.state.job import JobRecord

SAMPLING = {"max_new_tokens": 64}


def queue_job(settings: Settings, job: str, prompts: dict[str, list[int]], priority: int) -> IdJob:
    """Register ``job`` with ``priority`` in its record and commit its messages as ``producer submit`` does."""
    client = redis.Redis.from_url(settings.redis_url)
    id_job, tasks = register_ids(settings, job, prompts, **SAMPLING)
    record = JobRecord.load(client, settings.keys, job)
    assert record is not None
    record.priority = priority
    record.save(client, settings.keys)
    stager = Stager(client, settings.keys, job, settings.queue, priority)
    stager.push(Envelope(settings, priority).encode_many(tasks))
    stager.commit()
    return id_job


def _priorities(client: redis.Redis, key: str) -> list[int]:
    return [json.loads(m)["properties"]["priority"] for m in client.lrange(key, 0, -1)]


def test_jobs_land_on_the_list_of_their_priority(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    plain = Envelope(settings)
    queue_job(settings, "p0", make_prompts(3, seed=1), 0)
    queue_job(settings, "p5", make_prompts(4, seed=2), 5)
    low = f"{settings.queue}\x06\x165"
    assert priority_list(settings.queue, 5) == low and priority_list(settings.queue, 0) == settings.queue
    assert priority_list(settings.queue, 42) == f"{settings.queue}\x06\x169"  # clamped to kombu's last step
    assert client.llen(settings.queue) == 3 and _priorities(client, settings.queue) == [0, 0, 0]
    assert client.llen(low) == 4 and _priorities(client, low) == [5, 5, 5, 5]
    assert queue_keys(client, settings.queue) == [settings.queue, low]
    # Priority 0 is Celery's message as captured; another priority changes only properties.priority.
    assert b'"priority": 0, "body_encoding"' in plain._literals[-2]
    assert b'"priority": 5, "body_encoding"' in Envelope(settings, 5)._literals[-2]
    assert job_priority(client, settings, "p5") == 5 and job_priority(client, settings, "nope") == 0
    # The live invariant counts the priority list as queued.
    assert account(client, settings, "p5").counts()["queued"] == 4


def test_submit_priority_is_the_flag_else_the_jobs() -> None:
    opts = SubmitOptions.__new__(SubmitOptions)
    opts.priority = None
    assert submit_priority(opts, None) == 0
    record = JobRecord.from_dict({"priority": 7})
    assert submit_priority(opts, record) == 7
    opts.priority = 2
    assert submit_priority(opts, record) == 2


def test_pause_resume_keeps_a_jobs_priority(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    queue_job(settings, "a", make_prompts(5, seed=3), 0)
    queue_job(settings, "b", make_prompts(6, seed=4), 3)
    low = priority_list(settings.queue, 3)
    before = client.lrange(low, 0, -1)
    assert lc.pause(client, settings, "b") == 6
    assert client.llen(low) == 0 and client.llen(settings.queue) == 5
    assert account(client, settings, "b").counts()["queued"] == 6
    assert lc.resume(client, settings, "b") == 6
    assert client.lrange(low, 0, -1) == before  # same list, same order
    assert client.llen(settings.queue) == 5


def test_resume_puts_a_copy_a_worker_parked_back_at_the_jobs_priority(redis_url: str, tmp_path: Path) -> None:
    # A worker that pops a paused job's message parks a copy re-encoded at priority 0 (workers/runtime.py).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    queue_job(settings, "c", make_prompts(3, seed=10), 7)
    _, tasks = register_ids(settings, "c", make_prompts(1, seed=12), **SAMPLING)
    record = JobRecord.load(client, settings.keys, "c")
    assert record is not None
    record.priority = 7
    record.save(client, settings.keys)
    assert lc.pause(client, settings, "c") == 3
    client.lpush(settings.keys.parked("c"), Envelope(settings).encode(tasks[0]))
    assert lc.resume(client, settings, "c") == 4
    assert client.llen(settings.queue) == 0
    assert _priorities(client, priority_list(settings.queue, 7)) == [7, 7, 7, 7]
    for raw in client.lrange(priority_list(settings.queue, 7), 0, -1):
        lc.decode_message(raw)  # still a whole message


def test_retry_requeues_onto_the_jobs_priority_list(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    _, tasks = register_ids(settings, "r", make_prompts(3, seed=11), **SAMPLING)
    record = JobRecord.load(client, settings.keys, "r")
    assert record is not None
    record.priority = 2
    record.save(client, settings.keys)
    _requeue(client, settings, "r", "dead", tasks)
    assert client.llen(settings.queue) == 0
    assert _priorities(client, priority_list(settings.queue, 2)) == [2, 2, 2]


def test_sweeper_returns_each_transit_message_to_its_own_list(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    _, hi = register_ids(settings, "s0", make_prompts(2, seed=5))
    _, lo = register_ids(settings, "s6", make_prompts(2, seed=6))
    transit = settings.keys.transit("dead-worker")  # no heartbeat: a dead worker's list
    client.lpush(transit, *Envelope(settings).encode_many(hi), *Envelope(settings, 6).encode_many(lo))

    async def sweep() -> int:
        r = aioredis.from_url(redis_url)
        try:
            return await TransitSweeper(r, settings.keys, "me", settings.queue).sweep()
        finally:
            await r.aclose()

    assert asyncio.run(sweep()) == 4
    assert client.llen(transit) == 0
    assert _priorities(client, settings.queue) == [0, 0]
    assert _priorities(client, priority_list(settings.queue, 6)) == [6, 6]
    assert priority_lists(settings.queue)[6] == priority_list(settings.queue, 6)


def _fleet_sim(tmp_path: Path) -> SimulatorProcess:
    sim = SimulatorProcess("--time-scale", "20")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    return sim


def test_worker_takes_the_higher_priority_job_first(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    n, inflight = 8, 2
    # The low-priority job (5) is queued first: FIFO would serve it first.
    lo = queue_job(settings, "lo", make_prompts(n, seed=7), 5)
    hi = queue_job(settings, "hi", make_prompts(n, seed=8), 0)
    sim = _fleet_sim(tmp_path)
    worker = WorkerProcess("w0", fast_env(settings, sim.url, max_inflight=inflight), tmp_path).start()
    timeline: list[tuple[int, int]] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            h = job_progress(client, settings.keys, "hi")["done"]
            low = job_progress(client, settings.keys, "lo")["done"]
            timeline.append((h, low))
            if h == n and low == n:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"jobs did not finish: {timeline[-1]}\n{worker.tail()}")
    finally:
        worker.terminate()
        sim.kill()
    # Every "hi" prompt was taken before any "lo" one: "lo" rows appear only as "hi" ends.
    first_lo = next(h for h, low in timeline if low > 0)
    assert first_lo >= n - inflight, timeline
    at_hi_done = next(low for h, low in timeline if h == n)
    assert at_hi_done <= inflight, timeline
    for job in (hi, lo):
        check_job(settings, job.name, job.prompts, job.sampling_params).assert_clean()


def test_sigkill_with_priority_messages_in_flight_loses_nothing(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    n = 12
    job = queue_job(settings, "pk", make_prompts(n, seed=9), 4)
    sim = _fleet_sim(tmp_path)
    env = fast_env(settings, sim.url, max_inflight=3)
    first = WorkerProcess("k0", env, tmp_path).start()
    second = None
    try:
        wait_until(lambda: job_progress(client, settings.keys, "pk")["done"] >= 1, 60, what="first rows")
        first.kill()
        second = WorkerProcess("k1", env, tmp_path).start()
        wait_until(lambda: job_progress(client, settings.keys, "pk")["done"] == n, 120, what="job finished")
        # Nothing of the job went to the default list on the way.
        assert client.llen(settings.queue) == 0
    finally:
        first.kill()
        if second is not None:
            second.terminate()
        sim.kill()
    check_job(settings, "pk", job.prompts, job.sampling_params).assert_clean()
