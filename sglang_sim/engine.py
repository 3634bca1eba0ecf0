"""Timing model of a continuously batched server (SGLang's scheduler, reduced to what clients can see).

- At most ``max_running_requests`` requests are admitted; the rest wait FIFO (``schedule_policy``
  fcfs). A request that finds the waiting queue at ``max_queued_requests`` is rejected
  (:class:`QueueFullError`, which the server turns into SGLang's 503 "The request queue is full.").
  A request that finds a free slot is admitted at once (the real scheduler admits it on its next
  iteration, milliseconds later).
- An admitted request is first *prefilled*: its uncached prompt tokens cost ``1 / prefill_tok_s``
  seconds each. Prefill is FIFO and, as in SGLang's default (prefill batches run between decode
  batches), decoding pauses while it runs.
- Then it *decodes* at ``min(per_request_tok_s, decode_tok_s / n_decoding)`` tokens/s, or, with
  ``step_fixed_s`` set, one token per step of ``step_fixed_s + n_decoding * step_per_request_s`` (a
  fixed part — the weights read once per step — and a per-request part: throughput ``n / step`` rises
  with the batch and saturates at ``1 / step_per_request_s``). Every decoding
  request advances at the same rate, so progress is kept as one shared counter ``v`` (tokens each
  request has received since start) and a request finishes when ``v`` reaches ``v_start + length``:
  a heap of those targets makes each event O(log n) however many requests run or wait.

With ``kv_capacity_tokens`` set, the KV pool is enforced as SGLang 0.5.9's scheduler does: a running
request holds its prompt and every token it generated; a waiting request is admitted only if its
input plus ``min(max_new_tokens, 4096)`` fits beside the reservation of the running ones
(``min(left, 4096) * new_token_ratio`` each; the ratio starts at 0.7 and decays per decode step to
0.098, ``schedule_policy.PrefillAdder``); when the next decode step finds fewer free slots than
decoding requests, the request with the fewest output tokens is *retracted* (``retract_decode``): its
KV is freed, it goes to the back of the waiting queue, and on re-admission its whole prompt and its
generated tokens are prefilled again; the ratio is reset to ``(decoded + 20 n) / sum(max_new_tokens)``.

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

    # -- step cost (None: the per-request cap model above) --------------------------------------------
    #: A decode step of n requests takes ``step_fixed_s + n * step_per_request_s`` simulated seconds.
    step_fixed_s: float | None = None
    step_per_request_s: float = 0.0

    # -- KV cache (None: unlimited, nothing is ever retracted) ----------------------------------------
    #: Token slots of the KV pool (SGLang's ``max_total_num_tokens``); /server_info reports it when set.
    kv_capacity_tokens: int | None = None
    #: SGLANG_INIT_NEW_TOKEN_RATIO (x schedule_conservativeness), SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR,
    #: SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, SGLANG_RETRACT_DECODE_STEPS.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    retract_decode_steps: int = 20

    # -- a server that gets slower (another tenant, thermal throttling) -------------------------------
    #: From simulated second ``slowdown_at_s`` on, every decode step and prefill takes
    #: ``slowdown_factor`` times as long.
    slowdown_at_s: float | None = None
    slowdown_factor: float = 1.0

    #: ``gen_throughput`` is averaged over this much simulated time.
    throughput_window_s: float = 20.0

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0 (or None for unbounded)")
        for name in ("decode_tok_s", "per_request_tok_s", "prefill_tok_s", "throughput_window_s", "slowdown_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.step_fixed_s is not None and (self.step_fixed_s < 0 or self.step_per_request_s < 0):
            raise ValueError("step_fixed_s and step_per_request_s must be >= 0")
        if self.step_fixed_s is not None and self.step_fixed_s + self.step_per_request_s <= 0:
            raise ValueError("a decode step must take some time (step_fixed_s + step_per_request_s > 0)")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 2:
            raise ValueError("kv_capacity_tokens must be >= 2 (or None for unlimited)")


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
        max_new_tokens: int | None = None,
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        #: The ids it will have produced (set by the caller that knows them): cached with the prompt at finish.
        self.output_ids: Sequence[int] | None = None
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
        #: The request's ``max_new_tokens`` (None: unknown, taken as at least 4096 more than it produces).
        self.max_new_tokens = max_new_tokens
        #: Times the scheduler retracted it (``meta_info`` ``num_retractions``), and the tokens it had
        #: generated when last retracted (kept: they are prefilled again, not sampled again).
        self.retractions = 0
        self.resumed_tokens = 0
        self._epoch = 0  # bumped on retraction: heap entries of an earlier decode are stale

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
    #: Retractions so far, and the input / output tokens they released (recomputed on re-admission).
    retractions: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    #: Requests retracted by the last retraction (SGLang's ``num_retracted_reqs`` gauge).
    last_retracted_reqs: int = 0
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
        self._short_budget: set[SimRequest] = set()  # running requests that may reserve less than the clip
        self._prefill: deque[SimRequest] = deque()
        self._heap: list[tuple[float, int, int, SimRequest]] = []
        self._order = itertools.count()
        self._decoding = 0
        self._v = 0.0
        self._streams: set[SimRequest] = set()
        self.stats._samples.append((self.now_s, 0.0))
        # KV held by running requests: prompts (plus, while prefilling, a resumed request's output) in
        # _kv_held; a decoding request's output is v - v_start, summed as decoding * v - _sum_v_start.
        self._kv_held = 0.0
        self._sum_v_start = 0.0
        self.new_token_ratio = min(1.0, config.init_new_token_ratio)
        self._min_ratio = min(1.0, self.new_token_ratio * config.min_new_token_ratio_factor)
        self._ratio_decay = (self.new_token_ratio - self._min_ratio) / max(1, config.new_token_ratio_decay_steps)
        #: Called with each retracted request (the server counts them per rid for meta_info).
        self.on_retract: Callable[[SimRequest], None] | None = None

    # -- observation --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def used_tokens(self) -> float:
        """KV slots the running requests hold (prompts and generated tokens)."""
        return self._kv_held + self._decoding * self._v - self._sum_v_start

    def waiting_tokens(self) -> int:
        """Input tokens of the waiting requests (what ``/get_load`` adds to ``num_tokens``)."""
        return sum(req.prompt_tokens + req.resumed_tokens for req in self._waiting)

    def slowdown(self) -> float:
        """How many times longer a step takes now than at start (``slowdown_factor`` once due)."""
        at = self.config.slowdown_at_s
        return self.config.slowdown_factor if at is not None and self.now_s >= at else 1.0

    def rate_per_request_tok_s(self, n_decoding: int) -> float:
        """Decode speed of each of ``n_decoding`` requests."""
        config, n = self.config, max(1, n_decoding)
        if config.step_fixed_s is not None:
            return 1.0 / ((config.step_fixed_s + n * config.step_per_request_s) * self.slowdown())
        return min(config.per_request_tok_s, config.decode_tok_s / n) / self.slowdown()

    def progress(self, req: SimRequest) -> int:
        """Tokens ``req`` has generated so far."""
        if req.state is RequestState.DECODE:
            return min(req.output_len, int(self._v - req.v_start + 1e-6))
        if req.state in (RequestState.WAITING, RequestState.PREFILL):
            return req.resumed_tokens
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
        fits = self._kv_room() >= self._kv_need(req)
        if len(self._running) < self.config.max_running_requests and not self._waiting and fits:
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
        at = self.config.slowdown_at_s
        if at is not None and self.now_s < at < t_s:
            self.advance_to(at)  # the slowdown starts exactly then, not at the end of a long step
        while self.now_s < t_s:
            if self._prefill:
                if not self._step_prefill(t_s):
                    break
                continue
            while self._heap and self._stale(self._heap[0]):
                heapq.heappop(self._heap)  # aborted or retracted while decoding
            if not self._heap:
                self.now_s = t_s
                break
            if not self._step_decode(t_s):
                break
        if self._waiting and self.config.kv_capacity_tokens is not None:
            self._admit_waiting()  # the decayed new_token_ratio may leave room now
        self._report_progress()
        self._sample_throughput()

    def _step_prefill(self, t_s: float) -> bool:
        """Work on the head of the prefill queue; False once ``t_s`` is reached."""
        head = self._prefill[0]
        if head.state is not RequestState.PREFILL:
            self._prefill.popleft()  # aborted before its prefill finished
            return True
        prefill_tok_s = self.config.prefill_tok_s / self.slowdown()
        need_s = head.prefill_left_tokens / prefill_tok_s
        if self.now_s + need_s > t_s:
            head.prefill_left_tokens -= (t_s - self.now_s) * prefill_tok_s
            self.now_s = t_s
            return False
        self.now_s += need_s
        self._prefill.popleft()
        if head.first_token_s is None:
            head.first_token_s = self.now_s
        if head.output_len <= head.resumed_tokens:
            self._finish(head, None)
            self._admit_waiting()
            return True
        head.state = RequestState.DECODE
        # A resumed request's output moves from _kv_held to the shared counter's share.
        head.v_start = self._v - head.resumed_tokens
        self._kv_held -= head.resumed_tokens
        self._sum_v_start += head.v_start
        self._decoding += 1
        target = head.v_start + head.output_len
        heapq.heappush(self._heap, (target, next(self._order), head._epoch, head))
        return True

    def _step_decode(self, t_s: float) -> bool:
        """Decode until the next finish or ``t_s``; False once ``t_s`` is reached."""
        n = self._decoding
        rate = self.rate_per_request_tok_s(n)
        v_next = self._heap[0][0]
        dt_s = (v_next - self._v) / rate
        full_s = self._time_to_kv_full_s(n, rate)
        if full_s is not None and full_s < dt_s and self.now_s + full_s <= t_s:
            self._decode_for(full_s, rate, n)
            self._retract()
            return True
        if self.now_s + dt_s > t_s:
            self._decode_for(t_s - self.now_s, rate, n)
            self.now_s = t_s
            return False
        self._decode_for(max(0.0, dt_s), rate, n)
        self._v = max(self._v, v_next)
        tolerance = 1e-9 * max(1.0, self._v)
        while self._heap and self._heap[0][0] <= self._v + tolerance:
            entry = heapq.heappop(self._heap)
            if not self._stale(entry):
                self._finish(entry[3], None)
        self._admit_waiting()
        return True

    def _decode_for(self, dt_s: float, rate: float, n: int) -> None:
        self.now_s += dt_s
        self._v += rate * dt_s
        self.stats.decoded_tokens += rate * dt_s * n
        # One decode step is one token per request: the ratio decays per token of the shared counter.
        self.new_token_ratio = max(self._min_ratio, self.new_token_ratio - self._ratio_decay * rate * dt_s)

    @staticmethod
    def _stale(entry: tuple[float, int, int, SimRequest]) -> bool:
        req = entry[3]
        return req.state is not RequestState.DECODE or req._epoch != entry[2]

    # -- KV pool ------------------------------------------------------------------------------------
    def _time_to_kv_full_s(self, n: int, rate: float) -> float | None:
        """Simulated seconds until the next decode step lacks a slot per request (None: never)."""
        capacity = self.config.kv_capacity_tokens
        if capacity is None or n < 2:  # SGLang always keeps one request
            return None
        room = capacity - self.used_tokens - n
        return max(0.0, room) / (n * rate)

    def _reserve(self, req: SimRequest) -> float:
        """Tokens PrefillAdder keeps for a running request's future output."""
        clip = self.config.clip_max_new_tokens
        left = clip if req.max_new_tokens is None else max(0, req.max_new_tokens - self.progress(req))
        return min(left, clip) * self.new_token_ratio

    def _kv_room(self) -> float:
        """Free KV slots beyond the running requests' reservation (infinite without a KV budget)."""
        capacity = self.config.kv_capacity_tokens
        if capacity is None:
            return float("inf")
        # Only a request whose budget ends within 4096 tokens of its output can reserve less than the
        # clip: the others are counted, not visited (this runs on every tick while requests wait).
        clip = self.config.clip_max_new_tokens
        reserved = clip * self.new_token_ratio * (len(self._running) - len(self._short_budget))
        reserved += sum(self._reserve(req) for req in self._short_budget)
        return capacity - self.used_tokens - reserved

    def _kv_need(self, req: SimRequest) -> float:
        """What admitting ``req`` takes: its input (prompt + resumed output) and up to 4096 new tokens."""
        if self.config.kv_capacity_tokens is None:
            return 0.0
        clip = self.config.clip_max_new_tokens
        left = clip if req.max_new_tokens is None else max(0, req.max_new_tokens - req.resumed_tokens)
        return req.prompt_tokens + req.resumed_tokens + min(left, clip)

    def _retract(self) -> None:
        """``retract_decode``: free the requests with the fewest output tokens until a step fits."""
        capacity = self.config.kv_capacity_tokens
        assert capacity is not None
        decoding = [req for req in self._running if req.state is RequestState.DECODE]
        # rid breaks ties: the running set iterates in id order, and a run must not depend on memory addresses.
        decoding.sort(key=lambda req: (self.progress(req), -req.prompt_tokens, req.rid), reverse=True)
        retracted = 0
        while len(decoding) > 1 and (retracted == 0 or capacity - self.used_tokens < len(decoding)):
            self._retract_one(decoding.pop())
            retracted += 1
        decoded = sum(self.progress(req) for req in decoding)
        clip = self.config.clip_max_new_tokens
        max_new = sum(
            (self.progress(req) + clip) if req.max_new_tokens is None else req.max_new_tokens for req in decoding
        )
        self.new_token_ratio = min(1.0, (decoded + self.config.retract_decode_steps * len(decoding)) / (max_new + 1))
        self.stats.last_retracted_reqs = retracted

    def _retract_one(self, req: SimRequest) -> None:
        done = self.progress(req)
        self._decoding -= 1
        self._sum_v_start -= req.v_start
        self._kv_held -= req.prompt_tokens
        self._running.discard(req)
        self._short_budget.discard(req)
        req._epoch += 1
        req.retractions += 1
        req.resumed_tokens = done
        req.state = RequestState.WAITING
        self._waiting.append(req)
        self.stats.retractions += 1
        self.stats.retracted_input_tokens += req.prompt_tokens
        self.stats.retracted_output_tokens += done
        if self.on_retract is not None:
            self.on_retract(req)

    # -- bookkeeping --------------------------------------------------------------------------------
    def _admit(self, req: SimRequest) -> None:
        resumed = req.state is RequestState.WAITING and req.retractions > 0
        req.state = RequestState.PREFILL
        cached = self.cache.match_and_insert(req.input_ids)
        # A resumed request recomputes its prompt and its output: retract_decode frees them without
        # caching, and under the KV pressure that retracted it the prompt's radix-tree copy is what gets
        # evicted first.
        uncached = req.prompt_tokens + req.resumed_tokens if resumed else req.prompt_tokens - cached
        req.prefill_left_tokens = float(uncached)
        self._kv_held += req.prompt_tokens + req.resumed_tokens
        self._running.add(req)
        if req.max_new_tokens is not None and req.max_new_tokens - req.output_len < self.config.clip_max_new_tokens:
            self._short_budget.add(req)
        self._prefill.append(req)
        if req.on_progress is not None:
            self._streams.add(req)
        if not resumed:  # what the client sees (and SGLang counts) is the first admission's
            req.admitted_s = self.now_s
            req.cached_tokens = cached
            self.stats.prompt_tokens_total += req.prompt_tokens
            self.stats.cached_tokens_total += req.cached_tokens
        self.stats.peak_running = max(self.stats.peak_running, len(self._running))

    def _admit_waiting(self) -> None:
        room = self._kv_room()
        while self._waiting and len(self._running) < self.config.max_running_requests:
            head = self._waiting[0]
            need = self._kv_need(head)
            if need > room and self._running:  # an idle server admits what it can hold at all
                break
            self._admit(self._waiting.popleft())
            room -= need

    def _finish(self, req: SimRequest, abort_message: str | None) -> None:
        req.generated_tokens = req.output_len if abort_message is None else self.progress(req)
        if req.state is RequestState.DECODE:
            self._decoding -= 1
            self._sum_v_start -= req.v_start
            self._kv_held -= req.prompt_tokens
        elif req.state is RequestState.PREFILL:
            self._kv_held -= req.prompt_tokens + req.resumed_tokens
        req.state = RequestState.DONE
        req.finish_s = self.now_s
        req.abort_message = abort_message
        self._running.discard(req)
        self._short_budget.discard(req)
        self._streams.discard(req)
        self.stats.generation_tokens_total += req.generated_tokens
        if abort_message is None:
            self.stats.requests_finished += 1
            if req.output_ids is not None:  # cache_finished_req: prompt + output (overlap scheduler: every id's KV)
                self.cache.insert([*req.input_ids, *req.output_ids])
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
