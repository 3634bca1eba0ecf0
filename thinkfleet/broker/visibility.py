"""Visibility of delivered messages: what keeps a long generation from being redelivered while it runs.

kombu's Redis transport scores each unacknowledged message with its delivery time in ``unacked_index`` and
restores it to the queue once ``visibility_timeout`` (= ``lease_s``) has passed; it never renews that score.
A live worker's lease keeper (workers/lease.py) re-scores the delivery tags it holds at every heartbeat.
Every score — kombu's at delivery and in its restore sweep (``thinkfleet.broker.transit.QoS``), the lease
keeper's — is Redis ``TIME``, never a host's clock: a host whose clock runs ahead would otherwise restore
live workers' messages early, and one behind would renew its own into the future.
"""

from __future__ import annotations

from thinkfleet.broker.keys import KombuKeys


def unacked_index_key(prefix: str) -> str:
    """kombu's ``unacked_index`` sorted set under ``prefix``."""
    return KombuKeys(prefix).unacked_index
