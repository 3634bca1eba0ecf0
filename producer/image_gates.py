"""Each live worker's closed image-store gates (workers/image_store.py): a store that host cannot read — not mounted
there, not a directory, a permission error — whose image prompts it hands back, from the info every heartbeat
writes (workers/lease.py); a worker whose heartbeat expired is left out."""

from __future__ import annotations

import json
from typing import Any

import redis

from thinkfleet.settings import Settings


def image_store_gates(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """[{worker, host, store, reason, since}] for every closed gate of a live worker, by worker then store."""
    keys = settings.keys
    entries: dict[str, dict[str, Any]] = {}
    for raw_name, raw in client.hgetall(keys.workers).items():
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if isinstance(info, dict) and isinstance(info.get("image_store_gates"), dict) and info["image_store_gates"]:
            entries[raw_name.decode(errors="replace")] = info
    if not entries:
        return []
    pipe = client.pipeline(transaction=False)
    for name in entries:
        pipe.exists(keys.heartbeat(name))
    alive = pipe.execute()
    out = []
    for (name, info), live in sorted(zip(entries.items(), alive, strict=True)):
        if not live:
            continue
        for store, gate in sorted(info["image_store_gates"].items()):
            gate = gate if isinstance(gate, dict) else {}
            found = {"worker": name, "host": info.get("host"), "store": store}
            out.append({**found, "reason": gate.get("reason"), "since": gate.get("since")})
    return out
