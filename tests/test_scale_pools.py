"""Redis pools sized to the work: a worker holding its whole in-flight bound plus its commit headroom in Redis
commands at once gets a connection for each, at the default bound and above redis-py's default cap of 100."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import MaxConnectionsError

from testing.fleet import wait_until
from thinkfleet.settings import REDIS_SPARE_CONNECTIONS, Settings
from workers.runtime import worker_redis


async def _hold_connections(client: aioredis.Redis, n: int, key: str, redis_url: str) -> list[object]:
    """``n`` commands that each hold a connection until released: BLPOPs on an empty list, all blocked in Redis
    at once (INFO blocked_clients says so), then released by pushing ``n`` values."""
    probe = redis.Redis.from_url(redis_url)
    blocked0 = int(probe.info("clients")["blocked_clients"])
    calls = [asyncio.create_task(client.blpop([key], timeout=60)) for _ in range(n)]
    try:
        await asyncio.to_thread(
            wait_until,
            lambda: any(c.done() for c in calls) or int(probe.info("clients")["blocked_clients"]) - blocked0 >= n,
            60,
            0.05,
            f"{n} commands blocked at once",
        )
        probe.lpush(key, *range(n))
        return await asyncio.gather(*calls, return_exceptions=True)
    finally:
        for c in calls:
            c.cancel()
        probe.close()


def test_the_default_pool_refuses_the_101st_connection(redis_url: str) -> None:
    # Given redis-py's own pool (what workers/runtime.py used to build): 100 connections at most.
    async def scenario() -> list[object]:
        client = aioredis.from_url(redis_url)
        try:
            return await _hold_connections(client, 150, "q:default", redis_url)
        finally:
            await client.aclose()

    results = asyncio.run(scenario())
    assert any(isinstance(r, MaxConnectionsError) for r in results), "redis-py's default pool capped at 100"


@pytest.mark.parametrize("max_inflight", [None, 150, 300])
def test_a_worker_pool_serves_its_whole_in_flight_bound_at_once(redis_url: str, max_inflight: int | None) -> None:
    settings = Settings(redis_url=redis_url) if max_inflight is None else Settings(
        redis_url=redis_url, max_inflight=max_inflight
    )  # fmt: skip
    busy = settings.max_inflight + settings.commit_headroom  # every worker thread in a Redis command at once
    assert busy > 100
    assert settings.worker_redis_connections == busy + REDIS_SPARE_CONNECTIONS

    async def scenario() -> list[object]:
        client = worker_redis(settings)
        try:
            return await _hold_connections(client, busy, f"q:{busy}", redis_url)
        finally:
            await client.aclose()

    results = asyncio.run(scenario())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert len(results) == busy
