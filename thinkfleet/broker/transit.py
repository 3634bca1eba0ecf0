"""Close kombu's pop gap: a message is never only in a worker's memory.

Kombu's Redis transport takes a message off the queue with ``BRPOP`` and only afterwards records it in
its ``unacked`` hash (``QoS.append``). In between the message exists nowhere but in the worker — and
that "in between" is long: a busy worker keeps the popped reply unread in its socket until a pool slot
frees (``MultiChannelPoller._pause_brpop``). A worker SIGKILLed then loses that prompt for good
(reproduced by tests/test_reliability_workers.py).

Here the pop is a move ``queue → {prefix}:transit:{worker}`` instead (``LMOVE`` from kombu's priority
lists, highest first — each step the worker's own host list first, thinkfleet/broker/affinity.py — else ``BLMOVE``
from the queue; see :class:`Channel`): atomic, so the message is always in Redis — in the queue, a host list, the
worker's transit list, or kombu's unacked hash.
Once kombu has recorded it as unacked, it leaves the transit list. The sweep run by every live worker's lease
keeper (thinkfleet/broker/transit_sweep.py) puts back on the queue what a dead worker left in its transit list, and
what its own list kept for two sweeps in a row. Both may hand a message out twice; the claims in
thinkfleet/state/ledger.py make a second delivery cost nothing.

Only a worker consuming its one task queue from ``redis://``, ``rediss://`` (TLS: the channel is
kombu's own, so it connects through kombu's SSL connection class with the ``broker_use_ssl`` options) or a
``sentinel://`` head (thinkfleet/broker/transit_sentinel.py: kombu's Sentinel pool under this channel) uses
this; everything else (the producer, other queues) is kombu's stock transport.

The channel's ack emulation (:class:`QoS`) is kombu's on Redis's clock: a delivery is scored in
``unacked_index`` with Redis ``TIME`` and the restore sweep compares against Redis ``TIME``, both read inside
Redis after a jump of that clock is re-based (thinkfleet/broker/visibility.py), so neither a worker whose host
clock runs ahead nor a failover to a replica whose clock does can restore other workers' live messages early.
(Flower, a stock-transport consumer, still sweeps on its own host's clock: run it where Redis runs, as the head
node's compose file does.)

Each delivery is settled only by itself. kombu restores an expired delivery with its original delivery tag, and
the next consumer records it under that same tag: a worker paused past its lease that came back and acked its
(now fenced) run used to delete the entry another worker held, and when that one died or handed the message back
nothing restored it. So every delivery on this channel carries its own tag, ``{kombu tag}#{holder}`` (the holder
is ``{worker}/{nonce}``, a fresh nonce per delivery: a restarted worker of the same name, or a second delivery of
the same message to this process, is another holder); :meth:`QoS.append` records the holder beside the entry
(``unacked_holder``, thinkfleet/broker/keys.py), and an ack, reject or hand-back — and the lease keeper's
renewal (workers/lease.py) — acts on the entry only while it names that holder (:data:`_SETTLE`, a WATCHed
transaction for the hand-back). Another holder's entry is left alone (one log line, :data:`LEFT_TO_HOLDER`):
it is settled by its own delivery, or restored by the visibility sweep once that delivery stops renewing it.
A Redis rollback brings entry and holder back together (one MULTI wrote both), so a delivery settles exactly
what its own append wrote. kombu's restores keep working: the sweep restores an expired tag whoever holds it and
drops its holder record with the entry; a channel closing restores only what is still its own deliveries'.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from time import monotonic
from typing import Any

from celery import Celery
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from kombu.utils.objects import cached_property

from thinkfleet.broker.affinity import AFFINITY, POP, affinity_options, block_timeout, pop_keys
from thinkfleet.broker.clock import RedisClock
from thinkfleet.broker.transit_sweep import TransitSweeper as TransitSweeper  # (its home was here)
from thinkfleet.broker.visibility import SCORE_DELIVERY, clock_key, visibility_now
from thinkfleet.broker.watchdog import OPTION as WATCHDOG_OPTION
from thinkfleet.broker.watchdog import WatchedTransport, stuck_bound_s
from thinkfleet.redis_client import KOMBU_KEEPALIVE_OPTION, with_kombu_keepalive
from thinkfleet.settings import Settings

log = logging.getLogger(__name__)

#: The transport a worker process selects for ``redis://`` and ``rediss://`` brokers (:func:`enable_transit`).
TRANSPORT = "thinkfleet.broker.transit:Transport"
#: … and for a ``sentinel://`` head (thinkfleet/redis_client.py).
SENTINEL_TRANSPORT = "thinkfleet.broker.transit_sentinel:SentinelTransport"

# The non-blocking half of the transit pop: the first message of the highest-priority list that has one,
# moved atomically into the transit list. KEYS: the priority lists, highest first, then the transit list.
_POP = """
for i = 1, #KEYS - 1 do
  local m = redis.call('LMOVE', KEYS[i], KEYS[#KEYS], 'RIGHT', 'LEFT')
  if m then return m end
end
return false
"""


# Settle one delivery: remove kombu's unacked entry of a tag (entry, score, holder record) only while the holder
# recorded beside it is this delivery's. KEYS: unacked, unacked_index, unacked_holder. ARGV: the kombu tag, this
# delivery's holder. Returns {1, ''} when removed, else {0, the holder found ('' = none: the entry was restored)}.
_SETTLE = """
local cur = redis.call('HGET', KEYS[3], ARGV[1])
if cur ~= ARGV[2] then return {0, cur or ''} end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return {1, ''}
"""

# Drop holder records whose entry is gone without them (kombu's stock transport restores — Flower's sweep — remove
# the entry only): one HSCAN step, atomic, so an entry appended meanwhile (entry and holder in one MULTI) is never
# mistaken for gone. KEYS: unacked, unacked_holder. ARGV: the HSCAN cursor, its COUNT. Returns the next cursor.
_PRUNE = """
local step = redis.call('HSCAN', KEYS[2], ARGV[1], 'COUNT', ARGV[2])
local fields = step[2]
for i = 1, #fields, 2 do
  if redis.call('HEXISTS', KEYS[1], fields[i]) == 0 then redis.call('HDEL', KEYS[2], fields[i]) end
end
return step[1]
"""

#: Between kombu's delivery tag and this delivery's holder in a channel's delivery tags (a uuid holds no ``#``).
HOLDER_SEP = "#"


def split_delivery_tag(tag: Any) -> tuple[str, str | None]:
    """(kombu's delivery tag, this delivery's holder) of a delivery tag of :class:`Message`; holder None for a
    plain kombu tag (a delivery of kombu's stock transport, or a tag read from ``unacked_index``)."""
    text = bytes_to_str(tag)
    base, sep, holder = text.partition(HOLDER_SEP)
    return base, (holder if sep else None)


class _LeftToHolder:
    """How many outcomes of our deliveries found the entry another delivery's and left it alone, by outcome
    (``ack``, ``reject``, ``hand-back``, ``restore``): a worker's metrics export them (workers/metrics.py)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def note(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def __getitem__(self, outcome: str) -> int:
        with self._lock:
            return self._counts[outcome]


#: This process's count of outcomes left to another delivery's entry (see :class:`_LeftToHolder`).
LEFT_TO_HOLDER = _LeftToHolder()


class Message(virtual.Message):
    """kombu's message, its ``delivery_tag`` made this delivery's own: ``{kombu tag}#{worker}/{nonce}``. kombu acks,
    rejects and restores by ``delivery_tag`` only, so this is what tells two deliveries of one message apart."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        super().__init__(payload, channel=channel, **kwargs)
        name = getattr(channel, "delivery_holder", None) or f"{socket.gethostname()}:{os.getpid()}"
        self.delivery_tag = f"{self.delivery_tag}{HOLDER_SEP}{name}/{os.urandom(8).hex()}"


class QoS(kombu_redis.QoS):
    """kombu's Redis ack emulation with every visibility score on Redis's clock (kombu 5.7's ``append`` and
    ``restore_visible``, ``time()`` replaced by Redis ``TIME`` read in Lua, a jump of it re-based first:
    thinkfleet/broker/visibility.py), each delivery settling only its own
    entry (see the module's docstring)."""

    def append(self, message: Any, delivery_tag: Any) -> None:
        delivery = message.delivery_info
        exchange, routing_key = delivery["exchange"], delivery["routing_key"]
        tag, holder = split_delivery_tag(delivery_tag)
        with self.pipe_or_acquire() as pipe:  # a transaction: the entry and its holder are written together
            # Scored on Redis's clock inside Redis, across a jump of it re-based first (visibility.SCORE_DELIVERY).
            index = self.unacked_index_key
            pipe.eval(SCORE_DELIVERY, 2, index, clock_key(index), tag, self.visibility_timeout)
            pipe.hset(self.unacked_key, tag, dumps([message._raw, exchange, routing_key]))
            if holder is not None:
                pipe.hset(self.unacked_holder_key, tag, holder)
            pipe.execute()
        self.channel._transit_recorded = True  # the transit copy may go now (Channel._brpop_read)
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        if self._closed("ack", delivery_tag):
            return
        self._settle("ack", delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if self._closed("hand-back" if requeue else "reject", delivery_tag):
            return
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=True)
        else:
            self._settle("reject", delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # kombu's reject: off this channel's delivered messages

    @cached_property
    def unacked_holder_key(self) -> str:
        return str(self.channel.unacked_holder_key)

    def _settle(self, what: str, delivery_tag: Any) -> None:
        """Remove the entry of ``delivery_tag`` while it is this delivery's (:data:`_SETTLE`)."""
        tag, holder = split_delivery_tag(delivery_tag)
        if holder is None:  # not a delivery of ours: kombu's own removal
            self._remove_from_indices(tag).execute()
            return
        with self.channel.conn_or_acquire() as client:
            removed, found = self._script(client, "settle", _SETTLE)(
                keys=[self.unacked_key, self.unacked_index_key, self.unacked_holder_key],
                args=[tag, holder],
                client=client,
            )
        if not int(removed):
            self._left(what, tag, holder, found)

    def _script(self, client: Any, name: str, source: str) -> Any:
        """A script run by EVALSHA (loaded again after a Redis restart), one object per QoS and script."""
        scripts = self.__dict__.setdefault("_scripts", {})
        if name not in scripts:
            scripts[name] = client.register_script(source)
        return scripts[name]

    def _left(self, what: str, tag: str, holder: str, found: Any) -> None:
        found = bytes_to_str(found) if found else ""
        if not found:
            # Restored by the visibility sweep meanwhile (our lease lapsed; or Redis rolled back before our append):
            # the message is on the queue or in another delivery, nothing of ours to settle.
            log.info(
                "%s of delivery %s (%s): its unacked entry is gone (restored), nothing to settle", what, tag, holder
            )
            return
        LEFT_TO_HOLDER.note(what)
        log.warning(
            "%s of delivery %s (%s) left to its holder %s: the message was restored and delivered again (our lease "
            "lapsed); that delivery settles it, or the visibility sweep restores it if that holder stops renewing it",
            what, tag, holder, found,
        )  # fmt: skip

    def _remove_from_indices(self, delivery_tag: Any, pipe: Any = None) -> Any:
        """kombu's removal of an entry (ack, reject, restore), its holder record with it."""
        tag, _holder = split_delivery_tag(delivery_tag)
        return super()._remove_from_indices(tag, pipe).hdel(self.unacked_holder_key, tag)

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """Put a delivered message back on its queue: a hand-back or a closing channel's restore of one of our
        deliveries only while its entry is still that delivery's; kombu's own (a plain tag) whoever holds it."""
        base, holder = split_delivery_tag(tag)
        if holder is None:
            return super().restore_by_tag(base, client, leftmost)
        found: list[Any] = []

        def restore_transaction(pipe: Any) -> None:
            found.clear()
            current = pipe.hget(self.unacked_holder_key, base)
            if (bytes_to_str(current) if current else None) != holder:
                found.append(current)
                pipe.multi()  # nothing to do: an empty transaction (the WATCH is released)
                return
            raw = pipe.hget(self.unacked_key, base)
            pipe.multi()
            self._remove_from_indices(base, pipe)
            if raw:
                message, exchange, routing_key = loads(bytes_to_str(raw))
                self.channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore_transaction, self.unacked_key, self.unacked_holder_key)
        if found:
            self._left("hand-back" if leftmost else "restore", base, holder, found[0])

    def _closed(self, what: str, delivery_tag: Any) -> bool:
        """The outcome of a message delivered on a channel Celery has since closed (the broker connection was lost,
        e.g. Redis restarted, while the prompt ran): kombu would fail with no connection to use — fatally for the
        worker. The message is still in the unacked hash, so the visibility sweep redelivers it after the lease and
        its claim answers for it (done: skipped; handed back: run again). Logged, never fatal."""
        channel = self.channel
        if not getattr(channel, "closed", False) and getattr(channel, "connection", None) is not None:
            return False
        log.warning(
            "%s of delivery %s skipped: its channel closed with the broker connection; the message returns from "
            "the unacked hash after the visibility timeout", what, delivery_tag,
        )  # fmt: skip
        return True

    def restore_unacked_once(self, stderr: Any = None) -> Any:
        """kombu restores the delivered messages when the channel closes — also when Celery closes it because the
        broker connection was lost (Redis restarted), and then the restore itself finds no connection
        (``'NoneType' object has no attribute 'hostname'``), which Celery takes for an unrecoverable error: the
        worker process exited. Those messages are in the unacked hash, so the visibility sweep restores them after
        the lease anyway: a restore that cannot run now is logged, never fatal."""
        try:
            return super().restore_unacked_once(stderr)
        except Exception as exc:  # whatever kombu's restore hits with the broker gone; the sweep has the messages
            log.warning(
                "could not restore %d delivered message(s) as the broker connection closed (%s: %s): they return "
                "from the unacked hash after the visibility timeout",
                len(self._delivered), type(exc).__name__, exc,
            )  # fmt: skip
            return None

    #: Where the next sweep's :data:`_PRUNE` step goes on in the holder hash (0: from the start).
    _prune_cursor: int = 0

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            # Redis's time after a jump of it is re-based (visibility.py): a jump restores nothing by itself.
            ceil = visibility_now(client, self.unacked_index_key, self.visibility_timeout) - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(
                        self.unacked_index_key,
                        ceil,
                        0,
                        desc=True,
                        byscore=True,
                        offset=num and start,
                        num=num,
                        withscores=True,
                    )
                    for tag, _score in visible or []:
                        # Expired: restored whoever holds it (kombu's restore, its holder record dropped too).
                        kombu_redis.QoS.restore_by_tag(self, tag, client)
                    self._prune_cursor = int(
                        self._script(client, "prune", _PRUNE)(
                            keys=[self.unacked_key, self.unacked_holder_key],
                            args=[self._prune_cursor, 100],
                            client=client,
                        )
                    )
            except kombu_redis.MutexHeld:
                pass


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, popping into ``transit_key`` when it consumes ``transit_queue``.

    Priorities: kombu keeps one list per step (``queue`` for 0, the highest; ``queue`` + ``sep`` + N).
    Redis has no blocking move from several lists, so the pop alternates: an ``EVAL`` of :data:`_POP`
    moves the first message of the highest-priority non-empty list (non-blocking, atomic); when it finds
    none (and as a channel's first pop), a ``BLMOVE`` waits on the step-0 list for up to
    ``brpop_timeout`` (1 s), then the ``EVAL`` again. A busy queue costs one command per message, as
    before; the price is latency: a message pushed only onto a lower-priority list while the worker waits
    on the step-0 list is taken up to ``brpop_timeout`` later.
    """

    QoS = QoS
    Message = Message
    from_transport_options = (
        *kombu_redis.Channel.from_transport_options,
        "transit_key",
        "transit_queue",
        "unacked_holder_key",
        "delivery_holder",
        "affinity_key",
        "affinity_offers",
        "affinity_idle_ms",
        "affinity_block",
        KOMBU_KEEPALIVE_OPTION,
    )
    tcp_keepalive: dict[str, int] | None = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        return with_kombu_keepalive(super()._connparams(asynchronous), self.tcp_keepalive)

    #: HASH kombu delivery tag → the holder of the delivery recorded in ``unacked_key`` (KombuKeys.unacked_holder).
    _unacked_holder_key: str | None = None
    #: Who this channel's deliveries are held by (the worker's name; unset: host:pid).
    delivery_holder: str | None = None
    transit_key: str | None = None
    transit_queue: str | None = None
    #: This worker's host list, popped first, the offers ZSET, and how old an offer an idle pop steals (affinity.py).
    affinity_key: str | None = None
    affinity_offers: str | None = None
    affinity_idle_ms: str | None = None
    affinity_block: str | None = None  # '1': this worker offers next turns to itself (it blocks briefly)
    _transit_pending: str | None = None
    _transit_command: str = "EVAL"
    #: Block on the step-0 list next: at the start (a fresh worker waits on the queue, as it always did)
    #: and whenever the last EVAL found every list empty.
    _transit_block: bool = True
    #: Set by :meth:`QoS.append` once the delivery is in the unacked hash (then its transit copy may go).
    _transit_recorded: bool = False
    #: (pool, client) of the channel's synchronous commands (see :meth:`conn_or_acquire`).
    _command_client: tuple[Any, Any] | None = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu builds a new ``redis.Redis`` for every command outside the pop (the unacked record, the ack,
        the transit LREM: several per message, and a client's construction costs as much as its command).
        One client over the channel's pool serves them all — redis-py clients are thread-safe — and is
        built again when kombu replaces the pool (a reconnect)."""
        if client:
            yield client
            return
        pool = self.pool
        cached = self._command_client
        if cached is None or cached[0] is not pool:
            cached = self._command_client = (pool, self._create_client())
        yield cached[1]

    @property
    def unacked_holder_key(self) -> str:
        return self._unacked_holder_key or f"{self.unacked_key}_holder"

    @unacked_holder_key.setter
    def unacked_holder_key(self, value: str) -> None:
        self._unacked_holder_key = value

    _redis_clock: RedisClock | None = None

    def redis_now(self) -> float:
        """Redis's time now, cached (:class:`thinkfleet.broker.clock.RedisClock`). Visibility scores are not taken
        from it: they are read inside Redis, where a jump of its clock is re-based (visibility.py)."""
        if self._redis_clock is None:
            self._redis_clock = RedisClock()
        with self.conn_or_acquire() as client:
            return self._redis_clock.now(client)

    def _transit_source(self, queues: list[str]) -> str | None:
        if not self.transit_key or self.global_keyprefix or queues != [self.transit_queue]:
            return None
        return queues[0]

    def _brpop_start(self, timeout: Any = None) -> None:
        queues = list(self.active_queues)
        source = self._transit_source(queues)
        if source is None:
            self._transit_pending = None
            return super()._brpop_start(timeout)
        if timeout is None:
            timeout = self.brpop_timeout
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        self._transit_pending = source
        if self._transit_block:
            self._transit_command = "BLMOVE"
            timeout = block_timeout(self, timeout)  # shorter where next turns are offered to us (affinity.py)
            self.client.connection.send_command("BLMOVE", source, self.transit_key, "RIGHT", "LEFT", timeout or 0)
        else:
            self._transit_command = "EVAL"
            if self.affinity_key and self.affinity_offers:  # our host list first, step by step (affinity.POP)
                self.client.connection.send_command("EVAL", POP, *pop_keys(self, source))
                return
            lists = list(dict.fromkeys(self._q_for_pri(source, pri) for pri in sorted(self.priority_steps)))
            self.client.connection.send_command("EVAL", _POP, len(lists) + 1, *lists, self.transit_key)

    def _brpop_read(self, **options: Any) -> bool:
        source = self._transit_pending
        if source is None:
            return super()._brpop_read(**options)
        item = None
        settled = False  # recorded as unacked (or dropped as undecodable): only then may it leave transit
        try:
            try:
                item = self.client.parse_response(self.client.connection, self._transit_command, **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                self._transit_block = True
                raise
            # Found nothing with the EVAL: wait on the step-0 list next; after any message or a BLMOVE
            # timeout, look at every list again (highest priority first).
            self._transit_block = not item and self._transit_command == "EVAL"
            if isinstance(item, list):  # affinity.POP: {message, where it came from}
                AFFINITY.note_pop(int(item[1]))
                item = item[0]
            if not item:
                raise Empty()
            self._queue_cycle.rotate(source)
            try:
                message = envelope(item)
            except ValueError as exc:
                # kombu would raise out of its event loop and stop the worker ("Unrecoverable error").
                log.error("dropped an undecodable message from queue %s (%d bytes): %s", source, len(item), exc)
                settled = True
                raise Empty() from None
            # kombu records the delivery as unacked (QoS.append) before it calls the consumer; a failure there
            # (Redis errored mid-write) leaves the message in transit, where the sweep returns it to the queue.
            self._transit_recorded = False
            try:
                self.connection._deliver(message, source)
            except BaseException:
                settled = self._transit_recorded  # the consumer failed after the record: the unacked hash has it
                raise
            settled = True
            return True
        finally:
            self._in_poll = None
            self._transit_pending = None
            if item and settled:
                # Recorded as unacked by now (or refused): no longer in transit.
                with self.conn_or_acquire() as client:
                    client.lrem(self.transit_key, 1, item)
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()


def envelope(item: bytes) -> dict[str, Any]:
    """The kombu message in ``item``; ValueError when it is not one (garbage pushed onto the queue)."""
    message = loads(bytes_to_str(item))  # JSONDecodeError is a ValueError
    props = message.get("properties") if isinstance(message, dict) else None
    info = props.get("delivery_info") if isinstance(props, dict) else None
    if not (isinstance(info, dict) and "delivery_tag" in props and {"exchange", "routing_key"} <= info.keys()):
        raise ValueError("not a kombu message envelope")
    return message


class Transport(WatchedTransport, kombu_redis.Transport):
    Channel = Channel


#: Broker URL schemes the transit transport serves (kombu picks the SSL connection class from
#: ``broker_use_ssl``, which ``celery_app.broker_ssl`` sets for rediss://).
TRANSIT_SCHEMES = ("redis://", "rediss://", "sentinel://")


def uses_transit(broker_url: str | None) -> bool:
    return bool(broker_url) and str(broker_url).startswith(TRANSIT_SCHEMES)


def enable_transit(app: Celery, settings: Settings, worker: str) -> None:
    """Make this worker process pop through its transit list (call before the consumer connects)."""
    if not uses_transit(settings.broker_url):
        return
    options = dict(app.conf.broker_transport_options or {})
    options.update(transit_key=settings.keys.transit(worker), transit_queue=settings.queue, delivery_holder=worker)
    options.update(affinity_options(settings, worker))  # whatever the affinity setting: a host pops its host list
    options[WATCHDOG_OPTION] = stuck_bound_s(settings.lease_s, settings.consumer_stuck_s)  # broker/watchdog.py
    # Only worker processes pop through transit; Flower, the producer and `celery inspect` keep kombu's
    # stock redis transport (Flower's broker page only knows the stock transports).
    if str(settings.broker_url).startswith("sentinel://"):
        urls = str(app.conf.broker_url).split(";")  # kombu_broker's form: one sentinel:// URL per Sentinel
        options["sentinel_urls"] = urls
        app.conf.broker_url = urls[0]
        app.conf.broker_transport = SENTINEL_TRANSPORT
    else:
        app.conf.broker_transport = TRANSPORT
    app.conf.broker_transport_options = options
