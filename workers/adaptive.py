"""The in-flight bound chosen from the server itself (``THINKFLEET_INFLIGHT_MODE=auto``, the default).

Throughput of a continuously batched server rises with its batch until the batch saturates the GPU
(a decode step costs a fixed part plus a part per request) or until its KV cache is full; past that,
SGLang retracts running requests (frees their KV and recomputes them later) and queues the rest, and
throughput falls. The bound is therefore "as many as the server can *run*, never more than its KV
holds": three signals the server reports while the job runs say where that is.

- **KV usage** (``/v1/loads`` ``num_used_tokens`` / ``max_total_num_tokens``): tokens a running request
  holds are measured as ``used / running``; the bound aims at ``usage_target`` of the pool (a
  gradient step, as Netflix's concurrency-limits' Gradient2 does with latency: ``bound * target /
  measured``, moved part way with a dead band, so a steady server holds a steady bound).
- **Retractions** (``sglang:num_retracted_requests_total`` from ``/metrics``): the KV overflowed at
  some peak — the usage target is lowered a step (it creeps back up after a quiet minute), and a storm
  (many in one interval) also cuts the bound multiplicatively, as AIMD does on loss.
- **The server's own queue** (``num_waiting_reqs``): requests waiting there gain nothing (the server
  runs what it can) and only delay other hosts' work; above a small allowance the bound is cut to what
  runs.

A slower server (another tenant, thermal throttling) is *not* a signal to send less: its batch still
fills the same KV, and a smaller batch would only make it slower still (latency-based controllers such
as TCP Vegas back off here; this one does not). Another tenant that takes slots or KV shows as a queue
or a fuller pool, and the bound gives way within a few intervals.

:class:`InflightController` is the pure decision (fed :class:`LoadSample` s with the caller's clock;
no wall clock, no I/O), :class:`ResizableLimiter` the asyncio limit the request attempts acquire, and
:class:`LoadWatcher` the task that reads the server every ``interval`` and applies the decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("thinkfleet.worker")

__all__ = [
    "REASON_KINDS",
    "ControllerConfig",
    "InflightController",
    "LoadSample",
    "LoadWatcher",
    "Move",
    "NotServed",
    "ResizableLimiter",
    "ServerLimits",
    "bound_info",
    "inflight_watcher",
    "limits_from",
    "parse_load",
    "parse_retractions",
]

#: Seconds between two reads of the server's load (and at most one decision per read).
DEFAULT_INTERVAL_S = 5.0
#: Tokens a reasoning request holds in the KV cache on average over its life (a 1-2k prompt and a
#: 6-8k output, half of it generated): the start is ``max_total_num_tokens`` / this.
START_TOKENS_PER_REQUEST = 8192
#: ``/metrics`` counter of retracted requests (SGLang 0.5.9 metrics/collector.py, ``--enable-metrics``).
RETRACTIONS_METRIC = "sglang:num_retracted_requests_total"
_RETRACTIONS_RE = re.compile(r"^sglang:num_retracted_requests_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


@dataclass(frozen=True)
class ServerLimits:
    """What the server says it can hold (``/server_info``; None: it did not say)."""

    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    context_len: int | None = None


@dataclass(frozen=True)
class LoadSample:
    """One read of the server's load, at the caller's time ``t_s`` (monotonic or simulated seconds)."""

    t_s: float
    #: This worker's requests at the server (running or waiting there).
    inflight: int
    #: The server's running and waiting requests (every client's).
    running: int
    waiting: int
    #: KV slots in use and the pool's size (None: not reported).
    used_tokens: int | None = None
    max_total_tokens: int | None = None
    #: Requests the server has retracted since it started (a counter; None: not reported).
    retractions_total: int | None = None


#: Why the bound moved, as few kinds (the Prometheus label; ``reason`` has the figures).
REASON_KINDS = (
    "fixed",  # THINKFLEET_INFLIGHT_MODE=fixed: the bound is THINKFLEET_MAX_INFLIGHT
    "server_limits",  # (re)started from /server_info
    "server_full",  # the server queues some of ours: what it runs plus a short queue
    "server_takes_all",  # the server admits everything: offer more
    "server_slots",  # max_running_requests
    "cap",  # THINKFLEET_MAX_INFLIGHT
    "retraction_storm",
)


@dataclass(frozen=True)
class Move:
    """A change of the bound and why (what ``producer status`` and Grafana show)."""

    t_s: float
    old: int
    new: int
    reason: str
    kind: str = "server_limits"


@dataclass
class ControllerConfig:
    """The controller's constants (the defaults are the ones bench/bench_adaptive.py measures)."""

    #: One decision per this many seconds of the caller's clock (the samples in between are averaged).
    interval_s: float = DEFAULT_INTERVAL_S
    min_bound: int = 1
    # -- moves ----------------------------------------------------------------------------------------------
    #: Share of the distance to the target covered per decision, and the largest rise (share of the bound).
    gain: float = 0.5
    max_rise_share: float = 0.15
    #: Targets within this share of the bound leave it alone (no dithering on noise).
    deadband_share: float = 0.05
    #: What the server can run is averaged over this many seconds, plus this many standard deviations.
    smoothing_s: float = 300.0
    margin_sd: float = 1.5
    #: A fast mean (over ``fast_smoothing_s``) this share away from the slow one for this many decisions
    #: in a row is a lasting change: the slow mean jumps to it (a tenant arrived, the server restarted).
    fast_smoothing_s: float = 20.0
    shift_share: float = 0.35
    shift_intervals: int = 4
    #: Retractions in one interval beyond ``max(storm_min, storm_share * running)`` are a storm: x storm_cut.
    storm_min: int = 5
    storm_share: float = 0.10
    storm_cut: float = 0.85
    #: Requests of ours the server should hold ready in its queue: ``max(queue_min, queue_share * running)``.
    queue_min: int = 4
    queue_share: float = 0.08
    #: The bound rises only while this share of it is in use (no rise on a bound the work never fills).
    saturated_share: float = 0.9

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.min_bound < 1:
            raise ValueError("interval_s must be > 0 and min_bound >= 1")
        if not 0 < self.gain <= 1 or not 0 < self.storm_cut < 1:
            raise ValueError("gain must be in (0, 1] and storm_cut in (0, 1)")


@dataclass
class _Window:
    """The samples of the interval being decided on."""

    started_s: float
    n: int = 0
    inflight: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    #: Ours running, per sample: the queue is FIFO over every client's requests, so ours wait in it in
    #: proportion to our share (summed per sample: a mean of ratios, not a ratio of means across a move).
    ours_running: float = 0.0
    used: float = 0.0
    used_n: int = 0
    capacity: int | None = None

    def add(self, s: LoadSample) -> None:
        self.n += 1
        self.inflight += s.inflight
        self.running += s.running
        self.waiting += s.waiting
        at_server = s.running + s.waiting
        self.ours_running += min(s.inflight, s.inflight * s.running / at_server) if at_server else 0.0
        if s.used_tokens is not None:
            self.used += s.used_tokens
            self.used_n += 1
        if s.max_total_tokens:
            self.capacity = s.max_total_tokens


class InflightController:
    """The bound: started from the server's limits, moved by its load, never above ``cap``.

    Deterministic: the same limits and samples give the same moves. :meth:`reset` at start and after a
    server restart; :meth:`observe` per read of the load; ``bound``, ``reason`` and ``moves`` say where it is.
    """

    def __init__(self, cap: int, config: ControllerConfig | None = None, history: int = 64) -> None:
        if cap < 1:
            raise ValueError("cap must be >= 1")
        self.cap = cap
        self.config = config or ControllerConfig()
        self.limits = ServerLimits()
        self.bound = cap
        self.reason = "not started: the cap (THINKFLEET_MAX_INFLIGHT)"
        self.kind = "cap"
        self.moves: deque[Move] = deque(maxlen=history)
        self._window: _Window | None = None
        self._retractions_seen: int | None = None
        self._reset = False
        self._estimate: float | None = None  # requests of ours the server can run (EWMA) and its variance
        self._variance = 0.0
        self._fast = 0.0
        self._shifted = 0
        self._rising = 0

    # -- what the caller tells it ------------------------------------------------------------------
    def reset(self, limits: ServerLimits, t_s: float) -> Move | None:
        """Start from the server's limits: ``min(cap, max_running_requests)`` (a new or restarted server)."""
        self.limits = limits
        self._reset = True
        self._window = None
        self._retractions_seen = None
        self._estimate = None
        start, kind, why = self.cap, "cap", f"the cap {self.cap} (the server reports no limits)"
        parts = []
        if limits.max_running_requests is not None:
            start = min(start, limits.max_running_requests)
            parts.append(f"max_running_requests={limits.max_running_requests}")
        if limits.max_total_num_tokens:
            # What its KV holds of requests of START_TOKENS_PER_REQUEST: a start near the KV bound, so
            # the first minutes do not fill the server's queue (requests sent are never taken back).
            start = min(start, max(1, limits.max_total_num_tokens // START_TOKENS_PER_REQUEST))
            parts.append(f"max_total_num_tokens={limits.max_total_num_tokens} (/{START_TOKENS_PER_REQUEST})")
        if parts:
            kind, why = "server_limits", f"server limits: {', '.join(parts)}, cap {self.cap}"
        return self._move(t_s, start, why, kind, force=True)

    def observe(self, sample: LoadSample) -> Move | None:
        """Take one read of the load; once an interval is complete, decide (a :class:`Move`, or None).
        Reads before the first :meth:`reset` (the server's limits not read yet) are ignored."""
        if not self._reset:
            return None
        window = self._window
        if window is None:
            self._window = window = _Window(sample.t_s)
            self._note_retractions(sample)  # the counter's baseline
        window.add(sample)
        if sample.t_s - window.started_s < self.config.interval_s:
            return None
        retracted = self._note_retractions(sample)
        self._window = _Window(sample.t_s)
        return self._decide(window, retracted, sample.t_s)

    # -- the decision --------------------------------------------------------------------------------
    def _note_retractions(self, sample: LoadSample) -> int:
        """Retractions since the last decision (0 when unknown; a counter that went back is a restart)."""
        total = sample.retractions_total
        if total is None:
            return 0
        seen, self._retractions_seen = self._retractions_seen, total
        if seen is None or total < seen:
            return 0
        return total - seen

    def _decide(self, w: _Window, retracted: int, t_s: float) -> Move | None:
        c, bound = self.config, self.bound
        inflight, running, waiting = w.inflight / w.n, w.running / w.n, w.waiting / w.n
        if retracted > max(c.storm_min, c.storm_share * max(running, 1.0)):
            self._estimate = None  # what the server held is no guide now
            new = int(bound * c.storm_cut)
            why = f"retraction storm: {retracted} retracted in {c.interval_s:g}s"
            return self._move(t_s, new, why, "retraction_storm")
        target, kind, why = self._target(w, inflight, running, waiting)
        if retracted:
            why += f"; {retracted} retracted (no storm)"
        if abs(target - bound) <= max(1.0, c.deadband_share * bound):
            return None
        if target > bound:
            step = min(max(1.0, c.max_rise_share * bound), c.gain * (target - bound))
            return self._move(t_s, round(bound + max(1.0, step)), why, kind)
        return self._move(t_s, round(bound - max(1.0, c.gain * (bound - target))), why, kind)

    def _target(self, w: _Window, inflight: float, running: float, waiting: float) -> tuple[float, str, str]:
        """What the server can run of ours (smoothed, plus its spread) and a short queue; and why.

        SGLang's own admission keeps the batch inside its KV (its reservation, then retraction of the
        youngest requests), so the best bound is "what it can run, plus a few ready to admit the moment
        a slot or KV frees": fewer leaves the batch short, more only lengthens its queue. What it can
        run swings with the lengths of the requests it holds (a minute's mean-reverting swing of ±30%
        on a KV-bound server), so the bound follows a mean over ``smoothing_s`` plus ``margin_sd``
        standard deviations instead of every swing; a lasting change moves the mean within a minute."""
        c = self.config
        others = max(0.0, running + waiting - inflight)  # other clients' requests at the same server
        ours_running = w.ours_running / w.n
        allowance = max(c.queue_min, c.queue_share * ours_running)
        full = waiting > 0.5 * allowance  # it holds some back: what runs is what it can run
        if not full and inflight < c.saturated_share * self.bound:
            # It runs all we send and we send less than the bound (too few prompts, between jobs): that says
            # nothing of its capacity, so neither the estimate nor the bound moves.
            return float(self.bound), "server_takes_all", f"the work does not fill the bound ({inflight:.0f})"
        seen = ours_running if full else inflight + max(allowance, c.max_rise_share * inflight)
        self._track(seen, rising=not full)
        assert self._estimate is not None
        can_run = self._estimate + c.margin_sd * self._variance**0.5
        usage = f", KV {w.used / w.used_n / w.capacity:.0%}" if w.capacity and w.used_n else ""
        load = f"{running:.0f} running, {waiting:.0f} waiting{usage}"
        kind, name = ("server_full", "full") if full else ("server_takes_all", "takes all")
        candidates = [(can_run + allowance, kind, f"server {name}: {load}; runs ~{can_run:.0f} of ours")]
        candidates.append((float(self.cap), "cap", f"the cap {self.cap}"))
        slots = self.limits.max_running_requests
        if slots is not None:
            why = f"server slots: max_running_requests={slots}"
            candidates.append((slots + allowance - others, "server_slots", why))
        return min(candidates, key=lambda candidate: candidate[0])

    def _track(self, seen: float, rising: bool) -> None:
        """Fold one interval's "runs this many of ours" into the slow mean and variance, and into a fast
        mean; a fast mean away from the slow one by ``shift_share`` for ``shift_intervals`` decisions is a
        lasting change (a tenant, a restart with other limits), not a swing: the slow mean jumps to it."""
        c = self.config
        if self._estimate is None:
            self._estimate, self._variance, self._fast, self._shifted = seen, 0.0, seen, 0
            return
        # It took everything twice in a row: its capacity is at least that, so the mean rises at the fast pace
        # (one interval with an empty queue happens in a steady KV-bound server too: that one is not enough).
        self._rising = self._rising + 1 if rising else 0
        fast = self._rising >= 2 and seen > self._estimate
        alpha = min(1.0, c.interval_s / (c.fast_smoothing_s if fast else c.smoothing_s))
        delta = seen - self._estimate
        self._estimate += alpha * delta
        self._variance = (1 - alpha) * (self._variance + alpha * delta * delta)
        self._fast += min(1.0, c.interval_s / c.fast_smoothing_s) * (seen - self._fast)
        away = abs(self._fast - self._estimate) > c.shift_share * max(self._estimate, 1.0)
        self._shifted = self._shifted + 1 if away else 0
        if self._shifted >= c.shift_intervals:
            self._estimate, self._variance, self._shifted = self._fast, 0.0, 0

    def _move(self, t_s: float, new: int, reason: str, kind: str, force: bool = False) -> Move | None:
        new = max(self.config.min_bound, min(self.cap, new))
        if new == self.bound and not force:
            return None
        move = Move(t_s, self.bound, new, reason, kind)
        self.bound, self.reason, self.kind = new, reason, kind
        self.moves.append(move)
        return move


# -- the asyncio side ------------------------------------------------------------------------------------
class ResizableLimiter:
    """An asyncio semaphore whose limit can change while requests hold it (FIFO; a lower limit takes
    effect as holders release, nothing is cancelled)."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def held(self) -> int:
        return self._held

    def resize(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._wake()

    async def acquire(self) -> None:
        if self._held < self._limit and not self._waiters:
            self._held += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted just as it was cancelled: hand the slot on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self._held -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._held < self._limit:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self._held += 1
            waiter.set_result(None)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def parse_load(body: Any) -> tuple[int, int, int | None, int | None] | None:
    """(running, waiting, used tokens, pool size) from ``/v1/loads`` (0.5.9: ``loads[]`` per DP rank) or
    the older ``/get_load`` list (``num_reqs`` counts running + waiting; its ``num_tokens`` adds the
    waiting requests' tokens, so it is no KV figure). None: neither shape."""
    if isinstance(body, dict) and isinstance(body.get("loads"), list):
        loads = [d for d in body["loads"] if isinstance(d, dict)]
        if not loads:
            return None
        running = sum(int(d.get("num_running_reqs") or 0) for d in loads)
        waiting = sum(int(d.get("num_waiting_reqs") or 0) for d in loads)
        used = sum(int(d.get("num_used_tokens") or 0) for d in loads)
        pool = sum(int(d.get("max_total_num_tokens") or 0) for d in loads)
        return running, waiting, used, pool or None
    if isinstance(body, list) and body and all(isinstance(d, dict) for d in body):
        waiting = sum(int(d.get("num_waiting_reqs") or 0) for d in body)
        total = sum(int(d.get("num_reqs") or 0) for d in body)
        return max(0, total - waiting), waiting, None, None
    return None


def parse_retractions(metrics_text: str) -> int | None:
    """``sglang:num_retracted_requests_total`` summed over its label sets (None: not exported)."""
    values = _RETRACTIONS_RE.findall(metrics_text)
    return int(sum(float(v) for v in values)) if values else None


class NotServed(LookupError):
    """The server has no such endpoint (404): an older release, or ``/metrics`` without ``--enable-metrics``."""


@dataclass
class LoadWatcher:
    """Reads the server's load every ``interval_s`` and applies the controller's moves to the limiter.

    ``get_json`` / ``get_text`` are the worker's HTTP client calls; ``inflight`` counts this worker's
    requests at the server; ``on_move`` publishes a move (metrics, heartbeat info). Failed reads are
    skipped (the health gate owns outages); a missing ``/v1/loads`` falls back to ``/get_load``.
    """

    controller: InflightController
    limiter: ResizableLimiter
    get_json: Callable[[str], Awaitable[Any]]
    get_text: Callable[[str], Awaitable[str]]
    inflight: Callable[[], int]
    clock: Callable[[], float]
    on_move: Callable[[Move], None] = lambda move: None
    #: Retractions our answers reported (meta_info): the signal when /metrics has no counter.
    row_retractions: Callable[[], int] | None = None
    _load_path: str = "/v1/loads"
    _metrics_ok: bool = True
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def reset(self, limits: ServerLimits) -> None:
        """A new or restarted server: start again from its limits."""
        self._apply(self.controller.reset(limits, self.clock()))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="inflight-controller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        # Reads come a few times per decision so one busy moment does not decide alone.
        period_s = self.controller.config.interval_s / 4
        while True:
            await asyncio.sleep(period_s)
            try:
                sample = await self.read()
            except Exception as exc:  # the server may be restarting: the gate handles that
                log.debug("load read failed: %s", exc)
                continue
            try:
                if sample is not None:
                    self._apply(self.controller.observe(sample))
            except Exception:  # a bug here must not freeze the bound where it is without a word
                log.exception("in-flight controller failed on %s", sample)

    async def read(self) -> LoadSample | None:
        """One sample (None: the server's answer was no load). A failed read raises (the caller skips it)."""
        try:
            load = parse_load(await self.get_json(self._load_path))
        except NotServed:
            if self._load_path == "/get_load":
                raise
            self._load_path = "/get_load"  # a release without /v1/loads
            load = parse_load(await self.get_json(self._load_path))
        if load is None:
            return None
        # One source of the retraction counter for good (two counters mixed would read as a storm).
        retractions = None
        if self._metrics_ok:
            try:
                retractions = parse_retractions(await self.get_text("/metrics"))
                if retractions is None:
                    self._metrics_ok = False  # /metrics without the counter: it is not exported
            except NotServed:
                self._metrics_ok = False  # no --enable-metrics
            except Exception:
                pass  # this sample goes without a count (the controller then counts none)
        if not self._metrics_ok and self.row_retractions is not None:
            retractions = self.row_retractions()  # our answers' meta_info: later (at each end) and ours only
        running, waiting, used, pool = load
        return LoadSample(
            t_s=self.clock(),
            inflight=self.inflight(),
            running=running,
            waiting=waiting,
            used_tokens=used,
            max_total_tokens=pool or self.controller.limits.max_total_num_tokens,
            retractions_total=retractions,
        )

    def _apply(self, move: Move | None) -> None:
        if move is None:
            return
        self.limiter.resize(move.new)
        if move.old != move.new:
            log.info("in-flight bound %d -> %d: %s", move.old, move.new, move.reason)
        self.on_move(move)


# -- wiring (workers/runtime.py) ---------------------------------------------------------------------------
def limits_from(info: Any) -> ServerLimits:
    """The limits a :class:`workers.sglang.ServerInfo` read (None: nothing read yet)."""
    if info is None:
        return ServerLimits()
    return ServerLimits(
        getattr(info, "effective_max_running_requests", None),
        getattr(info, "max_total_num_tokens", None),
        getattr(info, "context_length", None),
    )


def inflight_watcher(
    settings: Any,
    client: Any,
    limiter: ResizableLimiter,
    inflight: Callable[[], int],
    on_move: Callable[[Move], None],
    row_retractions: Callable[[], int] | None = None,
) -> LoadWatcher | None:
    """The worker's :class:`LoadWatcher` over its SGLang client (None with ``inflight_mode=fixed``)."""
    if settings.inflight_mode != "auto":
        return None

    async def get(path: str) -> bytes:
        status, body = await client.get(path)
        if status == 404:
            raise NotServed(path)
        if status != 200:
            raise RuntimeError(f"GET {path} -> {status}")
        return body

    async def get_json(path: str) -> Any:
        return json.loads(await get(path))

    async def get_text(path: str) -> str:
        return (await get(path)).decode("utf-8", "replace")

    controller = InflightController(settings.max_inflight, ControllerConfig(interval_s=settings.inflight_interval_s))
    return LoadWatcher(controller, limiter, get_json, get_text, inflight, time.monotonic, on_move, row_retractions)


def bound_info(watcher: LoadWatcher | None, settings: Any) -> dict[str, Any]:
    """What the heartbeat publishes of the bound (``producer status`` shows it)."""
    if watcher is None:
        return {"inflight_mode": "fixed", "inflight_bound": settings.max_inflight, "inflight_reason": "fixed"}
    c = watcher.controller
    return {"inflight_mode": "auto", "inflight_bound": c.bound, "inflight_reason": c.reason, "inflight_kind": c.kind}
