"""The long soak (``-m slow``; not in CI): every fault of the suite in one job on a small fleet, the
fault mix with the full 30 s outage, and a Redis outage longer than the workers' retries.

Run: ``.venv/bin/pytest tests/test_reliability_soak.py -m slow`` (≈ 5 min on 2 cores), or regenerate
RELIABILITY.md with ``.venv/bin/python -m bench.reliability_report --run --slow``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import (
    RecoveryWatch,
    WorkerProcess,
    dead_letters,
    in_flight,
    job_progress,
    wait_until,
)
from testing.harness import fast_env, isolated_settings, make_prompts, post_json, republish, submit_ids
from testing.record import check_job, record_result
from testing.services import RedisServer
from tests.test_reliability_servers import FAULT_MIX, run_fault_mix
from workers.runtime import REDIS_RETRIES

pytestmark = pytest.mark.slow

SOAK_PROMPTS = 2000


def _done(client: redis.Redis, keys, job: str) -> int:
    try:
        return job_progress(client, keys, job)["done"]
    except redis.RedisError:
        return -1


def test_soak_every_fault_in_one_job(tmp_path: Path) -> None:
    # Given two "hosts" (a faulty simulator each, 5 % 503 / 1 % drop / 0.5 % hang) with two workers each,
    # a Redis with AOF, and a 2,000-prompt job.
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    sims = []
    for i, seed in enumerate((21, 22)):
        sim = SimulatorProcess("--time-scale", "60", *FAULT_MIX, "--fault-seed", str(seed))
        sim.log_path = str(tmp_path / f"sim-{i}.log")
        sims.append(sim.start())
    workers = [
        WorkerProcess(f"h{i // 2}w{i % 2}", fast_env(settings, sims[i // 2].url, max_inflight=8), tmp_path)
        for i in range(4)
    ]
    started = time.monotonic()
    recoveries: dict[str, RecoveryWatch] = {}
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(client, keys)
        job = submit_ids(settings, "soak", make_prompts(SOAK_PROMPTS, seed=3))

        def at(share: float, label: str, fault: Callable[[], None]) -> None:
            wait_until(lambda: _done(client, keys, "soak") >= share * SOAK_PROMPTS, 600, what=label)
            wait_until(lambda: in_flight(client, keys, "soak"), 60, what="work in flight")
            recoveries[label] = RecoveryWatch(server.url(), keys, "soak", label).start()
            fault()

        def restart(w: WorkerProcess, kill: bool) -> Callable[[], None]:
            def run() -> None:
                w.kill() if kill else w.terminate()
                w.start().wait_ready(client, keys)

            return run

        def redis_restart() -> None:
            server.stop(kill=True)
            time.sleep(2.0)
            server.start()

        def sim_restart() -> None:
            sims[1].kill()
            time.sleep(2.0)
            sims[1].start()

        def duplicates() -> None:
            republish(job, sorted(in_flight(client, keys, "soak"))[:10])

        # When, during the job, …
        at(0.10, "SIGKILL worker h0w0", restart(workers[0], kill=True))
        outage = {"duration_s": 30}
        at(0.20, "30 s outage of host 0's server", lambda: post_json(f"{sims[0].url}/control/outage", outage))
        at(0.35, "SIGKILL worker h1w0", restart(workers[2], kill=True))
        at(0.45, "Redis SIGKILL + AOF restart", redis_restart)
        at(0.55, "SIGKILL host 1's server + restart", sim_restart)
        at(0.65, "SIGTERM worker h0w1 (preemption)", restart(workers[1], kill=False))
        at(0.75, "SIGKILL worker h0w0 again", restart(workers[0], kill=True))
        at(0.85, "duplicate messages of 10 running prompts", duplicates)
        wait_until(lambda: _done(client, keys, "soak") == SOAK_PROMPTS, 900, what="every row")
    finally:
        for w in workers:
            w.terminate()
        for sim in sims:
            sim.kill()
    # Then every prompt is stored exactly once, byte-exact, and nothing transient was dead-lettered.
    try:
        outcome = check_job(settings, "soak", job.prompts, job.sampling_params)
        faults = "fault mix (5 % 503, 1 % drop, 0.5 % hang) on both servers; " + "; ".join(recoveries)
        record_result(
            "soak: all faults in one job (2 hosts × 2 workers, fault mix on both servers)",
            outcome,
            faults,
            [w.stop() for w in recoveries.values()],
            time.monotonic() - started,
            workers=4,
            ci=False,
            notes="recovery per fault, in the order listed",
        )
        outcome.assert_clean()
        assert dead_letters(client, keys, "soak") == {}
    finally:
        server.stop()


def test_soak_fault_mix_with_the_full_30s_outage(redis_url: str, tmp_path: Path) -> None:
    run_fault_mix(redis_url, tmp_path, prompts=400, outage_s=30.0, ci=False)


def test_redis_away_longer_than_the_worker_retries_hands_work_back(tmp_path: Path) -> None:
    # Given a job in progress and a Redis (AOF) that will stay down past the workers' command retries.
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    down_s = 40.0
    assert down_s > sum(min(2.0, 0.05 * 2**i) for i in range(REDIS_RETRIES)), "longer than the retries"
    sim = SimulatorProcess("--time-scale", "20")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    started = time.monotonic()
    workers = [WorkerProcess(f"w{i}", fast_env(settings, sim.url, max_inflight=6), tmp_path) for i in (1, 2)]
    try:
        for w in workers:
            w.start().wait_ready(client, keys)
        job = submit_ids(settings, "redis-away", make_prompts(60))
        wait_until(lambda: _done(client, keys, "redis-away") >= 15, 120, what="15 rows")
        wait_until(lambda: in_flight(client, keys, "redis-away"), 30, what="work in flight")
        watch = RecoveryWatch(server.url(), keys, "redis-away", "redis-away").start()
        server.stop(kill=True)
        time.sleep(down_s)
        server.start()
        wait_until(lambda: _done(client, keys, "redis-away") == 60, 300, what="60 rows")
    finally:
        for w in workers:
            w.terminate()
        sim.kill()
    try:
        outcome = check_job(settings, "redis-away", job.prompts, job.sampling_params)
        logs = "".join(w.log_path.read_text(errors="replace") for w in workers)
        record_result(
            f"Redis down {down_s:.0f} s (past the workers' command retries)",
            outcome,
            f"Redis SIGKILL, restarted from AOF after {down_s:.0f} s",
            [watch.stop()],
            time.monotonic() - started,
            workers=2,
            ci=False,
            notes="in-flight prompts handed back, or their rows kept in memory and committed once Redis was back; "
            "nothing acked while Redis was away",
        )
        outcome.assert_clean()
        # What was in flight either went back (a claim or a read failed) or finished generating and waited, rows
        # in memory, for its commit (mark_part/finalize need Redis) — which of the two depends on timing.
        handed_back = "handing it back" in logs or "Redis unreachable while handling" in logs
        committed_late = "rows kept in memory, retrying" in logs and "succeeded after" in logs
        assert handed_back or committed_late, "Redis's absence went unnoticed by the workers"
    finally:
        server.stop()
