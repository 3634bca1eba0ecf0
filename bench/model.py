"""An exact, event-driven model of N continuously batched servers fed from one queue.

It uses the simulator's decode law (sglang_sim/engine.py): each of a server's ``n`` running requests
decodes at ``min(per_request_tok_s, decode_tok_s / n)`` tokens per second, so one shared progress
counter per server and a heap of finish targets make every event O(log n). Prefill is an optional
pause of ``prompt_tokens / prefill_tok_s`` per admission (the simulator stalls decode while it runs).

It is the zero-overhead ideal: a freed slot is refilled at the same instant from a global FIFO queue.
Knobs model what a real fleet does differently:

- ``reserve``: each host also holds up to this many messages in a local FIFO, as a Celery worker with
  ``bound + reserve`` pool threads and prefetch 1 does; a reserved message can only start on its host.
- ``hedge_below``: once the global queue (and the host's reserve) is empty, a host with fewer than this
  many requests running starts a copy of the oldest un-hedged request running elsewhere; the first
  copy to finish wins and the other is aborted (its slot freed).

Used for the tail analysis and the 88,088-prompt projection (bench_fleet.py); validated against the
measured in-process pool client.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: The seed's server (sglang_sim.engine.EngineConfig defaults).
DECODE_TOK_S = 860.0
PER_REQUEST_TOK_S = 40.0
#: The seed's output lengths: lognormal, median 646, sigma 1.25 (sglang_sim.content.ContentConfig).
LENGTH_MEDIAN_TOKENS = 646.0
LENGTH_SIGMA = 1.25
MIN_LENGTH_TOKENS = 8
MAX_NEW_TOKENS = 10_240


def seed_lengths(n: int, seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS) -> np.ndarray:
    """Output lengths drawn from the seed's distribution, capped at ``max_new_tokens``."""
    rng = np.random.default_rng(seed)
    drawn = np.round(rng.lognormal(np.log(LENGTH_MEDIAN_TOKENS), LENGTH_SIGMA, size=n))
    return np.clip(drawn, MIN_LENGTH_TOKENS, max_new_tokens).astype(np.int64)


@dataclass
class _Req:
    index: int
    length: int
    host: int = -1
    start_s: float = 0.0
    v_target: float = 0.0
    alive: bool = True
    twin: _Req | None = None  # the hedge copy (or the original, from the copy's side)
    is_copy: bool = False


@dataclass
class _Host:
    index: int
    bound: int
    v: float = 0.0
    t_s: float = 0.0
    frozen_until_s: float = 0.0
    running: int = 0
    heap: list[tuple[float, int, _Req]] = field(default_factory=list)
    reserve: deque[int] = field(default_factory=deque)
    stamp: int = 0


@dataclass
class ModelResult:
    finish_s: np.ndarray  # per prompt, when its first copy finished
    start_s: np.ndarray  # per prompt, when its winning copy started
    host: np.ndarray  # per prompt, the host of the winning copy
    host_finish_s: np.ndarray  # per host, when its last winning request finished
    hedges: int = 0
    hedge_wins: int = 0
    wasted_tokens: float = 0.0  # tokens decoded by aborted copies

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max()) if len(self.finish_s) else 0.0

    def tail_share(self, done: float = 0.95) -> float:
        """(time from ``done`` of prompts finished to all finished) / makespan."""
        return tail_share(self.finish_s, done)


def tail_share(finish_s: Sequence[float] | np.ndarray, done: float = 0.95, start_s: float = 0.0) -> float:
    times = np.sort(np.asarray(finish_s, dtype=float)) - start_s
    if len(times) == 0 or times[-1] <= 0:
        return 0.0
    k = max(0, int(np.ceil(done * len(times))) - 1)
    return float((times[-1] - times[k]) / times[-1])


def simulate(
    lengths: Sequence[int] | np.ndarray,
    hosts: int,
    bound: int,
    *,
    order: Sequence[int] | np.ndarray | None = None,
    decode_tok_s: float = DECODE_TOK_S,
    per_request_tok_s: float = PER_REQUEST_TOK_S,
    prompt_tokens: Sequence[int] | np.ndarray | None = None,
    prefill_tok_s: float | None = None,
    reserve: int = 0,
    hedge_below: int = 0,
    host_speed: Sequence[float] | None = None,
) -> ModelResult:
    """Run the queue ``order`` (default: as given) through ``hosts`` servers of ``bound`` slots each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    queue: deque[int] = deque(range(n) if order is None else (int(i) for i in order))
    prefill = np.zeros(n) if prompt_tokens is None or not prefill_tok_s else np.asarray(prompt_tokens) / prefill_tok_s
    fleet = [_Host(h, bound) for h in range(hosts)]
    events: list[tuple[float, int, int]] = []
    seq = itertools.count()
    finish = np.full(n, np.nan)
    start = np.zeros(n)
    winner_host = np.full(n, -1)
    running: dict[int, _Req] = {}  # prompt index → its original (un-finished) request
    result = ModelResult(finish, start, winner_host, np.zeros(hosts))

    speed = [1.0] * hosts if host_speed is None else [float(x) for x in host_speed]

    def rate(host: _Host) -> float:
        k = speed[host.index]
        return min(k * per_request_tok_s, k * decode_tok_s / host.running) if host.running else 0.0

    def advance(host: _Host, t: float) -> None:
        if t <= host.t_s:
            return
        decoding_from = max(host.t_s, host.frozen_until_s)
        if t > decoding_from:
            host.v += rate(host) * (t - decoding_from)
        host.t_s = t

    def schedule(host: _Host) -> None:
        host.stamp += 1
        while host.heap and not host.heap[0][2].alive:
            heapq.heappop(host.heap)
        if not host.heap:
            return
        ahead = max(0.0, host.heap[0][0] - host.v) / rate(host)
        t_next = max(host.t_s, host.frozen_until_s) + ahead
        heapq.heappush(events, (t_next, host.index, host.stamp))

    def admit(host: _Host, index: int, t: float, twin: _Req | None = None) -> _Req:
        host.frozen_until_s = max(host.frozen_until_s, t) + float(prefill[index])
        v_start = host.v
        req = _Req(
            index,
            int(lengths[index]),
            host.index,
            t,
            v_start + int(lengths[index]),
            twin=twin,
            is_copy=twin is not None,
        )
        host.running += 1
        heapq.heappush(host.heap, (req.v_target, next(seq), req))
        return req

    def kill(req: _Req, t: float) -> None:
        host = fleet[req.host]
        advance(host, t)
        req.alive = False
        host.running -= 1
        result.wasted_tokens += req.length - max(0.0, req.v_target - host.v)
        schedule(host)

    def refill(host: _Host, t: float) -> None:
        while host.running < host.bound:
            if host.reserve:
                index = host.reserve.popleft()
            elif queue:
                index = queue.popleft()
            else:
                break
            running[index] = admit(host, index, t)
        while reserve and len(host.reserve) < reserve and queue:
            host.reserve.append(queue.popleft())
        if hedge_below and not queue and host.running < hedge_below and not any(h.reserve for h in fleet):
            victims = sorted(
                (r for r in running.values() if r.twin is None and r.host != host.index), key=lambda r: r.start_s
            )
            for victim in victims[: hedge_below - host.running]:
                victim.twin = admit(host, victim.index, t, twin=victim)
                result.hedges += 1

    t = 0.0
    for _ in range(bound + reserve):  # hosts start together: deal the first messages round-robin
        for host in fleet:
            if host.running < host.bound:
                if queue:
                    index = queue.popleft()
                    running[index] = admit(host, index, t)
            elif reserve and len(host.reserve) < reserve and queue:
                host.reserve.append(queue.popleft())
    for host in fleet:
        schedule(host)
    while events:
        t, h, stamp = heapq.heappop(events)
        host = fleet[h]
        if stamp != host.stamp:
            continue
        advance(host, t)
        tolerance = 1e-9 * max(1.0, host.v)
        touched = {h}
        while host.heap and host.heap[0][0] <= host.v + tolerance:
            _, _, req = heapq.heappop(host.heap)
            if not req.alive:
                continue
            req.alive = False
            host.running -= 1
            if np.isnan(finish[req.index]):
                finish[req.index] = t
                start[req.index] = req.start_s
                winner_host[req.index] = h
                running.pop(req.index, None)
                result.hedge_wins += req.is_copy
                if req.twin is not None and req.twin.alive:
                    kill(req.twin, t)
                    touched.add(req.twin.host)
        refill(host, t)
        schedule(host)
        # Idle hosts may hedge what is left elsewhere once the queue is empty.
        if hedge_below and not queue:
            for other in fleet:
                if other.index not in touched and other.running < hedge_below:
                    advance(other, t)
                    refill(other, t)
                    schedule(other)
    for h in range(hosts):
        mine = finish[winner_host == h]
        result.host_finish_s[h] = float(mine.max()) if len(mine) else 0.0
    return result
