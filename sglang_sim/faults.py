"""Faults on demand: random per-call faults, per-generation faults (NaN, abort) and a timed outage.

Times here are *wall* seconds (a client's timeouts and retries run on the wall clock, whatever the
simulator's ``time_scale``).

Per-call faults are chosen by hashing ``(fault_seed, key, n)`` where ``key`` is the call's rid (or its
input ids when the client sent no rid) and ``n`` counts earlier calls with that key. The choice is
therefore reproducible whatever order concurrent calls arrive in, and a retried rid draws afresh.
Per-generation faults draw the same way, per batch item, from their own stream.

- NaN (``nan_rate``): SGLang's ``Req._check_vocab_boundary_finish`` path — the sampler produced an
  id outside the vocabulary (NaN logits), the scheduler overwrites that *last* output id with a stop id
  and finishes ``{"type": "stop", "matched": "NaN happened"}``. See
  :func:`sglang_sim.content.nan_generation`.
- Abort (``abort_rate``): the scheduler finishes the request early with
  ``FINISH_ABORT(message, status_code, err_type)``; a non-streamed call then gets the HTTP error
  the tokenizer manager raises for that status (see :data:`ABORTS`).
- Bad output (``bad_output_rate``): a 200 answer that no real generation could be — one output id replaced
  by ``2**31`` (``bad_output_kind`` ``int32``, past every int32 column) or by the vocabulary size
  (``vocab``, the first id past the vocabulary), or a ``stop`` finish padded to ``max_new_tokens + 1`` ids
  (``overlong``). A buggy kernel or a corrupted response looks like this. Drawn *per prompt* (by its input
  ids), so every attempt of a chosen prompt is bad — a client's retries cannot cure it — unless
  ``bad_output_per_attempt`` draws per call like the other faults.
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
    #: Share of generations that end on SGLang's NaN path (stop early, last id overwritten by a stop id).
    nan_rate: float = 0.0
    #: Share of generations the scheduler aborts part-way, with ``abort_status_code``.
    abort_rate: float = 0.0
    #: 503 (running timeout), 500 (internal error) or 400 (bad request): see :data:`ABORTS`.
    abort_status_code: int = 503
    #: Share of prompts (by their input ids) whose 200 answers carry a bad output (see :data:`BAD_OUTPUT_KINDS`).
    bad_output_rate: float = 0.0
    #: ``int32`` (an id of 2**31), ``vocab`` (an id equal to the vocabulary size) or ``overlong`` (a stop finish
    #: with max_new_tokens + 1 ids).
    bad_output_kind: str = "int32"
    #: Draw the bad output per call (a retry may get a good answer) instead of per prompt (every attempt bad).
    bad_output_per_attempt: bool = False
    #: Each image expands into this many more tokens than its processor's rule says (at least 1): a server whose
    #: image processor counts otherwise (another preprocessor_config.json; sglang_sim/vision.py).
    image_token_skew: int = 0

    def __post_init__(self) -> None:
        rates = (self.fault_503_rate, self.fault_drop_rate, self.fault_hang_rate)
        if any(not 0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0 + 1e-9:
            raise ValueError("fault rates must each be in [0, 1] and sum to at most 1")
        generation_rates = (self.nan_rate, self.abort_rate)
        if any(not 0.0 <= r <= 1.0 for r in generation_rates) or sum(generation_rates) > 1.0 + 1e-9:
            raise ValueError("nan_rate and abort_rate must each be in [0, 1] and sum to at most 1")
        if not 0.0 <= self.bad_output_rate <= 1.0:
            raise ValueError("bad_output_rate must be in [0, 1]")
        if self.bad_output_kind not in BAD_OUTPUT_KINDS:
            raise ValueError(f"bad_output_kind must be one of {BAD_OUTPUT_KINDS}, got {self.bad_output_kind!r}")
        if self.abort_status_code not in ABORTS:
            raise ValueError(f"abort_status_code must be one of {sorted(ABORTS)}, got {self.abort_status_code}")
        if self.outage_duration_s < 0:
            raise ValueError("outage_duration_s must be >= 0")

    #: Fields that ``POST /control/faults`` may change at runtime.
    RUNTIME_FIELDS = (
        "fault_503_rate",
        "fault_drop_rate",
        "fault_hang_rate",
        "fault_seed",
        "nan_rate",
        "abort_rate",
        "abort_status_code",
        "bad_output_rate",
        "bad_output_kind",
        "bad_output_per_attempt",
        "image_token_skew",
    )


#: ``bad_output_kind``: what a bad answer carries (sglang_sim.generate._bad_output).
BAD_OUTPUT_KINDS = ("int32", "vocab", "overlong")


class GenerationFault(StrEnum):
    NONE = "none"
    NAN = "nan"
    ABORT = "abort"


@dataclass(frozen=True)
class Abort:
    """One ``FINISH_ABORT(message, status_code, err_type)`` the real scheduler raises with this status."""

    message: str
    status_code: int
    err_type: str | None

    def finish_reason(self) -> dict[str, Any]:
        """``FINISH_ABORT.to_json()`` (the same four keys in 0.5.9 and 0.5.23)."""
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": self.err_type}


#: The injected aborts, by status code, each as a real scheduler path builds it:
#: 503 — ``SGLANG_REQ_RUNNING_TIMEOUT`` (scheduler ``_abort_on_running_timeout`` / ``_poll_timeout_aborts``);
#: 500 — a grammar/sampling-backend failure (0.5.23 ``batch_result_processor``; err_type "InternalServerError");
#: 400 — ``Req.set_finish_with_abort`` (err_type "BadRequestError").
#: The tokenizer manager turns 500/503 into ``HTTPException`` → that status with SGLang's ErrorResponse
#: body, and 400 into ``ValueError`` → 400 ``{"error": {"message"}}``, in both 0.5.9 and 0.5.23.
ABORTS: dict[int, Abort] = {
    503: Abort("Request running timeout reached.", 503, None),
    500: Abort("Grammar accept_token failed: sglang-sim injected abort", 500, "InternalServerError"),
    400: Abort("Invalid request: sglang-sim injected abort", 400, "BadRequestError"),
}


class FaultInjector:
    def __init__(self, config: FaultConfig, wall_clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._wall = wall_clock
        self.started_at_s = wall_clock()
        self._seen: Counter[str] = Counter()
        self._seen_generation: Counter[str] = Counter()
        self._seen_bad: Counter[str] = Counter()
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

    def choose_generation(self, key: str) -> tuple[GenerationFault, float]:
        """The NaN/abort fault for one generation and a uniform draw in [0, 1) placing it in the output."""
        n = self._seen_generation[key]
        self._seen_generation[key] += 1
        digest = hashlib.blake2b(f"{self.config.fault_seed}|gen|{key}|{n}".encode(), digest_size=16).digest()
        u = int.from_bytes(digest[:8], "little") / 2**64
        where = int.from_bytes(digest[8:], "little") / 2**64
        cfg = self.config
        if u < cfg.nan_rate:
            return GenerationFault.NAN, where
        if u < cfg.nan_rate + cfg.abort_rate:
            return GenerationFault.ABORT, where
        return GenerationFault.NONE, where

    def choose_bad_output(self, prompt_key: str, call_key: str) -> float | None:
        """None, or (this answer is bad) a uniform draw in [0, 1) placing the bad id in the output. Per prompt
        (``prompt_key``: every call with these input ids draws the same) unless ``bad_output_per_attempt``
        (``call_key`` and its count, as the other faults)."""
        cfg = self.config
        if cfg.bad_output_rate <= 0:
            return None
        if cfg.bad_output_per_attempt:
            n = self._seen_bad[call_key]
            self._seen_bad[call_key] += 1
            key = f"{call_key}|{n}"
        else:
            key = prompt_key
        digest = hashlib.blake2b(f"{cfg.fault_seed}|bad|{key}".encode(), digest_size=16).digest()
        u = int.from_bytes(digest[:8], "little") / 2**64
        if u >= cfg.bad_output_rate:
            return None
        self.injected[f"bad_output:{cfg.bad_output_kind}"] += 1
        return int.from_bytes(digest[8:], "little") / 2**64

    @property
    def abort(self) -> Abort:
        return ABORTS[self.config.abort_status_code]

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

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self.config),
            "in_outage": self.in_outage(),
            "outage_left_s": round(self.outage_left_s(), 3),
        }
