"""Live workers whose host clock is off Redis's (each heartbeat carries the offset it measured: workers/lease.py):
what ``producer status`` warns about. Leases and visibility run on Redis's clock, so a skewed host loses nothing,
but the timestamps it writes are off by as much."""

from __future__ import annotations

import json
import re
from typing import Any

import redis

from thinkfleet.settings import Settings


def clock_warnings(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """Live workers (their heartbeats, workers/lease.py) whose host clock is off Redis's by more than
    ``clock_skew_warn_s``: {worker, host, pid, offset_s} (offset = host − Redis, measured at each beat)."""
    prefix = settings.keys.heartbeat("")
    out = []
    for raw_key in client.scan_iter(match=f"{_glob_escape(prefix)}*", count=1000):
        key = raw_key.decode(errors="replace")
        beat = _json_or_none(client.get(raw_key))
        if not isinstance(beat, dict):
            continue
        offset = beat.get("clock_offset_s")
        if isinstance(offset, int | float) and abs(offset) > settings.clock_skew_warn_s:
            worker = key[len(prefix) :]
            out.append({"worker": worker, "host": beat.get("host"), "pid": beat.get("pid"), "offset_s": offset})
    return sorted(out, key=lambda w: str(w["worker"]))


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _json_or_none(raw: bytes | None) -> Any:
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None
