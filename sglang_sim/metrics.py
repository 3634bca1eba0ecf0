"""What the simulator counts: SGLang's Prometheus metrics and the test-facing ``/control/stats``.

Each simulator owns a :class:`~prometheus_client.CollectorRegistry`, so several can run in one
process. Metric names and the ``model_name`` label follow SGLang's ``metrics_collector.py``;
latencies are in *simulated* seconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter

from sglang_sim.engine import Engine

#: SGLang's buckets for sglang:e2e_request_latency_seconds.
E2E_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)


class SimMetrics:
    """Prometheus collectors; gauges are read from the engine at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        reg = self.registry

        # Children are bound once: a labels() lookup per request costs more than the increment.
        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, list(labels), registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return PromCounter(name, doc, list(labels), registry=reg).labels(**labels)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.context_len = gauge("sglang:context_len", "The context length.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.max_total_num_tokens = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        self.new_token_ratio = gauge("sglang:new_token_ratio", "The new token ratio.")
        self.num_retracted_reqs = gauge("sglang:num_retracted_reqs", "The number of retracted requests.")
        # SGLang 0.5.9's metrics/collector.py names (prometheus_client adds the _total of a counter). Made at the
        # first retraction: a real 0.5.9 (multiprocess Prometheus) shows no line of them before — not even
        # # TYPE — which a client must read as "none yet" (tests/real_sglang/test_differential_loads.py).
        self._counter = counter
        self.retracted_total: Any = None
        self.retracted_input_tokens: Any = None
        self.retracted_output_tokens: Any = None
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.num_aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds (simulated)",
            list(labels),
            buckets=E2E_BUCKETS_S,
            registry=reg,
        ).labels(**labels)

    def observe_finish(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, e2e_s: float, aborted: bool
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.num_requests.inc()
        if aborted:
            self.num_aborted.inc()
        self.e2e_latency.observe(e2e_s)

    def observe_retraction(self, input_tokens: int, output_tokens: int) -> None:
        if self.retracted_total is None:
            counter = self._counter
            self.retracted_total = counter("sglang:num_retracted_requests", "Total number of retracted requests.")
            self.retracted_input_tokens = counter(
                "sglang:num_retracted_input_tokens", "Total number of retracted input tokens."
            )
            self.retracted_output_tokens = counter(
                "sglang:num_retracted_output_tokens", "Total number of retracted output tokens."
            )
        self.retracted_total.inc()
        self.retracted_input_tokens.inc(input_tokens)
        self.retracted_output_tokens.inc(output_tokens)

    def render(self, engine: Engine, context_len: int, max_total_num_tokens: int = 0) -> bytes:
        """Prometheus text exposition, gauges refreshed from the engine."""
        stats = engine.stats
        used = engine.used_tokens
        self.num_used_tokens.set(int(used))
        self.max_total_num_tokens.set(max_total_num_tokens)
        self.token_usage.set(used / max_total_num_tokens if max_total_num_tokens else 0.0)
        self.new_token_ratio.set(engine.new_token_ratio)
        self.num_retracted_reqs.set(stats.last_retracted_reqs)
        self.num_running_reqs.set(engine.num_running)
        self.num_queue_reqs.set(engine.num_waiting)
        self.gen_throughput.set(engine.gen_throughput_tok_s())
        hit = stats.cached_tokens_total / stats.prompt_tokens_total if stats.prompt_tokens_total else 0.0
        self.cache_hit_rate.set(hit)
        self.context_len.set(context_len)
        return generate_latest(self.registry)


@dataclass
class CallStats:
    """Counts a test needs to prove what reached the server (``GET /control/stats``)."""

    #: HTTP calls to /generate, whatever their outcome.
    generate_calls: int = 0
    #: Items (batch members) that passed parsing and got a rid.
    generate_items: int = 0
    #: /generate responses by HTTP status ("200", "400", "503") or "drop"/"hang".
    by_status: Counter[str] = field(default_factory=Counter)
    #: Items that finished with stop/length, and with abort.
    completed: int = 0
    aborted: int = 0
    #: How many /generate items carried each rid.
    rids: Counter[str] = field(default_factory=Counter)
    #: Rids whose generation ended on the NaN path (``--nan-rate``), in finishing order (a rid retried
    #: and hit again appears again). Every other finished generation is ``expected_generation``'s.
    nan_rids: list[str] = field(default_factory=list)
    #: Rids the scheduler aborted part-way (``--abort-rate``), in finishing order.
    abort_rids: list[str] = field(default_factory=list)
    #: Rids answered 200 with a bad output (``--bad-output-rate``), in finishing order.
    bad_output_rids: list[str] = field(default_factory=list)
    #: Rids accepted while already in flight (releases without the duplicate check, e.g. 0.5.9): the
    #: earlier call holding the rid is never answered.
    duplicate_rids: list[str] = field(default_factory=list)
    #: ``POST /control/stall`` calls that started a stall, and health checks answered after the delay.
    stalls: int = 0
    health_checks: int = 0

    def snapshot(self, engine: Engine, faults: dict[str, int], include_rids: bool) -> dict[str, Any]:
        stats = engine.stats
        out: dict[str, Any] = {
            "generate_calls": self.generate_calls,
            "generate_items": self.generate_items,
            "by_status": dict(self.by_status),
            "completed": self.completed,
            "aborted": self.aborted,
            "faults": dict(faults),
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "peak_running": stats.peak_running,
            "sim_time_s": engine.now_s,
            "decoded_tokens": stats.decoded_tokens,
            "generation_tokens_total": stats.generation_tokens_total,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "cached_tokens_total": stats.cached_tokens_total,
            "queue_full_rejections": stats.queue_full_rejections,
            "gen_throughput": engine.gen_throughput_tok_s(),
            "distinct_rids": len(self.rids),
            "nan_rids": list(self.nan_rids),
            "abort_rids": list(self.abort_rids),
            "bad_output_rids": list(self.bad_output_rids),
            "duplicate_rids": list(self.duplicate_rids),
            "stalls": self.stalls,
            "health_checks": self.health_checks,
        }
        if include_rids:
            out["rids"] = dict(self.rids)
        return out
