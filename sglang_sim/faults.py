"""Faults on demand: random per-call faults, a timed outage, and a slow start.

Times here are *wall* seconds (a client's timeouts and retries run on the wall clock, whatever the
simulator's ``time_scale``).

Per-call faults are chosen by hashing ``(fault_seed, key, n)`` where ``key`` is the call's rid (or its
input ids when the client sent no rid) and ``n`` counts earlier calls with that key. The choice is
therefore reproducible whatever order concurrent calls arrive in, and a retried rid draws afresh.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class Fault(StrEnum):
    NONE = "none"
    #: 503 with SGLang's queue-full body, before any work.
    UNAVAILABLE = "503"
    #: The work is done, headers and part of the body are sent, then the connection is closed.
    DROP = "drop"
    #: Never answers; the call ends when the client gives up.
    HANG = "hang"


@dataclass
class FaultConfig:
    fault_503_rate: float = 0.0
    fault_drop_rate: float = 0.0
    fault_hang_rate: float = 0.0
    fault_seed: int = 0
    #: Start an outage this many wall seconds after start (None = never).
    outage_at_s: float | None = None
    outage_duration_s: float = 30.0
    #: /health* answers 503 (and /generate waits) for this many wall seconds after start.
    slow_start_s: float = 0.0

    def __post_init__(self) -> None:
        rates = (self.fault_503_rate, self.fault_drop_rate, self.fault_hang_rate)
        if any(not 0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0 + 1e-9:
            raise ValueError("fault rates must each be in [0, 1] and sum to at most 1")
        if self.outage_duration_s < 0 or self.slow_start_s < 0:
            raise ValueError("outage_duration_s and slow_start_s must be >= 0")

    #: Fields that ``POST /control/faults`` may change at runtime.
    RUNTIME_FIELDS = ("fault_503_rate", "fault_drop_rate", "fault_hang_rate", "fault_seed")


class FaultInjector:
    def __init__(self, config: FaultConfig, wall_clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._wall = wall_clock
        self.started_at_s = wall_clock()
        self._seen: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._outage_until_s: float | None = None
        self._scheduled_outage_done = config.outage_at_s is None

    # -- per-call faults ----------------------------------------------------------------------------
    def choose(self, key: str) -> Fault:
        """The fault for this call (counted in ``injected`` unless NONE)."""
        n = self._seen[key]
        self._seen[key] += 1
        digest = hashlib.blake2b(f"{self.config.fault_seed}|{key}|{n}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "little") / 2**64
        cfg = self.config
        for fault, rate in (
            (Fault.UNAVAILABLE, cfg.fault_503_rate),
            (Fault.DROP, cfg.fault_drop_rate),
            (Fault.HANG, cfg.fault_hang_rate),
        ):
            if u < rate:
                self.injected[fault.value] += 1
                return fault
            u -= rate
        return Fault.NONE

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply ``POST /control/faults``; raises ValueError on unknown fields or bad values."""
        unknown = set(changes) - set(FaultConfig.RUNTIME_FIELDS)
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}; allowed: {FaultConfig.RUNTIME_FIELDS}")
        merged = {**asdict(self.config), **changes}
        self.config = FaultConfig(**merged)  # validates
        return self.describe()

    # -- outage and start ---------------------------------------------------------------------------
    def start_outage(self, duration_s: float) -> None:
        self._outage_until_s = self._wall() + max(0.0, duration_s)
        self.injected["outage"] += 1

    def end_outage(self) -> None:
        self._outage_until_s = None

    def scheduled_outage_due(self) -> bool:
        """True once, when ``outage_at_s`` has passed (the caller then starts the outage)."""
        if self._scheduled_outage_done or self.config.outage_at_s is None:
            return False
        if self._wall() - self.started_at_s >= self.config.outage_at_s:
            self._scheduled_outage_done = True
            return True
        return False

    def in_outage(self) -> bool:
        return self._outage_until_s is not None and self._wall() < self._outage_until_s

    def outage_left_s(self) -> float:
        if not self.in_outage():
            return 0.0
        assert self._outage_until_s is not None
        return self._outage_until_s - self._wall()

    def starting(self) -> bool:
        return self._wall() - self.started_at_s < self.config.slow_start_s

    def start_left_s(self) -> float:
        return max(0.0, self.config.slow_start_s - (self._wall() - self.started_at_s))

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self.config),
            "in_outage": self.in_outage(),
            "outage_left_s": round(self.outage_left_s(), 3),
            "starting": self.starting(),
        }
