"""Fast, all-or-nothing publishing of prompt tasks.

Messages are encoded by :class:`thinkfleet.broker.envelope.Envelope` (Celery's own message, captured once
and filled in per prompt) and ``LPUSH``-ed many per command into a *staging* list; the commit moves the whole
list onto the queue (the job's priority list) in one Lua call, so a submit that fails half-way leaves nothing
on the queue (the staging list expires). What is already queued or running is read by
:mod:`thinkfleet.state.invariant` (through :mod:`thinkfleet.broker.queues`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import redis

from thinkfleet.broker.keys import priority_list, priority_step
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings

#: Values per LPUSH and bytes per pipeline round trip when staging.
LPUSH_VALUES = 256
PIPELINE_BYTES = 4 << 20
#: A staging list outlives a crashed submit by this long.
STAGING_TTL_S = 24 * 3600


def job_priority(client: redis.Redis, settings: Settings, job: str) -> int:
    """The job record's priority as a step (0 when there is no record)."""
    from thinkfleet.state.job import JobRecord

    record = JobRecord.load(client, settings.keys, job)
    return priority_step(record.priority if record else 0)


# Move a staged list onto the queue in order, atomically. RENAME when the queue is empty is O(1) and
# wakes blocked BRPOP consumers like a push does; PERSIST drops the staging TTL it carries over.
_COMMIT = """
local n = redis.call('LLEN', KEYS[1])
if n == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('PERSIST', KEYS[2])
  return n
end
for i = 1, n do redis.call('RPOPLPUSH', KEYS[1], KEYS[2]) end
return n
"""


# -- staging and commit -------------------------------------------------------------------------------------
class Stager:
    """Messages pushed to a private list as they are ready, moved onto the queue only by :meth:`commit`."""

    def __init__(self, client: redis.Redis, keys: Keys, job: str, queue: str, priority: int = 0) -> None:
        self.client = client
        self.key = keys.staging(job, uuid.uuid4().hex[:12])
        #: The job's priority list (``queue`` itself for priority 0); its messages say the same priority.
        self.queue = priority_list(queue, priority)
        self.count = 0
        self.bytes = 0
        self._pipe = client.pipeline(transaction=False)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._commit = client.register_script(_COMMIT)

    def push(self, messages: Iterable[bytes]) -> None:
        for m in messages:
            self._pending.append(m)
            self._pending_bytes += len(m)
            if len(self._pending) >= LPUSH_VALUES:
                self._queue_lpush()
            if self._pending_bytes >= PIPELINE_BYTES:
                self.flush()

    def _queue_lpush(self) -> None:
        if self._pending:
            # LPUSH k a b c leaves a rightmost: kombu's BRPOP then serves them in push order.
            self._pipe.lpush(self.key, *self._pending)
            self.count += len(self._pending)
            self._pending = []

    def flush(self) -> None:
        self._queue_lpush()
        if len(self._pipe):
            self._pipe.expire(self.key, STAGING_TTL_S)
            self._pipe.execute()
        self.bytes += self._pending_bytes
        self._pending_bytes = 0

    def commit(self, pipe: redis.client.Pipeline | None = None) -> Any:
        """Move everything staged onto the queue (inside ``pipe``'s MULTI when given)."""
        self.flush()
        return self._commit(keys=[self.key, self.queue], client=pipe or self.client)

    def discard(self) -> None:
        self._pending = []
        self._pipe.reset()
        self.client.delete(self.key)
