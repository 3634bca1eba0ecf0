"""Leases: a worker's heartbeat, and the visibility of the messages it holds.

Kombu's Redis transport scores each unacknowledged message with its delivery time and redelivers it
once ``visibility_timeout`` (= ``lease_s``) has passed — it never renews that score, so a long
generation would be redelivered while it still runs. Every ``lease_s / 4`` a live worker re-scores
the delivery tags it holds and refreshes its heartbeat key (one Lua call, :data:`_BEAT`).
A SIGKILLed worker stops doing both, so within ``lease_s`` + the restore sweep (``reaper_interval_s``, run
by every live worker's kombu) its prompts are back on the queue, and its claims are recognised as stale
because the heartbeat key has expired.

Trade-off: a worker frozen for longer than ``lease_s`` (e.g. a stopped container) is treated as dead;
its prompts re-run elsewhere and the claim/part protocol in thinkfleet/state/ledger.py keeps the output
exactly-once.

Time is Redis's: one Lua call (:data:`_BEAT`) reads Redis ``TIME`` and with it scores the held tags, stamps the
heartbeat (``at``) and the worker's entry in ``{prefix}:workers`` (``seen_at``), so a host whose clock is off
neither renews a message into the future nor lets one lapse early (kombu's own delivery scores and restore
sweep use Redis time too: thinkfleet/broker/clock.py). Each beat also measures this host's clock against
Redis (``clock_offset_s`` = host − Redis, in the heartbeat, where ``producer status`` warns about it).

The heartbeat carries who holds the worker's name (workers/identity.py) and is written only as a
compare-and-set on the holder's nonce: a beat that finds another nonce writes nothing and reports the name
lost (``on_lost``) — unless what it found is certainly an earlier, dead life of the name brought back by a
Redis rollback (:func:`workers.identity.earlier_life`), which it overwrites.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.broker.keys import KombuKeys
from thinkfleet.broker.transit import TransitSweeper, split_delivery_tag
from thinkfleet.broker.visibility import VISIBILITY_NOW, clock_key, note_rebase
from thinkfleet.keys import Keys
from workers.identity import acquire_name, describe_holder, earlier_life, holder_record, parse_holder

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

    def deliveries(self) -> list[str]:
        """Kombu tag, holder ('' for a plain kombu tag), … of every delivery held: :data:`_BEAT`'s tail of ARGV."""
        return [part or "" for tag in self.tags() for part in split_delivery_tag(tag)]

    def __len__(self) -> int:
        return len(self._tags)


#: One heartbeat, atomically, on Redis's clock (a jump of it re-based first: thinkfleet/broker/visibility.py). KEYS:
#: heartbeat, the workers hash, kombu's unacked_index, the holder of each unacked entry (KombuKeys.unacked_holder),
#: the visibility clock (visibility.clock_key). ARGV: nonce, the heartbeat JSON (without ``at``; '' =
#: the name is lost: renew the tags only), its TTL in ms, the worker's name, its info JSON (without ``seen_at``; ''
#: = leave the workers hash alone), a value we may overwrite though its nonce is not ours (a previous life's; '' =
#: none), then per delivery held its kombu tag and its holder ('' = a plain kombu delivery, no holder recorded). A
#: tag is re-scored whatever the heartbeat holds (it is this process's own delivery), but only while its entry is
#: still that delivery's: a delivery of ours whose message was restored and taken by another worker (our lease
#: lapsed) must not keep that worker's entry alive after it died. Returns {1, now, '', shift, moved} when written,
#: else {0, now, found, shift, moved} (shift, moved: the visibility step's re-base, visibility.VISIBILITY_NOW).
_BEAT = (
    VISIBILITY_NOW
    + """
local now, shift, moved = visibility_now(KEYS[3], KEYS[5], tonumber(ARGV[3]) / 1000)
local jumped = {tostring(shift), moved}
for i = 7, #ARGV - 1, 2 do
  if ARGV[i + 1] == '' or redis.call('HGET', KEYS[4], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[3], 'XX', now, ARGV[i])
  end
end
local cur = redis.call('GET', KEYS[1])
if ARGV[2] == '' then return {0, tostring(now), cur or '', unpack(jumped)} end
if cur and cur ~= ARGV[6] then
  local ok, v = pcall(cjson.decode, cur)
  if not ok or type(v) ~= 'table' or v['nonce'] ~= ARGV[1] then return {0, tostring(now), cur, unpack(jumped)} end
end
local hb = cjson.decode(ARGV[2])
hb['at'] = now
redis.call('SET', KEYS[1], cjson.encode(hb), 'PX', ARGV[3])
if ARGV[5] ~= '' then
  local info = cjson.decode(ARGV[5])
  info['seen_at'] = now
  redis.call('HSET', KEYS[2], ARGV[4], cjson.encode(info))
end
return {1, tostring(now), '', unpack(jumped)}
"""
)

#: Delete the heartbeat only while it is ours. KEYS: heartbeat; ARGV: nonce.
_UNBEAT = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local ok, v = pcall(cjson.decode, cur)
if ok and type(v) == 'table' and v['nonce'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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
        on_lost: Callable[[str], None] = lambda holder: None,
        clock_warn_s: float = 5.0,
        holder: dict[str, Any] | None = None,
        on_lapse: Callable[[float], None] = lambda gap_s: None,
        unacked_holder_key: str | None = None,
    ) -> None:
        self.r = client
        self.keys = keys
        self.worker = worker
        self.lease_s = lease_s
        self.unacked_index_key = unacked_index_key
        #: Who holds each unacked entry (thinkfleet/broker/transit.py): a held tag is renewed only while it is ours.
        self.unacked_holder_key = unacked_holder_key or KombuKeys(keys.prefix).unacked_holder
        self.held = held
        self.info = info
        self.sweeper = sweeper
        self.on_lost = on_lost
        #: Called (with the gap, seconds) when a beat is written more than a lease after the last one: we lived
        #: through a lapse of our lease (a pause, a partition), and other workers may have taken our claims over.
        self.on_lapse = on_lapse
        self._beaten_at: float | None = None  # monotonic time of our last heartbeat written by beat()
        self.clock_warn_s = clock_warn_s
        #: Who we are in the heartbeat (workers/identity.py): host, pid, nonce, started_at, boot id, pid namespace.
        self.holder = holder or holder_record()
        #: This host's clock minus Redis's (seconds), measured at every beat; None before the first.
        self.clock_offset_s: float | None = None
        self.clock_skewed = False
        #: Who holds our name instead of us (a beat found another nonce); None while the name is ours.
        self.lost: str | None = None
        self._redis_now = 0.0  # Redis's time at the last write
        self._beat = client.register_script(_BEAT)
        self._unbeat = client.register_script(_UNBEAT)
        self._task: asyncio.Task[None] | None = None

    @property
    def nonce(self) -> str:
        return str(self.holder["nonce"])

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-keeper")

    async def _write(self, expected: bytes | None = None, starting: bool = False) -> tuple[bool, bytes | None]:
        """One heartbeat write (:data:`_BEAT`): (written, the value found instead)."""
        record: dict[str, Any] = {**self.holder, "lease_s": self.lease_s, "clock_offset_s": self.clock_offset_s}
        if starting:
            record["starting"] = True  # held, not yet serving (demo/fleet.py waits past it)
        info = "" if starting else json.dumps({**self.info, "clock_offset_s": self.clock_offset_s})
        before = time.time()
        written, now, found, shift, moved = await self._beat(
            keys=[
                self.keys.heartbeat(self.worker),
                self.keys.workers,
                self.unacked_index_key,
                self.unacked_holder_key,
                clock_key(self.unacked_index_key),
            ],
            args=[
                self.nonce,
                "" if self.lost is not None else json.dumps(record),  # a lost name is never taken back
                max(1, int(self.lease_s * 1000)),
                self.worker,
                info,
                expected or b"",
                *self.held.deliveries(),
            ],
        )
        after = time.time()
        note_rebase(float(shift), int(moved))
        self._redis_now = float(now)
        self._note_clock((before + after) / 2 - self._redis_now)
        return bool(int(written)), (found or None) if not int(written) else None

    def _note_clock(self, offset: float) -> None:
        self.clock_offset_s = round(offset, 3)
        skewed = abs(offset) > self.clock_warn_s
        if skewed and not self.clock_skewed:
            log.warning(
                "this host's clock is %.1f s %s Redis's (more than %.0f s): leases and visibility run on Redis "
                "time, but fix the host's clock (NTP) — timestamps this worker writes are off by as much",
                abs(offset),
                "ahead of" if offset > 0 else "behind",
                self.clock_warn_s,
            )
        elif self.clock_skewed and not skewed:
            log.warning("this host's clock is back within %.0f s of Redis's (%.3f s)", self.clock_warn_s, offset)
        self.clock_skewed = skewed

    async def _read(self) -> tuple[bytes | None, int]:
        """The heartbeat's value and its TTL in ms (whole seconds: TTL is in the worker's ACL, PTTL is not)."""
        async with self.r.pipeline(transaction=False) as p:
            p.get(self.keys.heartbeat(self.worker))
            p.ttl(self.keys.heartbeat(self.worker))
            raw, ttl = await p.execute()
        return raw, int(ttl) * 1000 if int(ttl) >= 0 else int(ttl)

    async def acquire(self) -> str | None:
        """At start, before anything under our name is touched: hold the name's heartbeat, or raise
        :class:`workers.identity.NameHeld` (another live process holds it). A line for the log when a dead
        previous life's heartbeat was taken over."""
        took_over = await acquire_name(
            self.worker,
            self.holder,
            lambda expected: self._write(expected, starting=True),
            self._read,
            self.lease_s,
        )
        # When this life began holding the name, on Redis's clock: a heartbeat of an earlier ``since`` found
        # later can only be a dead life's brought back (a Redis rollback), never a live holder's.
        self.holder["since"] = self._redis_now
        return took_over

    async def beat(self) -> bool:
        """Renew the held tags and, while the name is ours, the heartbeat. False once it is not."""
        written, found = await self._write()
        if written:
            now = time.monotonic()
            if self._beaten_at is not None and now - self._beaten_at > self.lease_s:
                self.on_lapse(now - self._beaten_at)
            self._beaten_at = now
        if not written and self.lost is None:
            theirs = parse_holder(found)
            earlier = earlier_life(self.holder, theirs)
            if earlier is not None:
                log.warning("worker name %r: its heartbeat holds %s: taking it back", self.worker, earlier)
                written, found = await self._write(expected=found)
                if written:
                    return True
                theirs = parse_holder(found)
            self.lost = describe_holder(theirs)
            self.on_lost(self.lost)
        return written

    async def _run(self) -> None:
        interval = max(0.2, self.lease_s / 4)
        while True:
            try:
                ours = await self.beat()
                # A name held by another process: its transit list is that process's, not ours to sweep.
                if ours and self.sweeper is not None:
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
            await self._unbeat(keys=[self.keys.heartbeat(self.worker)], args=[self.nonce])
        except Exception:
            pass
