"""Live workers that hold work and make no progress (workers/stall.py publishes it with each heartbeat): what
``producer status`` shows as **stalled**, with the worker's own reason (a commit failing at storage, an attempt
that hangs, a server gate closed while it holds prompts). A worker whose heartbeat expired is left out: its
messages come back after the lease, and it is no longer the fleet's."""

from __future__ import annotations

import json
from typing import Any

import redis

from thinkfleet.settings import Settings


def stalled_workers(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """[{worker, host, reason, held, commit_waiting, progress_age_s, gate}] of every live stalled worker, by name."""
    keys = settings.keys
    entries: dict[str, dict[str, Any]] = {}
    for raw_name, raw in client.hgetall(keys.workers).items():
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if isinstance(info, dict) and info.get("stalled"):  # older workers publish no progress
            entries[raw_name.decode(errors="replace")] = info
    if not entries:
        return []
    pipe = client.pipeline(transaction=False)
    for name in entries:
        pipe.exists(keys.heartbeat(name))
    alive = pipe.execute()
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
        for (name, info), live in sorted(zip(entries.items(), alive, strict=True))
        if live
    ]
