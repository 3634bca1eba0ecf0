"""Each live worker's in-flight bound and why it last moved (workers/adaptive.py), from the workers hash
(the info every heartbeat writes, workers/lease.py); a worker whose heartbeat expired is left out."""

from __future__ import annotations

from typing import Any

import redis

from producer.live_workers import live_worker_infos
from thinkfleet.settings import Settings


def inflight_bounds(client: redis.Redis, settings: Settings) -> dict[str, dict[str, Any]]:
    """worker → {host, mode, bound, cap, reason} for every live worker that publishes its bound."""
    live = live_worker_infos(client, settings, lambda info: "inflight_bound" in info)  # older workers publish none
    return {
        name: {
            "host": info.get("host"),
            "mode": info.get("inflight_mode"),
            "bound": info.get("inflight_bound"),
            "cap": info.get("max_inflight"),
            "reason": info.get("inflight_reason"),
        }
        for name, info in live
    }
