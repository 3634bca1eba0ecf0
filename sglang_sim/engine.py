"""Timing model of a continuously batched server (SGLang's scheduler, reduced to what clients can see).

- At most ``max_running_requests`` requests are admitted; the rest wait FIFO (``schedule_policy``
  fcfs). A request that finds the waiting queue at ``max_queued_requests`` is rejected
  (:class:`QueueFullError`, which the server turns into SGLang's 503 "The request queue is full.").
  A request that finds a free slot is admitted at once (the real scheduler admits it on its next
  iteration, milliseconds later).
- An admitted request is first *prefilled*: its uncached prompt tokens cost ``1 / prefill_tok_s``
  seconds each. Prefill is FIFO and, as in SGLang's default (prefill batches run between decode
  batches), decoding pauses while it runs.
- Then it *decodes* at ``min(per_request_tok_s, decode_tok_s / n_decoding)`` tokens/s. Every decoding
  request advances at the same rate, so progress is kept as one shared counter ``v`` (tokens each
  request has received since start) and a request finishes when ``v`` reaches ``v_start + length``:
  a heap of those targets makes each event O(log n) however many requests run or wait.

The engine is clock-agnostic: :meth:`Engine.advance_to` moves simulated time forward and fires
callbacks. The server calls it from one ticking asyncio task (and on each arrival); tests can drive it
with a manual clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from sglang_sim.cache import DEFAULT_BLOCK_TOKENS, DEFAULT_CAPACITY_BLOCKS, PrefixCache

#: Abort message of a request removed from the waiting queue (tokenizer_manager._handle_abort_req).
ABORT_IN_WAITING_QUEUE = "Abort in waiting queue"
#: Abort message of a running request (schedule_batch.FINISH_ABORT default).
ABORT_RUNNING = "Aborted"


@dataclass
class EngineConfig:
    """Capacity of the simulated GPU server. Rates are tokens per *simulated* second."""

    # -- admission ----------------------------------------------------------------------------------
    max_running_requests: int = 256
    #: None = unbounded waiting queue (SGLang's default).
    max_queued_requests: int | None = None

    # -- speed (defaults: the seed's server, ~860 output tok/s at 150 in flight) ----------------------
    decode_tok_s: float = 860.0
    per_request_tok_s: float = 40.0
    prefill_tok_s: float = 20_000.0

    # -- prefix cache -------------------------------------------------------------------------------
    cache_block_tokens: int = DEFAULT_BLOCK_TOKENS
    cache_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS

    #: ``gen_throughput`` is averaged over this much simulated time.
    throughput_window_s: float = 20.0

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0 (or None for unbounded)")
        for name in ("decode_tok_s", "per_request_tok_s", "prefill_tok_s", "throughput_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


class QueueFullError(Exception):
    """The waiting queue is at ``max_queued_requests``."""


class RequestState(Enum):
    NEW = "new"
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class SimRequest:
    """One generation as the engine sees it: a prompt length and how many tokens it will produce."""

    def __init__(
        self,
        rid: str,
        input_ids: Sequence[int],
        output_len: int,
        on_finish: Callable[[SimRequest], None],
        on_progress: Callable[[SimRequest, int], None] | None = None,
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.prompt_tokens = len(input_ids)
        self.output_len = output_len
        self.on_finish = on_finish
        self.on_progress = on_progress
        self.state = RequestState.NEW
        self.cached_tokens = 0
        self.prefill_left_tokens = 0.0
        self.v_start = 0.0
        #: Tokens generated when the request finished (== output_len unless aborted).
        self.generated_tokens = 0
        self.reported_tokens = 0  # last count sent to on_progress
        self.arrival_s = 0.0
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        #: None for a normal finish; SGLang's abort message otherwise.
        self.abort_message: str | None = None
        self.aborted_while_waiting = False

    @property
    def e2e_latency_s(self) -> float:
        return (self.finish_s or self.arrival_s) - self.arrival_s


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    #: Tokens of finished (incl. aborted) requests, counted at finish.
    generation_tokens_total: int = 0
    #: Tokens decoded so far, counted continuously (fractional between events).
    decoded_tokens: float = 0.0
    requests_finished: int = 0
    requests_aborted: int = 0
    queue_full_rejections: int = 0
    peak_running: int = 0
    _samples: deque[tuple[float, float]] = field(default_factory=deque, repr=False)


class Engine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self.now_s = clock()
        self.cache = PrefixCache(config.cache_block_tokens, config.cache_capacity_blocks)
        self.stats = EngineStats()
        self._waiting: deque[SimRequest] = deque()
        self._running: set[SimRequest] = set()
        self._prefill: deque[SimRequest] = deque()
        self._heap: list[tuple[float, int, SimRequest]] = []
        self._order = itertools.count()
        self._decoding = 0
        self._v = 0.0
        self._streams: set[SimRequest] = set()
        self.stats._samples.append((self.now_s, 0.0))

    # -- observation --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def rate_per_request_tok_s(self, n_decoding: int) -> float:
        """Decode speed of each of ``n_decoding`` requests."""
        return min(self.config.per_request_tok_s, self.config.decode_tok_s / max(1, n_decoding))

    def progress(self, req: SimRequest) -> int:
        """Tokens ``req`` has generated so far."""
        if req.state is RequestState.DECODE:
            return min(req.output_len, int(self._v - req.v_start + 1e-6))
        if req.state is RequestState.DONE:
            return req.generated_tokens
        return 0

    def gen_throughput_tok_s(self) -> float:
        """Output tokens per simulated second over the last ``throughput_window_s``."""
        samples = self.stats._samples
        if not samples:
            return 0.0
        t_old, tok_old = samples[0]
        if self.now_s <= t_old:
            return 0.0
        return (self.stats.decoded_tokens - tok_old) / (self.now_s - t_old)

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        """Admit or queue ``req`` now. Raises :class:`QueueFullError` if it must wait and cannot."""
        self.advance()
        if len(self._running) < self.config.max_running_requests and not self._waiting:
            req.arrival_s = self.now_s
            self._admit(req)
            return
        limit = self.config.max_queued_requests
        if limit is not None and len(self._waiting) + 1 > limit:
            self.stats.queue_full_rejections += 1
            raise QueueFullError("The request queue is full.")
        req.arrival_s = self.now_s
        req.state = RequestState.WAITING
        self._waiting.append(req)

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's scheduler abort: every request whose rid starts with ``rid`` (or all)."""
        return self._abort_where(lambda req: abort_all or req.rid.startswith(rid))

    def cancel(self, req: SimRequest) -> bool:
        """Abort exactly ``req`` (a client that went away). False if it had already finished."""
        return self._abort_where(lambda other: other is req) > 0

    def _abort_where(self, matches: Callable[[SimRequest], bool]) -> int:
        self.advance()
        victims = [req for req in self._waiting if matches(req)]
        if victims:
            self._waiting = deque(req for req in self._waiting if not matches(req))
        for req in victims:
            req.aborted_while_waiting = True
            self._finish(req, ABORT_IN_WAITING_QUEUE)
        running = [req for req in self._running if matches(req)]
        for req in running:
            self._finish(req, ABORT_RUNNING)
        self._admit_waiting()
        return len(victims) + len(running)

    # -- time ---------------------------------------------------------------------------------------
    def advance(self) -> None:
        self.advance_to(self._clock())

    def advance_to(self, t_s: float) -> None:
        """Run the server until simulated time ``t_s``, finishing requests on the way."""
        while self.now_s < t_s:
            if self._prefill:
                if not self._step_prefill(t_s):
                    break
                continue
            while self._heap and self._heap[0][2].state is not RequestState.DECODE:
                heapq.heappop(self._heap)  # aborted while decoding
            if not self._heap:
                self.now_s = t_s
                break
            if not self._step_decode(t_s):
                break
        self._report_progress()
        self._sample_throughput()

    def _step_prefill(self, t_s: float) -> bool:
        """Work on the head of the prefill queue; False once ``t_s`` is reached."""
        head = self._prefill[0]
        if head.state is not RequestState.PREFILL:
            self._prefill.popleft()  # aborted before its prefill finished
            return True
        need_s = head.prefill_left_tokens / self.config.prefill_tok_s
        if self.now_s + need_s > t_s:
            head.prefill_left_tokens -= (t_s - self.now_s) * self.config.prefill_tok_s
            self.now_s = t_s
            return False
        self.now_s += need_s
        self._prefill.popleft()
        head.first_token_s = self.now_s
        if head.output_len <= 0:
            self._finish(head, None)
            self._admit_waiting()
            return True
        head.state = RequestState.DECODE
        head.v_start = self._v
        self._decoding += 1
        heapq.heappush(self._heap, (self._v + head.output_len, next(self._order), head))
        return True

    def _step_decode(self, t_s: float) -> bool:
        """Decode until the next finish or ``t_s``; False once ``t_s`` is reached."""
        n = self._decoding
        rate = self.rate_per_request_tok_s(n)
        v_next = self._heap[0][0]
        dt_s = (v_next - self._v) / rate
        if self.now_s + dt_s > t_s:
            dt_s = t_s - self.now_s
            self._v += rate * dt_s
            self.stats.decoded_tokens += rate * dt_s * n
            self.now_s = t_s
            return False
        self.now_s += max(0.0, dt_s)
        self.stats.decoded_tokens += rate * max(0.0, dt_s) * n
        self._v = max(self._v, v_next)
        tolerance = 1e-9 * max(1.0, self._v)
        while self._heap and self._heap[0][0] <= self._v + tolerance:
            _, _, req = heapq.heappop(self._heap)
            if req.state is RequestState.DECODE:
                self._finish(req, None)
        self._admit_waiting()
        return True

    # -- bookkeeping --------------------------------------------------------------------------------
    def _admit(self, req: SimRequest) -> None:
        req.state = RequestState.PREFILL
        req.admitted_s = self.now_s
        req.cached_tokens = self.cache.match_and_insert(req.input_ids)
        req.prefill_left_tokens = float(req.prompt_tokens - req.cached_tokens)
        self._running.add(req)
        self._prefill.append(req)
        if req.on_progress is not None:
            self._streams.add(req)
        self.stats.prompt_tokens_total += req.prompt_tokens
        self.stats.cached_tokens_total += req.cached_tokens
        self.stats.peak_running = max(self.stats.peak_running, len(self._running))

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running_requests:
            self._admit(self._waiting.popleft())

    def _finish(self, req: SimRequest, abort_message: str | None) -> None:
        if req.state is RequestState.DECODE:
            self._decoding -= 1
        req.generated_tokens = req.output_len if abort_message is None else self.progress(req)
        req.state = RequestState.DONE
        req.finish_s = self.now_s
        req.abort_message = abort_message
        self._running.discard(req)
        self._streams.discard(req)
        self.stats.generation_tokens_total += req.generated_tokens
        if abort_message is None:
            self.stats.requests_finished += 1
        else:
            self.stats.requests_aborted += 1
        req.on_finish(req)

    def _report_progress(self) -> None:
        for req in list(self._streams):
            done = self.progress(req)
            if done > req.reported_tokens and req.on_progress is not None:
                req.reported_tokens = done
                req.on_progress(req, done)

    def _sample_throughput(self) -> None:
        samples = self.stats._samples
        window_s = self.config.throughput_window_s
        if self.now_s - samples[-1][0] >= window_s / 16:
            samples.append((self.now_s, self.stats.decoded_tokens))
        while len(samples) > 1 and samples[1][0] <= self.now_s - window_s:
            samples.popleft()
