"""The visibility clock's rule (thinkfleet/broker/visibility.py), on a real redis-server: a jump of Redis's clock
between two visibility steps is not time that passed.

A jump is made here by moving the clock hash's ``at`` (the Redis time of the last visibility step) instead of
Redis's clock: ``at`` 120 s in the past is what a step finds when the primary it runs on is a promoted replica
whose clock runs 120 s ahead of the old one (tests/test_reliability_failover_clock.py runs that with real
processes). Scores are then placed relative to ``at``, as the old primary wrote them.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from testing.harness import isolated_settings
from thinkfleet.broker.transit_sweep import TransitSweeper
from thinkfleet.broker.visibility import (
    SCORE_DELIVERY,
    clock_key,
    heartbeats_trusted,
    jump_margin_s,
    unacked_index_key,
    visibility_now,
)

LEASE_S = 20.0
INDEX = "tfvis:kombu:unacked_index"
CLOCK = clock_key(INDEX)


def _now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def _last_step_at(client: redis.Redis, at: float) -> None:
    client.delete(INDEX, CLOCK)
    client.hset(CLOCK, "at", repr(at))


def _expired(client: redis.Redis, now: float) -> set[str]:
    """What kombu's restore sweep would restore now (thinkfleet.broker.transit.QoS.restore_visible)."""
    return {t.decode() for t in client.zrangebyscore(INDEX, "-inf", now - LEASE_S)}


def test_a_jump_forward_of_120_s_restores_no_live_delivery_and_still_restores_a_dead_one(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given the last visibility step 120 s ago on Redis's clock (the clock jumped forward since), a live delivery
    # renewed 1 s before it and a dead worker's delivery already past its lease then
    at = _now(redis_client) - 120
    _last_step_at(redis_client, at)
    redis_client.zadd(INDEX, {"live": at - 1, "dead": at - LEASE_S - 1})
    # When the next visibility step runs (a restore sweep, a renewal or a delivery's record)
    now = visibility_now(redis_client, INDEX, LEASE_S)
    # Then the jump beyond half a lease is not counted: the live delivery is 1 s + half a lease old, not 121 s
    assert _expired(redis_client, now) == {"dead"}
    live_age = now - float(redis_client.zscore(INDEX, "live"))
    assert abs(live_age - (1 + jump_margin_s(LEASE_S))) < 1, live_age
    # and the jump is recorded, with a lease during which a missing heartbeat proves nothing (the jump expired
    # the live workers' heartbeats too)
    assert int(redis_client.hget(CLOCK, "jumps")) == 1
    assert not heartbeats_trusted(redis_client, INDEX)
    assert float(redis_client.hget(CLOCK, "at")) >= now - 1
    # and the step that re-based says so in its log, for the operator
    assert "2 delivery score(s) moved by +" in caplog.text


def test_an_ordinary_step_moves_no_score(redis_client: redis.Redis) -> None:
    # Given the last step a quarter of a lease ago (a heartbeat's interval) and a delivery renewed then
    at = _now(redis_client) - LEASE_S / 4
    _last_step_at(redis_client, at)
    redis_client.zadd(INDEX, {"t": at})
    # When the next step runs, then the score stays and no jump is recorded
    visibility_now(redis_client, INDEX, LEASE_S)
    assert float(redis_client.zscore(INDEX, "t")) == at
    assert redis_client.hget(CLOCK, "jumps") is None
    assert heartbeats_trusted(redis_client, INDEX)


def test_steps_later_than_the_margin_still_count_half_a_lease_each(redis_client: redis.Redis) -> None:
    # Given steps further apart than half a lease (a fleet stalled past it): each step counts half a lease, so a
    # dead worker's delivery still expires — after at most twice as many steps — and nothing waits for ever
    at = _now(redis_client) - 0.8 * LEASE_S
    _last_step_at(redis_client, at)
    redis_client.zadd(INDEX, {"dead": at - 0.6 * LEASE_S})
    now = visibility_now(redis_client, INDEX, LEASE_S)
    age = now - float(redis_client.zscore(INDEX, "dead"))
    assert abs(age - 1.1 * LEASE_S) < 1, age
    assert _expired(redis_client, now) == {"dead"}


def test_a_jump_back_of_300_s_restores_a_dead_delivery_on_time(redis_client: redis.Redis) -> None:
    # Given the last step 300 s ahead of Redis's clock now (a replica whose clock is behind was promoted), a live
    # delivery renewed 1 s before it and a dead one past its lease then
    at = _now(redis_client) + 300
    _last_step_at(redis_client, at)
    redis_client.zadd(INDEX, {"live": at - 1, "dead": at - LEASE_S - 1})
    # When the next step runs, then both keep the age they had (the dead one is not held for 300 s more)
    now = visibility_now(redis_client, INDEX, LEASE_S)
    assert _expired(redis_client, now) == {"dead"}
    assert abs(now - float(redis_client.zscore(INDEX, "live")) - 1) < 1
    assert heartbeats_trusted(redis_client, INDEX)  # heartbeats outlive a jump back: nothing to distrust


def test_a_delivery_recorded_first_after_a_jump_re_bases_the_others_before_its_own_score(
    redis_client: redis.Redis,
) -> None:
    # Given a jump forward of 120 s since the last step and another worker's live delivery
    at = _now(redis_client) - 120
    _last_step_at(redis_client, at)
    redis_client.zadd(INDEX, {"other": at - 1})
    # When a delivery is recorded (QoS.append's score) before any sweep or renewal on the new primary
    redis_client.eval(SCORE_DELIVERY, 2, INDEX, CLOCK, "new", LEASE_S)
    now = _now(redis_client)
    # Then its own score is now, and the other delivery was re-based, not left 121 s old
    assert abs(float(redis_client.zscore(INDEX, "new")) - now) < 1
    assert _expired(redis_client, now) == set()


def test_heartbeats_are_trusted_again_a_lease_after_the_jump(redis_client: redis.Redis) -> None:
    _last_step_at(redis_client, _now(redis_client))
    redis_client.hset(CLOCK, "heartbeats_from", repr(_now(redis_client) - 0.1))
    assert heartbeats_trusted(redis_client, INDEX)
    redis_client.hset(CLOCK, "heartbeats_from", repr(_now(redis_client) + LEASE_S))
    assert not heartbeats_trusted(redis_client, INDEX)


def test_a_transit_sweep_leaves_a_missing_heartbeat_alone_for_a_lease_after_a_jump(redis_url: str) -> None:
    # Given another worker's transit list with no heartbeat beside it (after a jump forward: expired by the jump,
    # not by the worker's death, until its next beat)
    settings = isolated_settings(redis_url, "/unused")
    keys, client = settings.keys, redis.Redis.from_url(redis_url)
    index = unacked_index_key(settings.key_prefix)
    client.rpush(keys.transit("other"), b'{"properties": {"priority": 0}}')
    client.hset(clock_key(index), "heartbeats_from", repr(_now(client) + LEASE_S))

    async def sweep() -> int:
        r = aioredis.from_url(redis_url)
        try:
            return await TransitSweeper(r, keys, "me", settings.queue).sweep()
        finally:
            await r.aclose()

    # When a live worker sweeps within that lease, then the list stays where it is
    assert asyncio.run(sweep()) == 0
    assert client.llen(keys.transit("other")) == 1
    # and once the lease after the jump has passed, a missing heartbeat is a dead worker's again: it goes back
    client.hset(clock_key(index), "heartbeats_from", repr(_now(client) - 0.1))
    assert asyncio.run(sweep()) == 1
    assert client.llen(keys.transit("other")) == 0
