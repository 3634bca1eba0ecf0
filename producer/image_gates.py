"""Each live worker's closed image-store gates (workers/image_store.py): a store that host cannot read — not mounted
there, not a directory, a permission error — whose image prompts it hands back, from the info every heartbeat
writes (workers/lease.py); a worker whose heartbeat expired is left out."""

from __future__ import annotations

from typing import Any

import redis

from producer.live_workers import live_worker_infos
from thinkfleet.settings import Settings


def image_store_gates(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """[{worker, host, store, reason, since}] for every closed gate of a live worker, by worker then store."""

    def closed(info: dict[str, Any]) -> bool:
        return isinstance(info.get("image_store_gates"), dict) and bool(info["image_store_gates"])

    out = []
    for name, info in live_worker_infos(client, settings, closed):
        for store, gate in sorted(info["image_store_gates"].items()):
            gate = gate if isinstance(gate, dict) else {}
            found = {"worker": name, "host": info.get("host"), "store": store}
            out.append({**found, "reason": gate.get("reason"), "since": gate.get("since")})
    return out
