"""The lease keeper tells a lapse it lived through (workers/lease.py ``on_lapse``): a beat written more than a lease
after the last one — a pause, a partition — so the worker takes back the deaths charged for its claims."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from workers.lease import HeldMessages, LeaseKeeper


def test_a_beat_more_than_a_lease_after_the_last_reports_the_lapse_once(redis_url: str) -> None:
    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        keys = Keys(f"lease{uuid.uuid4().hex[:6]}")
        lapses: list[float] = []
        keeper = LeaseKeeper(client, keys, "w", 2.0, keys.held("w"), HeldMessages(), {}, on_lapse=lapses.append)
        try:
            assert await keeper.acquire() is None
            assert await keeper.beat() and await keeper.beat()
            assert lapses == [], "beats within a lease are no lapse"
            keeper._beaten_at -= 5.0  # as if the process had been stopped for 5 s (SIGSTOP)
            assert await keeper.beat()
            assert len(lapses) == 1 and lapses[0] >= 5.0
            assert await keeper.beat() and len(lapses) == 1
        finally:
            await keeper.stop()
            await client.aclose()

    asyncio.run(scenario())
