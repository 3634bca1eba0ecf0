"""Redis's clock for synchronous callers that want an estimate of it (``producer status``): ``TIME`` read at most
every few seconds and carried forward on the monotonic clock in between (immune to the host's clock being
stepped; drift over a few seconds is negligible), so a caller pays no round trip per reading.

Visibility scores are not taken from it: a delivery's score, a renewal and a restore sweep read ``TIME`` inside
their own Lua call (thinkfleet/broker/visibility.py), where a jump of Redis's clock since the last such step — a
failover to a replica whose clock differs — is re-based atomically; a cached reading could straddle a failover.
"""

from __future__ import annotations

import threading
import time
from typing import Any

#: Seconds between two reads of Redis ``TIME`` by one :class:`RedisClock`.
RESYNC_S = 5.0


class RedisClock:
    def __init__(self, resync_s: float = RESYNC_S) -> None:
        self.resync_s = resync_s
        self._base: float | None = None  # Redis time at the last read
        self._mono = 0.0  # monotonic time of that read (mid round trip)
        self._lock = threading.Lock()
        #: This host's clock minus Redis's at the last read (seconds).
        self.offset_s: float | None = None

    def now(self, client: Any) -> float:
        """Redis's current time (Unix seconds), ``client`` a synchronous redis-py client."""
        with self._lock:
            if self._base is None or time.monotonic() - self._mono >= self.resync_s:
                before, wall_before = time.monotonic(), time.time()
                seconds, micros = client.time()
                after, wall_after = time.monotonic(), time.time()
                self._base = float(seconds) + float(micros) / 1e6
                self._mono = (before + after) / 2
                self.offset_s = (wall_before + wall_after) / 2 - self._base
            return self._base + (time.monotonic() - self._mono)
