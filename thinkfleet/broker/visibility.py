"""Visibility of delivered messages: what keeps a long generation from being redelivered while it runs.

kombu's Redis transport scores each unacknowledged message with its delivery time in ``unacked_index`` and
restores it to the queue once ``visibility_timeout`` (= ``lease_s``) has passed; it never renews that score.
A live worker's lease keeper (workers/lease.py) re-scores the delivery tags it holds with :func:`renew`.
"""

from __future__ import annotations

from typing import Any

from thinkfleet.broker.keys import KombuKeys


def unacked_index_key(prefix: str) -> str:
    """kombu's ``unacked_index`` sorted set under ``prefix``."""
    return KombuKeys(prefix).unacked_index


def renew(pipe: Any, unacked_index_key: str, tags: list[str], now: float) -> None:
    """Queue on ``pipe`` (sync or asyncio) the re-scoring of ``tags`` to ``now``: ``ZADD XX``, so a tag
    acked meanwhile is not added back."""
    if tags:
        pipe.zadd(unacked_index_key, dict.fromkeys(tags, now), xx=True)
