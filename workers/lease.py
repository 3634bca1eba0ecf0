"""Leases: a worker's heartbeat, and the visibility of the messages it holds.

Kombu's Redis transport scores each unacknowledged message with its delivery time and redelivers it
once ``visibility_timeout`` (= ``lease_s``) has passed — it never renews that score, so a long
generation would be redelivered while it still runs. Every ``lease_s / 4`` a live worker re-scores
the delivery tags it holds (:func:`thinkfleet.broker.visibility.renew`) and refreshes its heartbeat key.
A SIGKILLed worker stops doing both, so within ``lease_s`` + the restore sweep (``reaper_interval_s``, run
by every live worker's kombu) its prompts are back on the queue, and its claims are recognised as stale
because the heartbeat key has expired.

Trade-off: a worker frozen for longer than ``lease_s`` (e.g. a stopped container) is treated as dead;
its prompts re-run elsewhere and the claim/part protocol in thinkfleet/state/ledger.py keeps the output
exactly-once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.broker import visibility
from thinkfleet.broker.transit import TransitSweeper
from thinkfleet.keys import Keys

log = logging.getLogger(__name__)


class HeldMessages:
    """Delivery tags this process holds; touched from Celery's consumer and pool threads."""

    def __init__(self) -> None:
        self._tags: dict[str, str] = {}  # task id → delivery tag
        self._lock = threading.Lock()

    def add(self, task_id: str, delivery_tag: str) -> None:
        with self._lock:
            self._tags[task_id] = delivery_tag

    def discard(self, task_id: str) -> None:
        with self._lock:
            self._tags.pop(task_id, None)

    def tags(self) -> list[str]:
        with self._lock:
            return list(self._tags.values())

    def __len__(self) -> int:
        return len(self._tags)


class LeaseKeeper:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        worker: str,
        lease_s: float,
        unacked_index_key: str,
        held: HeldMessages,
        info: dict[str, Any],
        sweeper: TransitSweeper | None = None,
    ) -> None:
        self.r = client
        self.keys = keys
        self.worker = worker
        self.lease_s = lease_s
        self.unacked_index_key = unacked_index_key
        self.held = held
        self.info = info
        self.sweeper = sweeper
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-keeper")

    async def beat(self) -> None:
        now = time.time()
        tags = self.held.tags()
        async with self.r.pipeline(transaction=False) as p:
            p.set(self.keys.heartbeat(self.worker), json.dumps({"at": now}), px=int(self.lease_s * 1000))
            p.hset(self.keys.workers, self.worker, json.dumps({**self.info, "seen_at": now}))
            visibility.renew(p, self.unacked_index_key, tags, now)
            await p.execute()

    async def _run(self) -> None:
        interval = max(0.2, self.lease_s / 4)
        while True:
            try:
                await self.beat()
                if self.sweeper is not None:
                    moved = await self.sweeper.sweep()
                    if moved:
                        log.warning("returned %d message(s) stranded in transit to the queue", moved)
            except Exception as exc:
                log.warning("heartbeat failed (will retry in %.1fs): %s", interval, exc)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        try:
            await self.r.delete(self.keys.heartbeat(self.worker))
        except Exception:
            pass
