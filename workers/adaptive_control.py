"""The in-flight controller's decision: where the bound should be, given what the server reports.

Pure and deterministic — fed :class:`LoadSample` s on the caller's clock (monotonic or simulated seconds),
no wall clock, no I/O — so bench/bench_adaptive.py can run hours of a simulated server in seconds and
tests/test_adaptive.py can state its behaviour sample by sample. workers/adaptive.py reads the server and
applies the moves; its docstring says which signals steer the bound and why.

How it settles (issue 26: "no oscillation wider than a few % of the bound at steady state"). What a
KV-bound server can run swings ±15-30 % with the lengths of the requests it holds, and the bound that
serves it best is any one above that swing plus a short queue (throughput is flat there), so following the
swing — or a mean of it plus its spread, itself a wandering figure — buys nothing. The bound therefore
follows that target (a 5 % dead band) only until it has held still for ``settle_intervals`` decisions; from
then on it is *settled* and moves on direct evidence alone, probing rarely:

- **starved**: ``persist_intervals`` decisions in a row (30 s) in which the work fills the bound, the server
  queues none of it and its KV has room (more would have run): up ``settled_rise_share``;
- **too much**: over the last ``settled_window_intervals`` decisions (10 min) the bound stayed above what
  ran of ours by the short queue plus ``settled_excess_share`` of the bound at every decision (even the
  swing's peak left that many unused): down to that peak plus the short queue, and the window starts again.

Between the two lies a gap of about ``settled_excess_share`` plus the short queue: a bound just above the
swing's peaks stays where it is for as long as the swing does.
A retraction storm, a lasting shift of what the server runs (the fast mean away from the slow one) and a
reset (the server's limits) act at once and unsettle it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Seconds between two reads of the server's load (and at most one decision per read).
DEFAULT_INTERVAL_S = 5.0
#: Tokens a reasoning request holds in the KV cache on average over its life (a 1-2k prompt and a
#: 6-8k output, half of it generated): the start is ``max_total_num_tokens`` / this.
START_TOKENS_PER_REQUEST = 8192


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
    "server_full",  # the server queues some of ours (or its KV is full): what it runs plus a short queue
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
    # -- settling -------------------------------------------------------------------------------------------
    #: Decisions in a row without a move after which the bound is settled.
    settle_intervals: int = 12
    #: Settled: this many decisions in a row starved (the work fills the bound, no queue, KV with room) raise
    #: it by this share.
    persist_intervals: int = 6
    settled_rise_share: float = 0.05
    #: Settled: this many probes in a row, the server starved throughout, hand the bound back to the target.
    settled_probes: int = 3
    #: Settled: the bound above what runs of ours by the short queue plus this share of it at every decision
    #: of a window of this many decisions lowers it.
    settled_excess_share: float = 0.15
    settled_window_intervals: int = 120

    # -- what the server can run ----------------------------------------------------------------------------
    #: What the server can run is averaged over this many decisions (5 min at 5 s), plus this many standard
    #: deviations. Counted in decisions, as every time constant here: a worker on a simulator's faster clock
    #: gets the same controller by scaling ``interval_s`` alone (bench/bench_adaptive.py's HTTP run does).
    smoothing_intervals: int = 60
    margin_sd: float = 1.5
    #: A fast mean (over ``fast_smoothing_intervals``) this share away from the slow one for this many
    #: decisions in a row is a lasting change: the slow mean jumps to it (a tenant arrived, the server restarted).
    fast_smoothing_intervals: int = 4
    shift_share: float = 0.35
    shift_intervals: int = 4
    #: KV usage (``num_used_tokens`` / pool; SGLang leaves the evictable radix cache out of "used") from
    #: which the server is full even while its queue is empty: more requests could not run either.
    kv_full_share: float = 0.9
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
        counts = ("settle_intervals", "persist_intervals", "settled_probes", "settled_window_intervals")
        if any(getattr(self, name) < 1 for name in (*counts, "smoothing_intervals", "fast_smoothing_intervals")):
            raise ValueError(f"{', '.join(counts)} must be >= 1")


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

    @property
    def kv_usage(self) -> float | None:
        return self.used / self.used_n / self.capacity if self.capacity and self.used_n else None


class InflightController:
    """The bound: started from the server's limits, moved by its load, never above ``cap``.

    Deterministic: the same limits and samples give the same moves. :meth:`reset` at start and after a
    server restart; :meth:`observe` per read of the load; ``bound``, ``reason``, ``kind``, ``settled`` and
    ``moves`` say where it is.
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
        self._shift_now = False  # the last _track found a lasting change: act on it at once
        self._rising = 0
        self._calm = 0  # decisions in a row without a move while not settled (settled: stays >= settle_intervals)
        self._starved = 0  # settled: decisions in a row that found the server starved
        self._probes = 0  # settled: probes up in a row, the server starved throughout
        #: settled: the bound minus what ran of ours, per decision of the window
        self._headroom: deque[float] = deque(maxlen=self.config.settled_window_intervals)

    @property
    def settled(self) -> bool:
        """The bound has held still long enough that only direct evidence (or a storm, a shift) moves it."""
        return self._calm >= self.config.settle_intervals

    # -- what the caller tells it ------------------------------------------------------------------
    def reset(self, limits: ServerLimits, t_s: float) -> Move | None:
        """Start from the server's limits: ``min(cap, max_running_requests)`` (a new or restarted server)."""
        self.limits = limits
        self._reset = True
        self._window = None
        self._retractions_seen = None
        self._estimate = None
        self._unsettle()
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

    def _unsettle(self) -> None:
        self._calm, self._starved, self._probes = 0, 0, 0
        self._headroom.clear()

    def _decide(self, w: _Window, retracted: int, t_s: float) -> Move | None:
        c, bound = self.config, self.bound
        inflight, running, waiting = w.inflight / w.n, w.running / w.n, w.waiting / w.n
        if retracted > max(c.storm_min, c.storm_share * max(running, 1.0)):
            self._estimate = None  # what the server held is no guide now
            self._unsettle()
            new = int(bound * c.storm_cut)
            why = f"retraction storm: {retracted} retracted in {c.interval_s:g}s"
            return self._move(t_s, new, why, "retraction_storm")
        target, kind, why = self._target(w, inflight, running, waiting)  # the estimate follows, settled or not
        if retracted:
            why += f"; {retracted} retracted (no storm)"
        if self._shift_now:
            self._unsettle()
        elif self.settled:
            return self._decide_settled(w, inflight, waiting, t_s)
        if abs(target - bound) <= max(1.0, c.deadband_share * bound):
            self._calm += 1
            return None
        if target > bound:
            step = min(max(1.0, c.max_rise_share * bound), c.gain * (target - bound))
            move = self._move(t_s, round(bound + max(1.0, step)), why, kind)
        else:
            move = self._move(t_s, round(bound - max(1.0, c.gain * (bound - target))), why, kind)
        self._calm = 0 if move is not None else self._calm + 1
        return move

    def _decide_settled(self, w: _Window, inflight: float, waiting: float, t_s: float) -> Move | None:
        """A settled bound moves on direct evidence only (the module docstring): starved, or too much."""
        c, bound = self.config, self.bound
        ours_running = w.ours_running / w.n
        allowance = max(c.queue_min, c.queue_share * ours_running)
        usage = w.kv_usage
        room = usage is None or usage < c.kv_full_share
        starved = waiting <= 0.5 * allowance and room and inflight >= c.saturated_share * bound
        if starved:
            self._starved += 1
        else:
            self._starved, self._probes = 0, 0
        if self._starved >= c.persist_intervals:
            # More would have run for half a minute: a step up, a probe (it stays settled). Starved throughout
            # ``settled_probes`` probes: the server can run far more now (a tenant left, a bigger KV) — the
            # target steers again, at its faster pace. (Fewer would answer a swing's young requests, which
            # the server admits all of for a minute before they grow and the batch shrinks again.)
            self._starved, self._probes = 0, self._probes + 1
            if self._probes >= c.settled_probes:
                self._unsettle()
            self._headroom.clear()
            why = f"server starved for {c.persist_intervals * c.interval_s:g}s: {waiting:.0f} waiting"
            if usage is not None:
                why += f", KV {usage:.0%}"
            new = bound + max(1.0, c.settled_rise_share * bound)
            slots = self.limits.max_running_requests
            if slots is not None:  # never past its slots (plus the short queue), as the target is not
                others = max(0.0, w.running / w.n + waiting - inflight)
                new = min(new, slots + allowance - others)
            return self._move(t_s, round(new), why, "server_takes_all") if new >= bound + 1 else None
        if inflight < c.saturated_share * bound:
            self._headroom.clear()  # the work does not fill the bound: its headroom says nothing of the server
            return None
        # The bound, not what we have sent: requests sent before a cut are never taken back and wait there.
        self._headroom.append(bound - ours_running)
        if len(self._headroom) < c.settled_window_intervals:
            return None
        least = min(self._headroom)
        excess = least - allowance
        if excess <= c.settled_excess_share * bound:
            return None
        self._headroom.clear()  # a fresh window of evidence before the next one
        window_s = c.settled_window_intervals * c.interval_s
        why = f"settled: the bound was at least {least:.0f} above what ran of ours throughout {window_s:g}s"
        return self._move(t_s, round(bound - excess), why, "server_full")

    def _target(self, w: _Window, inflight: float, running: float, waiting: float) -> tuple[float, str, str]:
        """What the server can run of ours (smoothed, plus its spread) and a short queue; and why.

        SGLang's own admission keeps the batch inside its KV (its reservation, then retraction of the
        youngest requests), so the best bound is "what it can run, plus a few ready to admit the moment
        a slot or KV frees": fewer leaves the batch short, more only lengthens its queue. What it can
        run swings with the lengths of the requests it holds (a minute's mean-reverting swing of ±30%
        on a KV-bound server), so the bound follows a mean over ``smoothing_intervals`` plus ``margin_sd``
        standard deviations instead of every swing; a lasting change moves the mean within a minute."""
        c = self.config
        self._shift_now = False
        others = max(0.0, running + waiting - inflight)  # other clients' requests at the same server
        ours_running = w.ours_running / w.n
        allowance = max(c.queue_min, c.queue_share * ours_running)
        usage = w.kv_usage
        kv_full = usage is not None and usage >= c.kv_full_share
        # It holds some back, or its KV is full (a moment without a queue there is no room for more): what
        # runs is what it can run.
        full = waiting > 0.5 * allowance or kv_full
        if not full and inflight < c.saturated_share * self.bound:
            # It runs all we send and we send less than the bound (too few prompts, between jobs): that says
            # nothing of its capacity, so neither the estimate nor the bound moves.
            return float(self.bound), "server_takes_all", f"the work does not fill the bound ({inflight:.0f})"
        seen = ours_running if full else inflight + max(allowance, c.max_rise_share * inflight)
        self._track(seen, rising=not full)
        assert self._estimate is not None
        can_run = self._estimate + c.margin_sd * self._variance**0.5
        kv = f", KV {usage:.0%}" if usage is not None else ""
        load = f"{running:.0f} running, {waiting:.0f} waiting{kv}"
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
        alpha = 1.0 / (c.fast_smoothing_intervals if fast else c.smoothing_intervals)
        delta = seen - self._estimate
        self._estimate += alpha * delta
        self._variance = (1 - alpha) * (self._variance + alpha * delta * delta)
        self._fast += (seen - self._fast) / c.fast_smoothing_intervals
        away = abs(self._fast - self._estimate) > c.shift_share * max(self._estimate, 1.0)
        self._shifted = self._shifted + 1 if away else 0
        if self._shifted >= c.shift_intervals:
            self._estimate, self._variance, self._shifted = self._fast, 0.0, 0
            self._shift_now = True

    def _move(self, t_s: float, new: int, reason: str, kind: str, force: bool = False) -> Move | None:
        new = max(self.config.min_bound, min(self.cap, new))
        if new == self.bound and not force:
            return None
        move = Move(t_s, self.bound, new, reason, kind)
        self.bound, self.reason, self.kind = new, reason, kind
        self.moves.append(move)
        return move
