"""The transit transport over a Sentinel-managed head (thinkfleet/redis_client.py's ``sentinel://`` URLs): the same
pop, ack emulation and delivery holders as thinkfleet/broker/transit.py, over kombu's Sentinel pool, whose
connections go to whichever Redis the Sentinels name the primary. kombu's stock ``sentinel://`` transport would drop
both for a worker. Apart from transit.py because only a Sentinel head loads kombu's Sentinel machinery.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.sentinel import SentinelConnectionPool

from thinkfleet.broker.transit import Channel
from thinkfleet.broker.watchdog import WatchedTransport
from thinkfleet.redis_client import (
    KOMBU_KEEPALIVE_OPTION,
    RecheckedSentinelPool,
    SentinelConnection,
    SentinelSSLConnection,
    with_kombu_keepalive,
)


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The transit channel over a Sentinel-managed primary: kombu's Sentinel pool (connections go to whichever
    Redis the Sentinels name the primary), this module's pop, ack emulation and delivery holders. kombu's stock
    ``sentinel://`` transport would drop both for a worker.

    The worker's broker URL names one Sentinel and ``sentinel_urls`` all of them: given kombu's ``a;b;c`` form, a
    reconnect *switches* to the next URL and takes its scheme for the transport (kombu ``Connection.switch``), so
    the first failover would have put the worker on the stock transport. The pool still asks every Sentinel."""

    from_transport_options = tuple(
        dict.fromkeys(
            (*Channel.from_transport_options, *kombu_redis.SentinelChannel.from_transport_options, "sentinel_urls")
        )
    )
    sentinel_urls: list[str] | None = None
    #: Connections that ask the Sentinels for the primary on every reconnect, a command's retries included (kombu's
    #: and redis-py's reopen the socket to the address they had: a frozen primary's).
    connection_class = SentinelConnection
    connection_class_ssl = SentinelSSLConnection

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        client = self.connection.client
        kept = client.alt  # read by kombu's pool for the Sentinels' addresses, and by nothing else after start
        client.alt = list(self.sentinel_urls or kept)
        try:
            pool = super()._sentinel_managed_pool(asynchronous)
        finally:
            client.alt = kept
        return rechecked(pool)


def rechecked(pool: Any) -> Any:
    """kombu's Sentinel pool made the state clients' (thinkfleet/redis_client.py ``RecheckedSentinelPool``): it asks
    the Sentinels who the primary is at most every second when a command takes a connection, not only when one is
    opened, and reconnects a connection still on a primary that was failed over. A frozen primary that was replaced
    keeps its sockets open and, once woken, answers reads as a replica: kombu's own pool would keep the channel's
    command connections on it. (The pop's one connection is opened again after kombu drops it — a timeout, an
    overdue reply — and then asks the Sentinels.) kombu builds the pool itself, so its class is swapped: the subclass
    only adds methods and class attributes."""
    if type(pool) is SentinelConnectionPool:
        pool.__class__ = RecheckedSentinelPool
    return pool


class SentinelTransport(WatchedTransport, kombu_redis.SentinelTransport):
    Channel = SentinelChannel


class PublisherChannel(kombu_redis.SentinelChannel):
    """kombu's stock Sentinel channel — for every process that does not consume through transit: the producer's
    publisher, Flower, ``celery inspect`` — with the same connections as :class:`SentinelChannel`: each reconnect
    asks the Sentinels, and the pool drops connections to a primary that was failed over. kombu's own kept a pooled
    publisher connection on a frozen primary, which once woken (a primary in its own eyes until the Sentinels
    reconfigure it) took the next publish and lost it in its resync."""

    connection_class = SentinelConnection
    connection_class_ssl = SentinelSSLConnection
    from_transport_options = (*kombu_redis.SentinelChannel.from_transport_options, KOMBU_KEEPALIVE_OPTION)
    tcp_keepalive: dict[str, int] | None = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        return with_kombu_keepalive(super()._connparams(asynchronous), self.tcp_keepalive)

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        return rechecked(super()._sentinel_managed_pool(asynchronous))


class PublisherTransport(kombu_redis.SentinelTransport):
    Channel = PublisherChannel
