"""Visibility of delivered messages: what keeps a long generation from being redelivered while it runs.

kombu's Redis transport scores each unacknowledged message with its delivery time in ``unacked_index`` and
restores it to the queue once ``visibility_timeout`` (= ``lease_s``) has passed; it never renews that score.
A live worker's lease keeper (workers/lease.py) re-scores the delivery tags it holds at every heartbeat.
Every score — kombu's at delivery and in its restore sweep (``thinkfleet.broker.transit.QoS``), the lease
keeper's — is Redis ``TIME``, never a host's clock: a host whose clock runs ahead would otherwise restore
live workers' messages early, and one behind would renew its own into the future.

**A jump of Redis's clock is not time that passed.** Redis's clock is one machine's: after a failover it is the
promoted replica's, which may run minutes ahead of (or behind) the old primary's, and after an outage it has
moved on while no worker could renew anything. Left alone, a jump forward of a lease or more makes every
delivery of the fleet look expired at once: the first restore sweep on the new primary puts all of them back on
the queue, ahead of the live workers' next renewal (and the jump has expired their heartbeats too, so the copies
take the running claims over and re-run them). So every step that writes or compares a visibility score runs
:data:`VISIBILITY_NOW` first, in the same Lua call: the clock hash (:func:`clock_key`) remembers the Redis time
of the last such step (``at``; there is one at least every lease/4 while a worker lives: its heartbeat). When
``TIME`` is more than :func:`jump_margin_s` (half a lease) past ``at``, the excess is a jump: every score in
``unacked_index`` moves forward by it, so a delivery ages by at most half a lease across it; a jump back of more
than that moves every score back by the whole jump, so a delivery ages by nothing (else a dead worker's messages
would wait out the jump). A gap with no jump (an outage: nobody could renew) counts the same way. The rule and
its bound (a dead worker's messages come back later by at most the real time between steps that were further
apart than that) are in docs/reliability.md.
"""

from __future__ import annotations

import logging
from typing import Any

from thinkfleet.broker.keys import KombuKeys

log = logging.getLogger(__name__)

#: The share of the lease that Redis's clock may move between two visibility steps before the rest counts as a
#: jump (not time that passed). Below 3/4: a live delivery is renewed at least every lease/4, so it is at most
#: lease/4 + lease/2 old after a jump, never expired by it; above the heartbeat's lease/4, so a fleet's ordinary
#: steps are never taken for jumps (and when they are — a host stalled past it — the clock still advances half a
#: lease per step: nothing waits for ever).
JUMP_FRACTION = 0.5

#: Lua: ``visibility_now(index, clock, lease)`` — Redis ``TIME`` now (seconds), after re-basing every score of the
#: ``index`` ZSET across a jump of the clock since the last visibility step (see the module's docstring); then the
#: shift applied (0: none) and how many scores it moved (a caller that takes one value gets ``now``). The clock
#: HASH ``clock`` holds ``at`` (the last step's time), ``jumps`` (how many were absorbed), ``shifted_s`` (the last
#: re-base), ``jumped_at`` and ``heartbeats_from`` (until then a missing heartbeat proves nothing: the jump expired
#: the live ones too; see :func:`heartbeats_trusted`).
VISIBILITY_NOW = f"""
local function visibility_now(index, clock, lease)
  local entries = {{}}
  local shift = 0
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local last = tonumber(redis.call('HGET', clock, 'at'))
  local margin = lease * {JUMP_FRACTION}
  if last then
    if now - last > margin then
      shift = now - last - margin
    elseif last - now > margin then
      shift = now - last
    end
    if shift ~= 0 then
      entries = redis.call('ZRANGE', index, 0, -1, 'WITHSCORES')
      for i = 1, #entries, 2 do
        redis.call('ZADD', index, tonumber(entries[i + 1]) + shift, entries[i])
      end
      redis.call('HINCRBY', clock, 'jumps', 1)
      redis.call('HSET', clock, 'shifted_s', shift, 'jumped_at', now)
      if shift > 0 then redis.call('HSET', clock, 'heartbeats_from', now + lease) end
    end
  end
  redis.call('HSET', clock, 'at', now)
  return now, shift, #entries / 2
end
"""

#: Redis's time after the visibility step and the shift it applied, as strings (a Lua number reply would lose the
#: fraction), and how many scores it moved. KEYS: unacked_index, the clock hash. ARGV: the lease (seconds).
_NOW = (
    VISIBILITY_NOW
    + "local now, shift, n = visibility_now(KEYS[1], KEYS[2], tonumber(ARGV[1]))\n"
    + "return {tostring(now), tostring(shift), n}\n"
)

#: Score one delivery at Redis's time (kombu's ``QoS.append``). KEYS: unacked_index, the clock hash. ARGV: the
#: delivery tag, the lease (seconds).
SCORE_DELIVERY = (
    VISIBILITY_NOW
    + "redis.call('ZADD', KEYS[1], visibility_now(KEYS[1], KEYS[2], tonumber(ARGV[2])), ARGV[1])\nreturn 1\n"
)

#: 1 when a missing heartbeat means a dead worker, 0 while a jump's expiry of live heartbeats may still show.
#: KEYS: the clock hash.
_HEARTBEATS_TRUSTED = """
local from = tonumber(redis.call('HGET', KEYS[1], 'heartbeats_from'))
if not from then return 1 end
local t = redis.call('TIME')
if tonumber(t[1]) + tonumber(t[2]) / 1000000 >= from then return 1 end
return 0
"""


def unacked_index_key(prefix: str) -> str:
    """kombu's ``unacked_index`` sorted set under ``prefix``."""
    return KombuKeys(prefix).unacked_index


def clock_key(unacked_index: str) -> str:
    """HASH: the visibility clock of the ``unacked_index`` ZSET (what :data:`VISIBILITY_NOW` keeps)."""
    return f"{unacked_index}:clock"


def jump_margin_s(lease_s: float) -> float:
    """How far Redis's clock may move between two visibility steps before the rest is a jump."""
    return lease_s * JUMP_FRACTION


def visibility_now(client: Any, unacked_index: str, lease_s: float) -> float:
    """Redis's time (seconds) after the visibility step (a re-base if the clock jumped); ``client`` synchronous."""
    now, shift, moved = client.eval(_NOW, 2, unacked_index, clock_key(unacked_index), lease_s)
    note_rebase(float(shift), int(moved))
    return float(now)


def note_rebase(shift_s: float, moved: int) -> None:
    """Log a re-base this process's visibility step made (one line per jump: only the first step after it moves)."""
    if not shift_s:
        return
    log.warning(
        "Redis's clock moved %+.1f s more than half a lease since the last visibility step (a failover to a replica "
        "whose clock differs, or an outage): %d delivery score(s) moved by %+.1f s, so none is restored for the jump",
        shift_s, moved, shift_s,
    )  # fmt: skip


def heartbeats_trusted(client: Any, unacked_index: str) -> bool:
    """False for one lease after a jump forward (heartbeats expired by it, live workers' too); ``client`` sync."""
    return bool(int(client.eval(_HEARTBEATS_TRUSTED, 1, clock_key(unacked_index))))


async def heartbeats_trusted_async(client: Any, unacked_index: str) -> bool:
    """:func:`heartbeats_trusted` for an asyncio client."""
    return bool(int(await client.eval(_HEARTBEATS_TRUSTED, 1, clock_key(unacked_index))))
