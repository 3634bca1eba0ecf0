"""Time from Redis: a worker whose host clock runs 45 s ahead restores no live worker's message early.

Visibility scores (kombu's delivery score and restore sweep, the lease keeper's renewals) are Redis ``TIME``
(thinkfleet/broker/clock.py, workers/lease.py). Before, each host scored with its own clock: a host 45 s
ahead computed "older than the 10 s visibility timeout" against a clock 45 s in the future and restored every
live worker's messages at its first sweep.

With real parts: worker B (true clock) holds 6 prompts in flight at a stalled server; worker A runs with its wall
clock 45 s ahead (a preload of testing/sentinel.py) and sweeps every second. While B lives, none of its
messages leaves kombu's unacked set and A receives nothing; A warned at start and ``producer status`` warns
about it. Once B is SIGKILLed, its messages are restored no earlier than one visibility timeout after B's
last renewal (Redis time), and A stores every prompt exactly once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, post_json, producer_cli, submit_ids
from testing.record import check_job, record_result
from testing.sentinel import CC, clock_shift_library
from thinkfleet.broker.keys import KombuKeys

#: The worker's wall clock is shifted by testing/sentinel.py's preload (CLOCK_REALTIME only, the kernel called
#: directly), preloaded into the worker itself. Not libfaketime: a worker preloading it died with SIGSEGV at start in
#: one CI run (its initialization calls back into an allocator that reads the clock: libfaketime #130, which keeps
#: it out of redis-server too).
#: The visibility timeout (= the lease): B renews every LEASE_S / 4.
LEASE_S = 10
AHEAD_S = 45
PROMPTS = 6

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler for the clock-shift preload (apt-get install gcc)")


def _redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_a_worker_45_s_ahead_restores_no_live_message_early_and_status_warns(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    kombu = KombuKeys(settings.key_prefix)
    sim_b, sim_a = SimulatorProcess("--time-scale", "400"), SimulatorProcess("--time-scale", "400")
    sim_b.log_path, sim_a.log_path = str(tmp_path / "sim-b.log"), str(tmp_path / "sim-a.log")
    sim_b.start()
    sim_a.start()
    b = WorkerProcess("b-true", fast_env(settings, sim_b.url, lease_s=LEASE_S, max_inflight=PROMPTS), tmp_path)
    env_a = fast_env(settings, sim_a.url, lease_s=LEASE_S, max_inflight=PROMPTS)
    env_a.update(LD_PRELOAD=str(clock_shift_library(tmp_path / "clock")), THINKFLEET_CLOCK_OFFSET_S=str(AHEAD_S))
    a = WorkerProcess("a-ahead", env_a, tmp_path)
    started = time.monotonic()
    try:
        # Given B holding every prompt of the job in flight at its stalled server.
        b.start().wait_consuming().wait_ready(client, keys)
        post_json(f"{sim_b.url}/control/stall", {"seconds": 300})
        job = submit_ids(settings, "skew", make_prompts(PROMPTS))
        wait_until(
            lambda: len(in_flight(client, keys, "skew", "b-true")) == PROMPTS and client.hlen(kombu.unacked) == PROMPTS,
            60,
            what="B holds every prompt",
        )
        tags = set(client.hkeys(kombu.unacked))
        # When A starts 45 s ahead and sweeps for expired messages every second, for three of its heartbeats.
        a.start().wait_consuming().wait_ready(client, keys)
        beats: set[float] = set()
        deadline = time.monotonic() + 120
        while len(beats) < 4:
            assert time.monotonic() < deadline, "A stopped beating"
            # Then none of B's messages is restored while B lives, and A receives none.
            assert tags <= set(client.zrange(kombu.unacked_index, 0, -1)), "a live worker's message was restored"
            assert client.llen(settings.queue) == 0
            raw = client.get(keys.heartbeat("a-ahead"))
            if raw:
                beats.add(float(json.loads(raw)["at"]))
            time.sleep(0.1)
        assert " received" not in a.log_path.read_text(errors="replace")
        assert job_progress(client, keys, "skew")["done"] == 0
        # And A said so at start, and producer status warns about it.
        log_a = a.log_path.read_text(errors="replace")
        assert f"this host's clock is {AHEAD_S}." in log_a and "ahead of Redis's" in log_a, log_a[-3000:]
        status = producer_cli(settings, "status", "skew", "--json", in_process=True)
        warnings = {w["worker"]: w for w in json.loads(status.stdout)["clock_warnings"]}
        assert set(warnings) == {"a-ahead"}, warnings
        assert AHEAD_S - 5 < warnings["a-ahead"]["offset_s"] < AHEAD_S + 5
        text = producer_cli(settings, "status", "skew", in_process=True).stdout
        assert "a-ahead" in text and "ahead of Redis" in " ".join(text.split()), text

        # When B dies, its messages come back no earlier than one visibility timeout after its last renewal.
        renewed = min(score for _tag, score in client.zrange(kombu.unacked_index, 0, -1, withscores=True))
        b.kill()
        wait_until(lambda: not tags <= set(client.zrange(kombu.unacked_index, 0, -1)), 120, 0.05, what="restored")
        restored = _redis_now(client)
        assert restored >= renewed + LEASE_S - 0.5, f"restored {restored - renewed:.1f} s after B's last renewal"
        wait_until(lambda: job_progress(client, keys, "skew")["done"] == PROMPTS, 180, what="A stored them all")
        # And A's commits are on the job's timeline at Redis's time, not 45 s in its future (status's rates).
        scores = [score for _m, score in client.zrange(keys.timeline("skew"), 0, -1, withscores=True)]
        assert scores and max(scores) <= _redis_now(client) + 1, (max(scores), _redis_now(client))
    finally:
        post_json(f"{sim_b.url}/control/stall", {"seconds": 0})
        b.kill()
        a.terminate()
        sim_a.kill()
        sim_b.kill()
    outcome = check_job(settings, "skew", job.prompts, job.sampling_params)
    record_result(
        "clock skew: one worker 45 s ahead (faketime)",
        outcome,
        f"one worker's host clock {AHEAD_S} s ahead (a clock-shift preload) while another held {PROMPTS} prompts in "
        "flight; "
        "then that one SIGKILLed",
        [restored - renewed],
        time.monotonic() - started,
        workers=2,
        notes="visibility on Redis TIME: nothing restored while its holder lived; restored one lease after "
        "its last renewal",
    )
    outcome.assert_clean()


def test_a_submit_locks_age_is_counted_by_redis_not_by_the_stamp_of_a_skewed_host(
    redis_url: str, tmp_path: Path
) -> None:
    from producer.state import BREAK_LOCK_MIN_AGE_S, LOCK_TTL_S, StateError, break_lock

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    key = settings.keys.submit_lock("skewed")
    # Given a lock taken just now elsewhere by a host whose clock runs an hour behind (its stamp looks old).
    client.set(key, f"other@{time.time() - 3600:.0f}@elsewhere@1", ex=LOCK_TTL_S)
    # Then --break-lock refuses it: Redis (its TTL) says it is seconds old.
    with pytest.raises(StateError, match="cannot be checked"):
        break_lock(client, settings, "skewed")
    assert client.exists(key)
    # And one Redis has held for longer than the minimum is broken, whatever a fast clock stamped on it.
    client.set(key, f"other@{time.time() + 3600:.0f}@elsewhere@1", ex=LOCK_TTL_S - BREAK_LOCK_MIN_AGE_S - 2)
    assert "elsewhere" in (break_lock(client, settings, "skewed") or "")
    assert not client.exists(key)
