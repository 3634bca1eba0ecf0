"""A command caught on a frozen Sentinel primary is retried on the promoted one (issue 43).

redis-py reopens a failed command's socket to the address it had (``connect_check_health``, not the Sentinel-aware
``connect``): every retry of a command caught on a SIGSTOPped primary went back to it, and the worker's state client
(20 retries) stalled its commits for about two minutes after the Sentinels had promoted a replica. The connections
of thinkfleet/redis_client.py ask the Sentinels on every reconnect.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from testing.sentinel import SentinelHead
from testing.services import RedisServer
from thinkfleet.redis_client import async_client, sync_client

RETRY_ON = [RedisConnectionError, RedisTimeoutError]


def test_a_write_caught_on_a_frozen_primary_lands_on_the_promoted_one(tmp_path: Path) -> None:
    RedisServer(tmp_path / "probe")  # fails (CI) or skips the test when redis-server is missing
    head = SentinelHead(tmp_path / "head").start()
    try:
        asyncio.run(_scenario(head))
    finally:
        head.stop()


async def _scenario(head: SentinelHead) -> None:
    # Given clients that retry long enough to outlast a failover (as the worker's state client does),
    backoff = ExponentialBackoff(cap=2.0, base=0.05)
    sync = sync_client(head.url(), timeout_s=2, retry=Retry(backoff, 20), retry_on_error=RETRY_ON)
    asyn = async_client(
        head.url(), timeout_s=2, max_connections=4, pool_wait_s=10,
        retry=AsyncRetry(backoff, 20), retry_on_error=RETRY_ON,
    )  # fmt: skip
    sync.set("s", 0)
    await asyn.set("a", 0)
    old = head.primary_port()
    assert old is not None
    # When the primary is SIGSTOPped (its sockets stay open, silent),
    frozen = head.process_on(old)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        # Then a write of each client, caught on it, is retried on the primary the Sentinels promote.
        sync.set("s", 1)
        await asyn.set("a", 1)
        new = head.wait_for_new_primary(old)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    primary = head.process_on(new).client()
    assert primary.get("s") == b"1" and primary.get("a") == b"1"
    assert sync.connection_pool.master_address == ("127.0.0.1", new)
    await asyn.aclose()
