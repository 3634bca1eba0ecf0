"""The transit transport over a Sentinel-managed head (thinkfleet/redis_client.py's ``sentinel://`` URLs): the same
pop, ack emulation and delivery holders as thinkfleet/broker/transit.py, over kombu's Sentinel pool, whose
connections go to whichever Redis the Sentinels name the primary. kombu's stock ``sentinel://`` transport would drop
both for a worker. Apart from transit.py because only a Sentinel head loads kombu's Sentinel machinery.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

from thinkfleet.broker.transit import Channel


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

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        client = self.connection.client
        kept = client.alt  # read by kombu's pool for the Sentinels' addresses, and by nothing else after start
        client.alt = list(self.sentinel_urls or kept)
        try:
            return super()._sentinel_managed_pool(asynchronous)
        finally:
            client.alt = kept


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
