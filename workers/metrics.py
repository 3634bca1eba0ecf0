"""Prometheus metrics of one worker process (its own registry, served on its own port)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from thinkfleet.broker.affinity import AFFINITY
from thinkfleet.broker.transit import LEFT_TO_HOLDER
from workers.adaptive import REASON_KINDS

log = logging.getLogger(__name__)


class WorkerMetrics:
    def __init__(self, worker: str, max_inflight: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.port: int | None = None
        self.inflight = Gauge("thinkfleet_inflight_requests", "Requests in flight to SGLang", registry=r)
        self.bound = Gauge(
            "thinkfleet_inflight_bound",
            "The in-flight bound now (auto: chosen from the server's load; fixed: THINKFLEET_MAX_INFLIGHT)",
            registry=r,
        )
        self.bound.set(max_inflight)
        self.bound_cap = Gauge("thinkfleet_inflight_cap", "THINKFLEET_MAX_INFLIGHT: the bound's upper cap", registry=r)
        self.bound_cap.set(max_inflight)
        self.bound_reason = Enum(
            "thinkfleet_inflight_bound_reason",
            "Why the in-flight bound last moved (workers/adaptive.py REASON_KINDS)",
            states=list(REASON_KINDS),
            registry=r,
        )
        self.bound_reason.state("cap")
        self.bound_moves = Counter(
            "thinkfleet_inflight_bound_moves", "Moves of the in-flight bound, by reason", ["reason"], registry=r
        )
        self.retractions = Counter(
            "thinkfleet_retractions",
            "Retractions SGLang reports in our answers' meta_info (num_retractions)",
            registry=r,
        )
        #: The same as a plain count: the adaptive bound's signal where /metrics has no retraction counter.
        self.retractions_seen = 0
        self.inflight_seconds = Counter(
            "thinkfleet_inflight_seconds", "Integral of in-flight requests over time (occupancy)", registry=r
        )
        self.held = Gauge("thinkfleet_held_messages", "Queue messages this worker holds", registry=r)
        self.completed = Counter("thinkfleet_completed", "Rows committed", ["dataset"], registry=r)
        self.output_tokens = Counter("thinkfleet_output_tokens", "Output tokens committed", registry=r)
        self.retried = Counter("thinkfleet_retried", "Attempts retried", ["error_class"], registry=r)
        self.dead = Counter("thinkfleet_dead_lettered", "Prompts dead-lettered", ["error_class"], registry=r)
        self.handed_back = Counter("thinkfleet_handed_back", "Prompts handed back to the queue", registry=r)
        self.skipped = Counter("thinkfleet_skipped_stored", "Redeliveries skipped (already stored)", registry=r)
        self.errors = Counter("thinkfleet_internal_errors", "Our own crashes, by kind", ["kind"], registry=r)
        self.healthy = Gauge("thinkfleet_server_healthy", "1 when the local SGLang server is healthy", registry=r)
        self.server_state = Enum(
            "thinkfleet_server_state",
            "The local SGLang server as the health gate sees it (loading/warming: not ready yet, not a failure)",
            states=["unknown", "ready", "loading", "warming", "unhealthy"],
            registry=r,
        )
        self.probes = Counter("thinkfleet_health_probes", "/health_generate probes by result", ["result"], registry=r)
        self.probe_seconds = Histogram(
            "thinkfleet_health_probe_seconds",
            "/health_generate probe duration",
            buckets=(0.5, 1, 1.5, 2, 5, 10, 30, 60, 70, 120),
            registry=r,
        )
        self.probes_excused = Counter(
            "thinkfleet_health_probes_excused",
            "Failed probes that did not close the gate because generations completed meanwhile",
            registry=r,
        )
        self.storage_healthy = Gauge(
            "thinkfleet_storage_healthy", "1 while Parquet commits succeed (0: rows held in memory)", registry=r
        )
        self.storage_healthy.set(1)
        self.storage_failures = Counter(
            "thinkfleet_storage_failures", "Failed commit attempts (retried with backoff)", registry=r
        )
        # -- a stall is seen (workers/stall.py) ----------------------------------------------------------------
        self.stalled = Gauge(
            "thinkfleet_worker_stalled",
            "1 while this worker holds work and makes no progress past its bound (producer status says why)",
            registry=r,
        )
        self.progress_age = Gauge(
            "thinkfleet_progress_age_seconds",
            "Seconds since this worker last made progress (a commit succeeded or a generation completed)",
            registry=r,
        )
        self.commit_waiting = Gauge(
            "thinkfleet_commit_waiting_rows", "Rows waiting in the group committer (not yet stored)", registry=r
        )
        self.crashes = Counter(
            "thinkfleet_crashed_deliveries", "Deliveries that ended in an unexpected exception", ["error"], registry=r
        )
        self.left_to_holder = Gauge(
            "thinkfleet_broker_outcomes_left_to_holder",
            "Late outcomes of our deliveries that found the message delivered again and left it to that delivery"
            " (thinkfleet/broker/transit.py), by outcome; only grows",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ack", "reject", "hand-back", "restore"):
            self.left_to_holder.labels(outcome).set_function(lambda o=outcome: LEFT_TO_HOLDER[o])
        self.alarm = Gauge("thinkfleet_reasoning_alarm", "1 when rows lack </think> (seed's bug)", registry=r)
        self.latency = Histogram(
            "thinkfleet_request_latency_seconds",
            "/generate latency",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 2400),
            registry=r,
        )
        self.commit_seconds = Histogram(
            "thinkfleet_commit_seconds",
            "Group-commit duration",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        # -- a conversation's prefix cache (thinkfleet/broker/affinity.py) -----------------------------------
        self.prefix_reusable = Counter(
            "thinkfleet_prefix_reusable_tokens",
            "Prompt tokens of later turns their previous turn's server had computed (prefix_reusable_tokens)",
            registry=r,
        )
        self.prefix_cached = Counter(
            "thinkfleet_prefix_cached_tokens",
            "Of those, the tokens the server reported cached (cached_tokens, capped at the reusable prefix): "
            "the prefix cache's hit rate is this over thinkfleet_prefix_reusable_tokens",
            registry=r,
        )
        r.register(_AffinityCollector())
        self._inflight = 0
        self._since = time.monotonic()

    def serve(self, port: int) -> int:
        """Serve on ``port``; a port another process holds (two workers on one host with the same
        THINKFLEET_METRICS_PORT) is not fatal: warn and serve on a free one (registered in Redis)."""
        try:
            server, _thread = start_http_server(port, addr="0.0.0.0", registry=self.registry)
        except OSError as exc:
            if port == 0:
                raise
            log.warning("metrics port %d is taken (%s): serving on a free port instead", port, exc)
            server, _thread = start_http_server(0, addr="0.0.0.0", registry=self.registry)
        self.port = int(server.server_port)
        return self.port

    def _accumulate(self) -> None:
        now = time.monotonic()
        self.inflight_seconds.inc(self._inflight * (now - self._since))
        self._since = now

    def note_bound(self, bound: int, kind: str) -> None:
        """The in-flight bound moved (or was set) to ``bound`` for a reason of ``kind``."""
        self.bound.set(bound)
        self.bound_reason.state(kind if kind in REASON_KINDS else "cap")
        self.bound_moves.labels(kind).inc()

    def note_progress(self, age_s: float, waiting: int, stalled: str | None) -> None:
        """What the stall watch found (workers/stall.py)."""
        self.progress_age.set(age_s)
        self.commit_waiting.set(waiting)
        self.stalled.set(int(bool(stalled)))

    def note_prefix(self, reusable: int | None, cached: int | None) -> None:
        """A stored later turn's reusable prefix and the server's cached tokens (both known, or not counted)."""
        if reusable is not None and cached is not None:
            self.prefix_reusable.inc(reusable)
            self.prefix_cached.inc(min(cached, reusable))

    def note_retractions(self, n: int | None) -> None:
        if n:
            self.retractions.inc(n)
            self.retractions_seen += n

    def request_started(self) -> None:
        self._accumulate()
        self._inflight += 1
        self.inflight.set(self._inflight)

    def request_finished(self, latency_s: float | None = None) -> None:
        self._accumulate()
        self._inflight -= 1
        self.inflight.set(self._inflight)
        if latency_s is not None:
            self.latency.observe(latency_s)


class _AffinityCollector(Collector):
    """``thinkfleet_affinity_messages_total{outcome}``: this process's placement counts (thinkfleet/broker/affinity.py
    AFFINITY, kept by the transit channel's thread and the sweep): ``offered`` to our host list, ``shared_away`` /
    ``shared_backlog`` put on the shared queue instead, ``own`` popped from our host list, ``stolen_stale`` /
    ``stolen_whole`` moved from a host list to the shared queue by our sweeps (waited too long / host dead or away)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "thinkfleet_affinity_messages", "Next-turn placements by outcome (host affinity)", labels=["outcome"]
        )
        for outcome in AFFINITY.OUTCOMES:
            family.add_metric([outcome], AFFINITY[outcome])
        yield family
