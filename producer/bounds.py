"""Each live worker's in-flight bound and why it last moved (workers/adaptive.py), from the workers hash
(the info every heartbeat writes, workers/lease.py); a worker whose heartbeat expired is left out."""

from __future__ import annotations

import json
from typing import Any

import redis

from thinkfleet.settings import Settings


def inflight_bounds(client: redis.Redis, settings: Settings) -> dict[str, dict[str, Any]]:
    """worker → {host, mode, bound, cap, reason} for every live worker that publishes its bound."""
    keys = settings.keys
    entries: dict[str, dict[str, Any]] = {}
    for raw_name, raw in client.hgetall(keys.workers).items():
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if isinstance(info, dict) and "inflight_bound" in info:  # older workers publish no bound
            entries[raw_name.decode(errors="replace")] = info
    if not entries:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in entries:
        pipe.exists(keys.heartbeat(name))
    alive = pipe.execute()
    return {
        name: {
            "host": info.get("host"),
            "mode": info.get("inflight_mode"),
            "bound": info.get("inflight_bound"),
            "cap": info.get("max_inflight"),
            "reason": info.get("inflight_reason"),
        }
        for (name, info), live in sorted(zip(entries.items(), alive, strict=True))
        if live
    }
