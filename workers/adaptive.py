"""The in-flight bound chosen from the server itself (``THINKFLEET_INFLIGHT_MODE=auto``, the default).

Throughput of a continuously batched server rises with its batch until the batch saturates the GPU
(a decode step costs a fixed part plus a part per request) or until its KV cache is full; past that,
SGLang retracts running requests (frees their KV and recomputes them later) and queues the rest, and
throughput falls. The bound is therefore "as many as the server can *run*, never more than its KV
holds": three signals the server reports while the job runs say where that is.

- **What it runs, and its KV** (``/v1/loads`` ``num_running_reqs``, ``num_waiting_reqs``,
  ``num_used_tokens`` / ``max_total_num_tokens``): while the server queues some of ours, or its KV is
  full (SGLang counts the evictable radix cache as free), what runs of ours is what it can run; the bound
  aims at a slow mean of that plus its spread and a short queue. While it takes all and the KV has room,
  the bound is offered more.
- **Retractions** (``sglang:num_retracted_requests_total`` from ``/metrics``): the KV overflowed at
  some peak; a storm (many in one interval) cuts the bound multiplicatively, as AIMD does on loss.
- **The server's own queue** (``num_waiting_reqs``): requests waiting there gain nothing (the server
  runs what it can) and only delay other hosts' work; above a small allowance the bound is cut to what
  runs.

A slower server (another tenant, thermal throttling) is *not* a signal to send less: its batch still
fills the same KV, and a smaller batch would only make it slower still (latency-based controllers such
as TCP Vegas back off here; this one does not). Another tenant that takes slots or KV shows as a queue
or a fuller pool, and the bound gives way within a few intervals.

:class:`InflightController` (workers/adaptive_control.py) is the pure decision — fed :class:`LoadSample` s
with the caller's clock, no wall clock, no I/O; its docstring says how the bound settles —;
:class:`ResizableLimiter` is the asyncio limit the request attempts acquire, and :class:`LoadWatcher` the task
that reads the server every ``interval`` and applies the decision. The controller's names are re-exported here.
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

from workers.adaptive_control import (
    DEFAULT_INTERVAL_S,
    REASON_KINDS,
    START_TOKENS_PER_REQUEST,
    ControllerConfig,
    InflightController,
    LoadSample,
    Move,
    ServerLimits,
)

log = logging.getLogger("thinkfleet.worker")

__all__ = [
    "DEFAULT_INTERVAL_S",
    "REASON_KINDS",
    "START_TOKENS_PER_REQUEST",
    "ControllerConfig",
    "InflightController",
    "LoadSample",
    "LoadWatcher",
    "Move",
    "NotServed",
    "ResizableLimiter",
    "ServerError",
    "ServerLimits",
    "bound_info",
    "inflight_watcher",
    "limits_from",
    "parse_kv_gauges",
    "parse_load",
    "parse_retractions",
]

#: ``/metrics`` counter of retracted requests (SGLang 0.5.9 metrics/collector.py, ``--enable-metrics``).
RETRACTIONS_METRIC = "sglang:num_retracted_requests_total"
_RETRACTIONS_RE = re.compile(r"^sglang:num_retracted_requests_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_USED_RE = re.compile(r"^sglang:num_used_tokens(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_POOL_RE = re.compile(r"^sglang:max_total_num_tokens(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
#: /v1/loads server errors in a row (while /get_load answers) after which the watcher reads /get_load for good.
V1_LOADS_FAILURES = 3


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


def parse_kv_gauges(metrics_text: str) -> tuple[int, int] | None:
    """(``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``) summed over their label sets (one per DP
    rank), None when either is not exported: the KV figures when only ``/get_load`` answers."""
    used = [float(v) for v in _USED_RE.findall(metrics_text)]
    pool = [float(v) for v in _POOL_RE.findall(metrics_text)]
    return (int(sum(used)), int(sum(pool))) if used and pool else None


def parse_retractions(metrics_text: str) -> int | None:
    """``sglang:num_retracted_requests_total`` summed over its label sets (None: not exported)."""
    values = _RETRACTIONS_RE.findall(metrics_text)
    return int(sum(float(v) for v in values)) if values else None


class NotServed(LookupError):
    """The server has no such endpoint (404): an older release, or ``/metrics`` without ``--enable-metrics``."""


class ServerError(RuntimeError):
    """The server answered an endpoint with a 5xx (it is up, the endpoint failed)."""

    def __init__(self, path: str, status: int) -> None:
        super().__init__(f"GET {path} -> {status}")
        self.status = status


@dataclass
class LoadWatcher:
    """Reads the server's load every ``interval_s`` and applies the controller's moves to the limiter.

    ``get_json`` / ``get_text`` are the worker's HTTP client calls; ``inflight`` counts this worker's
    requests at the server; ``on_move`` publishes a move (metrics, heartbeat info). Failed reads are
    skipped (the health gate owns outages); a missing ``/v1/loads`` falls back to ``/get_load``, and so
    does one that answers 5xx while ``/get_load`` answers (for good after V1_LOADS_FAILURES in a row), with
    the KV figures from ``/metrics`` then.
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
    _counter_seen: bool = False  # /metrics has shown the retraction counter's sample
    _v1_failures: int = 0  # /v1/loads server errors in a row while /get_load answered
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
        load = parse_load(await self._read_load())
        if load is None:
            return None
        running, waiting, used, pool = load
        text = None
        if self._metrics_ok:
            try:
                text = await self.get_text("/metrics")
            except NotServed:
                self._metrics_ok = False  # no --enable-metrics
            except Exception:
                pass  # this sample goes without a count (the controller then counts none)
        retractions = self._retractions(text)
        if used is None and text is not None:
            # /get_load has no KV figure; /metrics' gauges have (sglang:num_used_tokens, max_total_num_tokens)
            used, pool = parse_kv_gauges(text) or (None, pool)
        return LoadSample(
            t_s=self.clock(),
            inflight=self.inflight(),
            running=running,
            waiting=waiting,
            used_tokens=used,
            max_total_tokens=pool or self.controller.limits.max_total_num_tokens,
            retractions_total=retractions,
        )

    async def _read_load(self) -> Any:
        """The body of ``/v1/loads``, or of ``/get_load`` where that endpoint is missing or keeps failing."""
        if self._load_path == "/get_load":
            return await self.get_json("/get_load")
        try:
            body = await self.get_json("/v1/loads")
        except NotServed:
            self._load_path = "/get_load"  # a release without /v1/loads
            return await self.get_json("/get_load")
        except ServerError as exc:
            # A real 0.5.9 with --enable-metrics under FastAPI >= 0.12x answers /v1/loads 500 every time (its
            # status-code middleware cannot name the path of an included router; tests/real_sglang/
            # test_differential_loads.py). This read comes from /get_load; three in a row switch for good. A
            # server that is down fails /get_load too, and the read is skipped without counting.
            body = await self.get_json("/get_load")
            self._v1_failures += 1
            if self._v1_failures >= V1_LOADS_FAILURES:
                self._load_path = "/get_load"
                log.warning("/v1/loads keeps failing (%s) while /get_load answers: reading /get_load from now on", exc)
            return body
        self._v1_failures = 0
        return body

    def _retractions(self, text: str | None) -> int | None:
        """The retraction counter of this sample, from one source for good (two counters mixed would read as
        a storm): the server's ``/metrics``, or where it has none, our answers' meta_info."""
        retractions = None
        if self._metrics_ok and text is not None:
            retractions = parse_retractions(text)
            if retractions is not None:
                self._counter_seen = True
            elif self._counter_seen or not (self.row_retractions and self.row_retractions()):
                # 0.5.9 exports the counter only from its first retraction on (a labelled Prometheus counter
                # has no child before that; after a restart, none again): none yet.
                retractions = 0
            else:
                self._metrics_ok = False  # our answers were retracted and /metrics never showed it
        if not self._metrics_ok and self.row_retractions is not None:
            retractions = self.row_retractions()  # our answers' meta_info: later (at each end) and ours only
        return retractions

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
        if status >= 500:
            raise ServerError(path, status)
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
