"""A finalize's durability is asked on its own connection (issue 34): ``WAIT n`` counts only the writes made on the
connection it runs on, so the ledger sends finalize.lua and ``WAIT`` (and ``WAITAOF``, where the server has it) in
one non-transactional pipeline and checks the counts.

Against a real primary and replica: with the replica receiving, the finalize is confirmed; with the replica frozen
(SIGSTOP), the count comes back short, is logged and counted, and the finalize stands (the row is done; a failover
that lost it is recovered by the finalize marks, tested in test_reliability_failover.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import redis.asyncio as aioredis

from testing.services import RedisServer
from thinkfleet.keys import Keys
from thinkfleet.state.ledger import FinalRow, Ledger

JOB = "j"


def test_a_finalize_waits_for_its_replica_on_its_own_connection_and_counts_a_short_wait(tmp_path: Path) -> None:
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(tmp_path / "replica", extra=("--replicaof", "127.0.0.1", str(primary.port))).start()
    keys = Keys(f"dur{uuid.uuid4().hex[:6]}")
    try:
        sync = primary.client()

        async def scenario() -> None:
            client = aioredis.from_url(primary.url())
            await client.set(keys.heartbeat("w"), "1")
            # A generous wait while the replica receives (WAIT returns as soon as it acknowledges: a loaded box must
            # not make a receiving replica look short), a short one once it is frozen (below).
            ledger = Ledger(client, keys, "w", waitaof_ms=30_000, wait_replicas=1)
            for _ in range(300):  # the replica has connected and synced (online, not still loading the RDB)
                slave = (await client.info("replication")).get("slave0") or {}
                if slave.get("state") == "online":
                    break
                await asyncio.sleep(0.1)
            # Given a receiving replica, a finalize is confirmed.
            assert (await ledger.claim(JOB, "p1")).state == "new"
            finalized = await ledger.finalize(JOB, "ds", [FinalRow("p1", 5, True, False)], 100, 0.95)
            assert finalized.new == 1
            assert sum(ledger.short_waits.values()) == 0, ledger.short_waits
            # When the replica freezes, the next finalize's WAIT comes back short: counted, and the row stands.
            os.kill(replica.pid, signal.SIGSTOP)
            ledger.waitaof_ms = 300
            try:
                assert (await ledger.claim(JOB, "p2")).state == "new"
                finalized = await ledger.finalize(JOB, "ds", [FinalRow("p2", 5, True, False)], 100, 0.95)
                assert finalized.new == 1
                assert ledger.short_waits["replicas"] == 1, ledger.short_waits
                assert await client.sismember(keys.done(JOB), "p2")
            finally:
                os.kill(replica.pid, signal.SIGCONT)
            # WAITAOF: Redis 7.0 has none (AOF off here too): noted once, never counted as short.
            assert "aof" not in ledger.short_waits
            await client.aclose()

        asyncio.run(scenario())
        assert sync.sismember(keys.done(JOB), "p1")
    finally:
        replica.stop(kill=True)
        primary.stop()
