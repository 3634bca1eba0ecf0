"""The info every live worker's heartbeat publishes (workers/lease.py writes it into the workers hash): what
``producer status`` reads of the fleet — in-flight bounds (producer/bounds.py), stalls (producer/stalls.py), closed
image-store gates (producer/image_gates.py). A worker whose heartbeat expired is left out: its messages come back
after the lease, and it is no longer the fleet's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import redis

from thinkfleet.settings import Settings


def live_worker_infos(
    client: redis.Redis, settings: Settings, wanted: Callable[[dict[str, Any]], object]
) -> list[tuple[str, dict[str, Any]]]:
    """(worker, info) of every live worker whose published info ``wanted`` accepts, by name (an info that is not a
    JSON object is skipped: an older or foreign writer)."""
    keys = settings.keys
    entries: dict[str, dict[str, Any]] = {}
    for raw_name, raw in client.hgetall(keys.workers).items():
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if isinstance(info, dict) and wanted(info):
            entries[raw_name.decode(errors="replace")] = info
    if not entries:
        return []
    pipe = client.pipeline(transaction=False)
    for name in entries:
        pipe.exists(keys.heartbeat(name))
    alive = pipe.execute()
    return [(name, info) for (name, info), live in sorted(zip(entries.items(), alive, strict=True)) if live]
