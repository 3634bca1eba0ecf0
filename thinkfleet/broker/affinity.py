"""Host affinity: a conversation's next turn goes first to the host whose server has its prefix cached.

In a ``--turns all`` or agentic job, turn i+1 (or tool step j+1) starts with the whole history turn i's server
just processed, and SGLang's radix cache on *that* host holds it. Put on the shared queue, the next message lands
on any of N hosts and finds its prefix cached about 1/N of the time. So the finalize of turn i *offers* turn i+1
to the worker that stored turn i, and any host takes it after a bounded wait. Routing is only a preference:
claims, fences and the finalize are what they were, so exactly-once does not depend on any of this.

- **Offer.** The finalize that marks turn i done pushes turn i+1 onto the finalizing worker's host list,
  ``{queue}:host:{worker}`` (kombu's priority scheme: one list per priority step,
  :func:`thinkfleet.broker.keys.host_lists`), and records the offer's Redis time in the offers ZSET
  (``Keys.affinity_offers``), in the same Lua call (thinkfleet/state/lua/finalize.lua). A host list is first in,
  first out: its oldest offer is the one its host pops next and the one a sweep looks at. The worker offers to
  the shared queue instead when affinity is off, its broker has no transit channel (nothing would pop its host
  list), it is not consuming (draining, server down, storage failing) or its host list already holds
  ``affinity_backlog`` messages (:meth:`HostAffinity.place`). ``producer retry`` offers a re-sent turn the same way
  to the host that ran its previous turn (:func:`offer_resent`, in the retry's MULTI). Each offer is counted once, by
  the finalize call that pushed it (``offered``, :class:`AffinityStats`).
- **Pop.** A worker's transit channel (thinkfleet/broker/transit.py) pops its own host list before the shared
  queue, priority step by priority step (:data:`POP`): within a job priority a conversation's next turn comes
  before a new turn 0, and no host list lets a lower-priority job pass a higher one. The pop removes the offer in
  the same step. Every worker pops its own host list whatever its ``affinity`` setting, so turning affinity off
  strands nothing. A pop that finds every list empty (the worker is idle) takes the oldest offer of another host
  that has waited ``affinity_idle_wait_s``: an idle host never waits on a full one (work stealing). A worker that
  blocks on the queue while it holds deliveries looks again every :data:`BLOCK_S` (:func:`block_timeout`).
- **Steal.** Every live worker sweeps (:meth:`HostAffinity.run`, every ``affinity_wait_s / 4``, at most 1 s): one
  Lua call (:data:`STEAL`) moves onto the shared queue — onto its consuming end, each message onto the list of its
  own priority — every offered message older than ``affinity_wait_s``, and whole host lists of workers without a
  heartbeat (dead) or that are not consuming (the worker flushes its own, and again as it stops). A host-list
  message whose offer is gone (dropped as stale while it waited behind a fresher one, on a Redis clock that went
  back) is never stranded: its live host pops it, and every ``reaper_interval_s`` the sweep also SCANs for host
  lists of dead workers and moves them whole.

A message is always in Redis: on a host list, the shared queue, a transit list or kombu's unacked hash — every
move between them is one atomic Lua call. Everything that reads the broker to find messages (status counts, the
live invariant, re-submit dedup, pause/cancel/purge) reads the host lists too
(:func:`thinkfleet.broker.queues.queue_keys`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.broker.keys import (
    HOST_INFIX,
    PRIORITY_SEP,
    host_glob,
    host_owner,
    host_queue,
    priority_list,
    priority_lists,
)
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings
from thinkfleet.state.scripts import lua

log = logging.getLogger(__name__)

#: Offers one sweep looks at, and messages it moves, per Lua call (each call blocks Redis while it runs).
STEAL_BATCH = 500
#: Longest blocking pop on the queue of a worker that offers next turns to itself and holds deliveries
#: (:func:`block_timeout`): what a next turn offered to its host may wait before the host looks (~2 cheap calls each).
BLOCK_S = 0.2

# The transit pop with host lists: per priority step, the worker's own host list, then the shared queue's list; the
# first message found moves into the transit list (as transit.py's _POP), and a host list's offer goes with it. When
# every list is empty the worker is idle: it takes the oldest offer of another host that has waited its idle wait —
# a message at the oldest end of that host's list — rather than idle while that host is full (work stealing).
# KEYS: pairs (host list, shared list) per priority step, highest first; then transit, offers. ARGV: the worker, the
# host lists' prefix ('{queue}:host:'), kombu's priority separator, the idle wait in ms ('' = never steal), the
# number of priority steps. Returns {message, 1 from its host list | 0 from the shared queue | 2 stolen}, or false.
POP = (
    lua("_offer")
    + """
local transit, offers = KEYS[#KEYS - 1], KEYS[#KEYS]
for i = 1, #KEYS - 2, 2 do
  local m = redis.call('LMOVE', KEYS[i], transit, 'RIGHT', 'LEFT')
  if m then
    redis.call('ZREM', offers, offer_member(ARGV[1], m))
    return {m, 1}
  end
  m = redis.call('LMOVE', KEYS[i + 1], transit, 'RIGHT', 'LEFT')
  if m then return {m, 0} end
end
if ARGV[4] == '' then return false end
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) + tonumber(t[2]) / 1000000 - tonumber(ARGV[4]) / 1000
for _, member in ipairs(redis.call('ZRANGEBYSCORE', offers, '-inf', cutoff, 'LIMIT', 0, 16)) do
  local w = string.match(member, '^(.-)\\n')
  if w and w ~= ARGV[1] then
    for s = 0, tonumber(ARGV[5]) - 1 do
      local host = ARGV[2] .. w
      if s > 0 then host = host .. ARGV[3] .. s end
      local m = redis.call('LRANGE', host, -1, -1)[1]
      if m and offer_member(w, m) == member then
        redis.call('LMOVE', host, transit, 'RIGHT', 'LEFT')
        redis.call('ZREM', offers, member)
        return {m, 2}
      end
    end
  end
end
return false
"""
)

# One sweep's steal. KEYS: offers, then the shared queue's priority lists for steps 0..9. ARGV: the host lists'
# prefix ('{queue}:host:'), kombu's priority separator, the heartbeat key prefix, the wait in ms, the batch, then
# workers whose host lists go whole (not consuming, or found dead by a SCAN). The owners of offers older than the
# wait are visited (whole when their heartbeat is gone); each of their lists, from its oldest end, gives up its
# messages while they are stale (or whole) onto the consuming end of the shared list of the same priority. Offers
# left stale name no message at a list's oldest end (the message left by another way — parked, cancelled — or, on a
# clock that went back, waits behind a fresher one, which its host pops in order): dropped.
# Returns {moved because stale, moved whole, 1 when the batch ran out (call again)}.
STEAL = (
    lua("_offer")
    + """
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) + tonumber(t[2]) / 1000000 - tonumber(ARGV[4]) / 1000
local batch = tonumber(ARGV[5])
local stale, whole, order = {}, {}, {}
local found = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, batch)
for _, member in ipairs(found) do
  stale[member] = true
  local w = string.match(member, '^(.-)\\n')
  if w and whole[w] == nil then
    whole[w] = false
    order[#order + 1] = w
  end
end
for i = 6, #ARGV do
  if whole[ARGV[i]] == nil then order[#order + 1] = ARGV[i] end
  whole[ARGV[i]] = true
end
local by_age, by_owner, budget = 0, 0, batch
for _, w in ipairs(order) do
  local all = whole[w] or redis.call('EXISTS', ARGV[3] .. w) == 0
  for s = 0, #KEYS - 2 do
    local host = ARGV[1] .. w
    if s > 0 then host = host .. ARGV[2] .. s end
    while budget > 0 do
      local m = redis.call('LRANGE', host, -1, -1)[1]
      if not m then break end
      local member = offer_member(w, m)
      if not (all or stale[member]) then break end
      redis.call('LMOVE', host, KEYS[2 + s], 'RIGHT', 'RIGHT')
      redis.call('ZREM', KEYS[1], member)
      stale[member] = nil
      budget = budget - 1
      if all then by_owner = by_owner + 1 else by_age = by_age + 1 end
    end
  end
end
if budget <= 0 then return {by_age, by_owner, 1} end
for member in pairs(stale) do redis.call('ZREM', KEYS[1], member) end
return {by_age, by_owner, #found >= batch and 1 or 0}
"""
)


# ``producer retry``'s offer of re-sent turns to a host (:func:`offer_resent`), queued inside the retry's MULTI: onto
# the host's list with their offers, as finalize.lua offers a next turn, while the host has a heartbeat and room
# under the backlog bound; else (or for the rest) onto the shared list of the same priority. KEYS: offers, the host's
# list, the shared list, the host's heartbeat. ARGV: the worker, the backlog bound (0 = none), then the messages.
# Returns how many were offered on the host list.
OFFER = (
    lua("_offer")
    + """
local offers, host, shared = KEYS[1], KEYS[2], KEYS[3]
local room = -1
if redis.call('EXISTS', KEYS[4]) == 0 then
  room = 0
elseif tonumber(ARGV[2]) > 0 then
  room = math.max(0, tonumber(ARGV[2]) - redis.call('LLEN', host))
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local offered = 0
for i = 3, #ARGV do
  if room ~= 0 then
    redis.call('LPUSH', host, ARGV[i])
    redis.call('ZADD', offers, now, offer_member(ARGV[1], ARGV[i]))
    offered = offered + 1
    if room > 0 then room = room - 1 end
  else
    redis.call('LPUSH', shared, ARGV[i])
  end
end
return offered
"""
)


class AffinityStats:
    """This process's placement counts, by outcome (``offered``: next turns its finalizes pushed onto its host list,
    counted once each by the finalize that made the offer, thinkfleet/state/ledger.py; ``shared_away``,
    ``shared_backlog``, ``own``: popped
    from its own host list, ``stolen_stale``/``stolen_whole``: moved to the shared queue by its sweeps): thread-safe
    (the transit channel counts its pops on Celery's thread), exported by workers/metrics.py."""

    OUTCOMES = ("offered", "shared_away", "shared_backlog", "own", "stolen_idle", "stolen_stale", "stolen_whole")
    #: What :data:`POP`'s second value says of a message: from the shared queue, our host list, stolen while idle.
    _POPPED = (None, "own", "stolen_idle")

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def note(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self._counts[outcome] += n

    def note_pop(self, source: int) -> None:
        """A pop of the transit channel (:data:`POP`'s second value)."""
        outcome = self._POPPED[source] if 0 <= source < len(self._POPPED) else None
        if outcome is not None:
            self.note(outcome)

    def __getitem__(self, outcome: str) -> int:
        with self._lock:
            return self._counts[outcome]


#: This process's placement counts.
AFFINITY = AffinityStats()


@dataclass(frozen=True)
class Placement:
    """Where a finalize pushes a job's next turns: ``queue`` (a priority list) and, for a host list, the offers ZSET
    that records each offer's time with it ('' = the shared queue)."""

    queue: str
    offers: str = ""


def sweep_interval_s(wait_s: float) -> float:
    """How often a worker sweeps for stale offers: a quarter of the wait (a message waits at most the wait plus
    this), between 0.1 and 1 s."""
    return min(1.0, max(0.1, wait_s / 4))


class HostAffinity:
    """One worker's side of affinity: where its finalizes offer next turns (:meth:`place`), and the sweep it runs
    beside its lease keeper (:meth:`sweep`, in its own loop: :meth:`run`)."""

    def __init__(
        self,
        client: aioredis.Redis,
        settings: Settings,
        worker: str,
        accepting: Callable[[], bool] = lambda: True,
        transit: bool = True,
    ) -> None:
        self.r = client
        self.keys: Keys = settings.keys
        self.worker = worker
        self.queue = settings.queue
        #: Offer next turns to our own host list (the setting, and only where our channel pops it).
        self.enabled = bool(settings.affinity) and transit
        self.wait_s = float(settings.affinity_wait_s)
        self.backlog = int(settings.affinity_backlog)
        self.discover_s = float(settings.reaper_interval_s)
        #: Whether this worker consumes now (not draining, its server and storage healthy): else it offers to the
        #: shared queue and its sweep hands its host list back.
        self.accepting = accepting
        self.offers = self.keys.affinity_offers(self.queue)
        self.host = host_queue(self.queue, worker)
        self._steal = client.register_script(STEAL)
        self._discovered_at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def place(self, priority: int) -> Placement:
        """Where a next turn of a job of this priority step goes: our host list, or the shared queue."""
        shared = priority_list(self.queue, priority)
        if not self.enabled:
            return Placement(shared)
        if not self.accepting():
            AFFINITY.note("shared_away")
            return Placement(shared)
        host = priority_list(self.host, priority)
        if self.backlog and int(await self.r.llen(host)) >= self.backlog:
            # More waits for us than we take soon: a new offer would only wait out its time.
            AFFINITY.note("shared_backlog")
            return Placement(shared)
        return Placement(host, self.offers)

    async def sweep(self) -> tuple[int, int]:
        """One pass: (moved because they waited too long, moved because their host is dead or away)."""
        whole: list[str] = [] if self.accepting() else [self.worker]
        now = time.monotonic()
        if now - self._discovered_at >= self.discover_s:
            self._discovered_at = now
            whole += [w for w in await self.dead_owners() if w not in whole]
        by_age = by_owner = 0
        while True:
            a, b, more = await self._steal(
                keys=[self.offers, *priority_lists(self.queue)],
                args=[
                    self.queue + HOST_INFIX,
                    PRIORITY_SEP,
                    self.keys.heartbeat(""),
                    int(self.wait_s * 1000),
                    STEAL_BATCH,
                    *whole,
                ],
            )
            by_age, by_owner = by_age + int(a), by_owner + int(b)
            if not int(more):
                break
        if by_age:
            AFFINITY.note("stolen_stale", by_age)
        if by_owner:
            AFFINITY.note("stolen_whole", by_owner)
        return by_age, by_owner

    async def dead_owners(self) -> list[str]:
        """Workers with a host list and no heartbeat (found by SCAN: also a list whose offers are gone)."""
        owners: set[str] = set()
        async for raw in self.r.scan_iter(match=host_glob(self.queue), count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            owner = host_owner(self.queue, key)
            if owner is not None and owner != self.worker:
                owners.add(owner)
        names = sorted(owners)
        if not names:
            return []
        async with self.r.pipeline(transaction=False) as p:
            for name in names:
                p.exists(self.keys.heartbeat(name))
            alive = await p.execute()
        return [n for n, a in zip(names, alive, strict=True) if not a]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="affinity-sweep")

    async def run(self) -> None:
        interval = sweep_interval_s(self.wait_s)
        while True:
            try:
                by_age, by_owner = await self.sweep()
                if by_owner:
                    log.warning("moved %d message(s) of dead or away hosts' host lists to the shared queue", by_owner)
                elif by_age:
                    log.info("moved %d message(s) offered longer than %.1f s to the shared queue", by_age, self.wait_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("affinity sweep failed (will retry in %.1fs): %s", interval, exc)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        """End the sweep and hand our host list to the shared queue (a stopping worker takes nothing more: another
        host serves those turns now rather than after the wait)."""
        self.accepting = lambda: False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.sweep()
        except Exception as exc:  # Redis away: the others' sweeps move the list once our heartbeat is gone
            log.warning("could not hand our host list to the shared queue at stop: %s", exc)


def pop_keys(channel: Any, source: str) -> list[Any]:
    """``numkeys``, KEYS and ARGV of :data:`POP` for a transit channel consuming ``source``: per priority step
    (highest first, kombu's ``_q_for_pri`` naming both) the channel's host list then the shared list; transit;
    offers; then the worker, its host lists' prefix, the separator, the idle wait, the number of steps."""
    keys: list[str] = []
    steps = list(dict.fromkeys(channel.priority(pri) for pri in sorted(channel.priority_steps)))
    for step in steps:
        keys += [channel._q_for_pri(channel.affinity_key, step), channel._q_for_pri(source, step)]
    keys += [channel.transit_key, channel.affinity_offers]
    worker = channel.delivery_holder or ""
    prefix = channel.affinity_key[: len(channel.affinity_key) - len(worker)]
    idle = channel.affinity_idle_ms if channel.affinity_idle_ms is not None else ""
    return [len(keys), *keys, worker, prefix, channel.sep, idle, max(steps) + 1]


def block_timeout(channel: Any, timeout: float | None) -> float:
    """How long a transit channel's blocking pop waits on the queue (``BLMOVE``, once a look found every list
    empty): kombu's ``brpop_timeout`` (1 s); at most :data:`BLOCK_S` while its worker offers next turns to itself
    and holds deliveries — one of them may end in a next turn offered on its host list, which a block on the queue
    does not see: it would wait out the whole timeout. (A worker holding nothing gets no offer of its own.)"""
    wait = float(channel.brpop_timeout if timeout is None else timeout)
    qos = channel.qos
    held = len(getattr(qos, "_delivered", ())) - len(getattr(qos, "_dirty", ()))
    return min(wait, BLOCK_S) if channel.affinity_block and held > 0 else wait


def affinity_options(settings: Settings, worker: str) -> dict[str, str]:
    """The transit channel's options naming ``worker``'s host list and the offers ZSET (transit.py)."""
    return {
        "affinity_key": host_queue(settings.queue, worker),
        "affinity_offers": settings.keys.affinity_offers(settings.queue),
        "affinity_idle_ms": str(int(settings.affinity_idle_wait_s * 1000)),
        "affinity_block": "1" if settings.affinity else "",
    }


def offer_resent(pipe: Any, settings: Settings, worker: str, priority: int, messages: list[bytes]) -> None:
    """Queue on ``pipe`` (a MULTI: ``producer retry``'s) the offer of re-sent ``messages`` — turns whose previous turn
    ``worker`` ran — to ``worker``'s host list at ``priority``, each with its offer on Redis's clock (:data:`OFFER`):
    its host pops them first, and the same sweep and idle steal hand them over when they wait too long or the host is
    gone. A host without a heartbeat, or whose list is at the backlog bound, gets none: onto the shared queue. The
    call's result in the MULTI's replies is how many were offered."""
    pipe.eval(
        OFFER,
        4,
        settings.keys.affinity_offers(settings.queue),
        priority_list(host_queue(settings.queue, worker), priority),
        priority_list(settings.queue, priority),
        settings.keys.heartbeat(worker),
        worker,
        int(settings.affinity_backlog),
        *messages,
    )
