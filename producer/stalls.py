"""Live workers that hold work and make no progress (workers/stall.py publishes it with each heartbeat): what
``producer status`` shows as **stalled**, with the worker's own reason (a commit failing at storage, an attempt
that hangs, a server gate closed while it holds prompts). A worker whose heartbeat expired is left out: its
messages come back after the lease, and it is no longer the fleet's."""

from __future__ import annotations

from typing import Any

import redis

from producer.live_workers import live_worker_infos
from thinkfleet.settings import Settings


def stalled_workers(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """[{worker, host, reason, held, commit_waiting, progress_age_s, gate}] of every live stalled worker, by name."""
    live = live_worker_infos(client, settings, lambda info: info.get("stalled"))  # older workers publish none
    return [
        {
            "worker": name,
            "host": info.get("host"),
            "reason": str(info["stalled"]),
            "held": info.get("held"),
            "commit_waiting": info.get("commit_waiting"),
            "progress_age_s": info.get("progress_age_s"),
            "gate": info.get("gate"),
        }
        for name, info in live
    ]
