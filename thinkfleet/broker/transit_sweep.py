"""Transit lists a worker no longer serves, back on the queue: :class:`TransitSweeper`, run by every live worker's
lease keeper (workers/lease.py).

A transit list (thinkfleet/broker/transit.py) holds what its worker popped and kombu has not yet recorded as unacked.
A sweep puts back on the queue — each message onto the list of its own priority, at its consuming end — what a dead
worker (no heartbeat) left in its transit list, and what its own list kept for two sweeps in a row (a reply lost with
its connection, or a popped message waiting for a free slot: another worker may serve it now). Both may hand a
message out twice; the claims in thinkfleet/state/ledger.py make a second delivery cost nothing.

For one lease after Redis's clock jumped forward (a failover to a replica whose clock is ahead, an outage:
thinkfleet/broker/visibility.py) a missing heartbeat proves nothing — the jump expired every live worker's too,
until its next beat — so a sweep then leaves other workers' transit lists alone; a dead worker's list goes back
one lease later.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from thinkfleet.broker.keys import KombuKeys, priority_lists
from thinkfleet.broker.visibility import heartbeats_trusted_async
from thinkfleet.keys import Keys

# Lua: the priority step a kombu message names (``"priority": N`` in its properties, at the end of the JSON;
# a JSON string can hold no unescaped quote, so only a key matches), capped at the last list in KEYS.
_PRIORITY_OF = """
local function priority_of(m, top)
  local p, init = nil, math.max(1, #m - 1024)
  for _ = 1, 2 do
    while true do
      local _, e, d = string.find(m, '"priority": (%d+)', init)
      if not e then break end
      p, init = tonumber(d), e + 1
    end
    if p then break end
    init = 1
  end
  p = p or 0
  if p > top then p = top end
  return p
end
"""

# Move a transit list's messages back to the consuming end of the queue list of their own priority: all of
# them (no ARGV), or only those named in ARGV that are still there. KEYS: transit, then the queue's
# priority lists from step 0 (the queue itself) up. Only commands the worker's ACL user has (no RPOP).
_RECLAIM = (
    _PRIORITY_OF
    + """
local top, n = #KEYS - 2, 0
if #ARGV == 0 then
  while true do
    local m = redis.call('LRANGE', KEYS[1], -1, -1)[1]
    if not m then return n end
    redis.call('LMOVE', KEYS[1], KEYS[2 + priority_of(m, top)], 'RIGHT', 'RIGHT')
    n = n + 1
  end
end
for i = 1, #ARGV do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2 + priority_of(ARGV[i], top)], ARGV[i])
    n = n + 1
  end
end
return n
"""
)


class TransitSweeper:
    """Returns stranded transit messages to the queue; one per worker process, run by its lease keeper."""

    def __init__(self, client: aioredis.Redis, keys: Keys, worker: str, queue: str) -> None:
        self.r = client
        self.keys = keys
        self.worker = worker
        self.queue = queue
        self._reclaim = client.register_script(_RECLAIM)
        #: Where a reclaimed message goes: the list of its own ``properties.priority``.
        self._lists = priority_lists(queue)
        self._seen: set[bytes] = set()  # own transit messages at the previous sweep
        #: Whose visibility clock tells whether a missing heartbeat means a dead worker (visibility.py).
        self._unacked_index = KombuKeys(keys.prefix).unacked_index

    async def sweep(self) -> int:
        """One pass; returns how many messages went back to the queue."""
        moved = 0
        prefix = self.keys.transit("")
        trusted: bool | None = None  # asked once per sweep, when another worker's list is found
        async for raw_key in self.r.scan_iter(match=f"{prefix}*", count=1000):
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            owner = key[len(prefix) :]
            if owner == self.worker:
                items = set(await self.r.lrange(key, 0, -1))
                stale, self._seen = items & self._seen, items
                if stale:
                    moved += int(await self._reclaim(keys=[key, *self._lists], args=sorted(stale)))
            elif not await self.r.exists(self.keys.heartbeat(owner)):
                if trusted is None:
                    trusted = await heartbeats_trusted_async(self.r, self._unacked_index)
                if trusted:
                    moved += int(await self._reclaim(keys=[key, *self._lists], args=[]))
        return moved
