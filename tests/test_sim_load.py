"""What makes the in-flight bound matter, in the simulator: a KV budget with SGLang 0.5.9's admission and
retraction, a per-step cost, a server that slows down, and the load endpoints with 0.5.9's shapes.

Engine tests run on a manual clock (exact simulated time); the endpoint tests over real HTTP."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import requests

from sglang_sim.engine import Engine, EngineConfig, SimRequest
from sglang_sim.testing import SimulatorThread
from thinkfleet import kimi
from workers.adaptive import parse_load, parse_retractions

PROMPT = [kimi.IM_USER, 13, 14, kimi.IM_MIDDLE, 15, kimi.IM_END, kimi.IM_ASSISTANT, 16, kimi.IM_MIDDLE, 163606]


class ManualClock:
    def __init__(self) -> None:
        self.t_s = 0.0

    def __call__(self) -> float:
        return self.t_s


def engine(**config: Any) -> tuple[Engine, ManualClock]:
    clock = ManualClock()
    return Engine(EngineConfig(**config), clock), clock


def at(eng: Engine, clock: ManualClock, t_s: float) -> None:
    clock.t_s = t_s
    eng.advance()


def test_kv_overflow_retracts_the_request_with_the_longer_prompt_and_it_is_recomputed_after() -> None:
    # Given a 1000-token pool and two requests of 600 output tokens at 10 tok/s each
    eng, clock = engine(
        kv_capacity_tokens=1000, clip_max_new_tokens=50, per_request_tok_s=10, decode_tok_s=1e6, prefill_tok_s=1000
    )
    done: list[SimRequest] = []
    a = SimRequest("a", list(range(100)), 600, on_finish=done.append)
    b = SimRequest("b", list(range(1000, 1120)), 600, on_finish=done.append)
    eng.submit(a)
    eng.submit(b)
    assert eng.num_running == 2  # both fit at admission (prompt + min(max_new, clip) beside a's reservation)

    # When their outputs outgrow the pool (220 + 2 * 389 + 2 slots for the next step = 1000)
    at(eng, clock, 40.0)

    # Then the scheduler retracted one: equal outputs, so the longer prompt goes (retract_decode's order)
    assert eng.stats.retractions == 1 and b.retractions == 1 and a.retractions == 0
    assert (eng.num_running, eng.num_waiting) == (1, 1)
    assert b.resumed_tokens == 389
    assert eng.used_tokens == pytest.approx(100 + eng.progress(a), abs=1)  # progress counts whole tokens

    # And b waits until a is done (its input + clip does not fit beside a), then prefills all it had again
    at(eng, clock, 90.0)
    assert [r.rid for r in done] == ["a", "b"]
    assert a.finish_s == pytest.approx(0.22 + 60.0)  # both prompts prefilled first (decode pauses for prefill)
    assert b.finish_s == pytest.approx(a.finish_s + (120 + 389) / 1000 + (600 - 389) / 10)
    assert b.generated_tokens == 600 and b.cached_tokens == 0
    assert eng.stats.prompt_tokens_total == 220  # a retraction is no new prompt
    assert eng.used_tokens == pytest.approx(0.0)


def test_admission_waits_for_kv_room_not_only_for_a_slot() -> None:
    # Given a pool that holds one request's input and its 4096-token reservation, and slots for ten
    eng, _ = engine(kv_capacity_tokens=6000, max_running_requests=10, prefill_tok_s=1e12)
    done: list[SimRequest] = []
    for i in range(3):
        eng.submit(SimRequest(f"r{i}", [i * 10_000 + j for j in range(1000)], 100, on_finish=done.append))

    # Then the first runs, the others wait in the server's queue (the load a client sees)
    assert (eng.num_running, eng.num_waiting) == (1, 2)
    assert eng.waiting_tokens() == 2000


def test_step_cost_makes_throughput_rise_with_the_batch_and_saturate() -> None:
    # Given a decode step of 20 ms + 1 ms per request
    def throughput(n: int) -> float:
        eng, clock = engine(step_fixed_s=0.020, step_per_request_s=0.001, prefill_tok_s=1e12, max_running_requests=512)
        for i in range(n):
            eng.submit(SimRequest(f"r{i}", [i], 100_000, on_finish=lambda r: None))
        at(eng, clock, 100.0)
        return eng.stats.decoded_tokens / 100.0

    # Then n requests get n / (0.020 + 0.001 n) tokens/s: more in flight is faster, up to 1000 tok/s
    for n in (1, 20, 150, 400):
        assert throughput(n) == pytest.approx(n / (0.020 + 0.001 * n), rel=1e-6)
    assert throughput(400) < 1000


def test_a_server_that_slows_down_takes_twice_as_long_per_step_from_then_on() -> None:
    eng, clock = engine(
        step_fixed_s=0.05, step_per_request_s=0.0, prefill_tok_s=1e12, slowdown_at_s=10.0, slowdown_factor=2
    )
    eng.submit(SimRequest("r", [1], 1_000_000, on_finish=lambda r: None))
    at(eng, clock, 20.0)
    assert eng.stats.decoded_tokens == pytest.approx(10 / 0.05 + 10 / 0.1)


def test_new_token_ratio_decays_per_decode_step_to_its_floor() -> None:
    eng, clock = engine(kv_capacity_tokens=1_000_000, prefill_tok_s=1e12, per_request_tok_s=100)
    assert eng.new_token_ratio == pytest.approx(0.7)
    eng.submit(SimRequest("r", [1], 10_000, on_finish=lambda r: None))
    at(eng, clock, 3.0)  # 300 steps: half of SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    assert eng.new_token_ratio == pytest.approx(0.7 - (0.7 - 0.098) / 2)
    at(eng, clock, 60.0)
    assert eng.new_token_ratio == pytest.approx(0.098)


# -- over HTTP -------------------------------------------------------------------------------------------
FAST = {"health_min_s": 0.05}


def test_v1_loads_and_get_load_have_0_5_9_shapes() -> None:
    with SimulatorThread(time_scale=1000, sglang_version="0.5.9", kv_capacity_tokens=300_000, **FAST) as sim:
        loads = requests.get(f"{sim.url}/v1/loads", timeout=10).json()
        assert list(loads) == ["timestamp", "version", "dp_rank_count", "loads", "aggregate"]
        (load,) = loads["loads"]
        assert list(load) == [
            "num_running_reqs",
            "num_waiting_reqs",
            "num_used_tokens",
            "max_total_num_tokens",
            "token_usage",
            "gen_throughput",
            "cache_hit_rate",
            "utilization",
            "max_running_requests",
            "memory",
            "disaggregation",
            "queues",
            "num_total_reqs",
        ]  # dp_rank is null without DP, so the 0.5.9 dict factory leaves it out
        assert load["max_total_num_tokens"] == 300_000 and load["max_running_requests"] == 256
        assert list(load["queues"]) == ["waiting", "grammar", "paused", "retracted"]
        assert list(loads["aggregate"]) == [
            "total_running_reqs",
            "total_waiting_reqs",
            "total_reqs",
            "avg_token_usage",
            "avg_throughput",
            "avg_utilization",
        ]
        old = requests.get(f"{sim.url}/get_load", timeout=10).json()
        assert [list(d) for d in old] == [
            ["rid", "http_worker_ipc", "dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"]
        ]
        assert parse_load(loads) == (0, 0, 0, 300_000)
        assert parse_load(old) == (0, 0, None, None)
        info = requests.get(f"{sim.url}/server_info", timeout=10).json()
        assert info["max_total_num_tokens"] == 300_000  # the enforced pool is the reported one


def test_a_retracted_request_reports_its_retraction_in_meta_info_and_metrics() -> None:
    # Given a pool too small for two 600-token generations side by side (0.5.9: total_retractions)
    options = dict(
        time_scale=200,
        sglang_version="0.5.9",
        kv_capacity_tokens=1000,
        clip_max_new_tokens=50,
        per_request_tok_s=10,
        decode_tok_s=1e6,
        **FAST,
    )
    results: dict[str, Any] = {}
    with SimulatorThread(**options) as sim:
        # (before any retraction /metrics has no line of the counters, as a real 0.5.9: none yet)
        fresh = requests.get(f"{sim.url}/metrics", timeout=10).text
        assert "sglang:num_retracted_requests" not in fresh and parse_retractions(fresh) is None
        assert "sglang:num_used_tokens" in fresh and "sglang:max_total_num_tokens" in fresh

        def call(rid: str, ids: list[int]) -> None:
            body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
            results[rid] = requests.post(f"{sim.url}/generate", json=body, timeout=60).json()

        threads = [
            threading.Thread(target=call, args=("a", PROMPT * 10)),
            threading.Thread(target=call, args=("b", PROMPT * 12)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        metrics = requests.get(f"{sim.url}/metrics", timeout=10).text

    # Then both finished whole, one after one retraction, and the counter says so
    assert sorted(r["meta_info"]["total_retractions"] for r in results.values()) == [0, 1]
    assert all(r["meta_info"]["completion_tokens"] == 600 for r in results.values())
    assert parse_retractions(metrics) == 1
    assert "sglang:num_retracted_input_tokens_total" in metrics and "sglang:token_usage" in metrics
