"""The adaptive bound with the real worker over HTTP (bench/bench_adaptive.py's second part).

A real ``worker`` process (Celery, Redis, Parquet commits) drives ``sglang-sim`` over loopback HTTP: the same
KV-bound engine as the manual-clock runs, every length a quarter (so a request lives ~80 simulated seconds
and the batch is the same), on a clock ``time_scale`` times faster than the wall. The worker's controller
reads ``/v1/loads`` and ``/metrics`` exactly as on a GPU host; its decision interval is 5 *simulated* seconds
(``THINKFLEET_INFLIGHT_INTERVAL_S`` = 5 / time scale, every other time constant is counted in decisions), so
it sees the server as a worker on a real one would. Runs: adaptive (cap 512), the best fixed bound of a
manual-clock sweep of the same profile, and fixed 150, each from a cold server and queue for the same wall
time. Output tok/s is the simulator's decoded tokens per simulated second over the run's second half.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import (
    Sampler,
    bench_settings,
    commit,
    make_prompts,
    register_job,
    sampling_params,
    scrape,
    sim_stats,
    stage,
    start_workers,
    worker_metrics_ports,
)
from sglang_sim.testing import SimulatorProcess
from testing.redis_process import RedisProcess

JOB = "bench-adaptive-http"
#: Simulated seconds per wall second, and wall seconds per run (3 runs: ~6 min with start-up).
TIME_SCALE = 6.0
RUN_WALL_S = 100.0
PROMPTS = 2500
#: The kv-bound profile with every length a quarter: KV 150k tokens, prompts 125-500, outputs median 1,750.
ENGINE = {
    "max_running_requests": 512,
    "step_fixed_s": 0.020,
    "step_per_request_s": 0.0002,
    "kv_capacity_tokens": 150_000,
    "prefill_tok_s": 12_000.0,
}
PROMPT_TOKENS = (125, 500)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CAP, MAX_NEW_TOKENS = 1750, 0.6, 7500, 8192


def sim_flags(time_scale: float) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    return [
        *flags,
        f"--time-scale={time_scale}",
        f"--length-median-tokens={OUTPUT_MEDIAN}",
        f"--length-sigma={OUTPUT_SIGMA}",
        f"--max-length-tokens={OUTPUT_CAP}",
        "--min-length-tokens=16",
        "--max-tick-lag-ms=1e12",  # a busy simulator delays answers, never its clock (bench/harness.py)
        "--log-level=WARNING",
    ]


def run_one(redis_url: str, workdir: Path, fixed: int | None, time_scale: float, wall_s: float) -> dict[str, Any]:
    """One run from a cold server and queue: ``fixed`` bound, or (None) the adaptive one under the cap 512."""
    settings = bench_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    sim = SimulatorProcess(*sim_flags(time_scale)).start()
    workers = []
    try:
        prompts = make_prompts(PROMPTS, seed=11, min_tokens=PROMPT_TOKENS[0], max_tokens=PROMPT_TOKENS[1])
        register_job(client, settings.keys, JOB, prompts, sampling_params(MAX_NEW_TOKENS))
        staged = stage(settings, JOB, prompts)
        mode = {"inflight_mode": "auto"} if fixed is None else {"inflight_mode": "fixed"}
        workers = start_workers(
            settings,
            [sim.url],
            512 if fixed is None else fixed,
            workdir / "logs",
            inflight_interval_s=round(5.0 / time_scale, 4),
            request_timeout_floor_s=3600,
            **mode,
        )
        port = next(iter(worker_metrics_ports(client, settings.keys).values()))

        def probe() -> dict[str, Any]:
            stats, metrics = sim_stats(sim.url), scrape(port)
            return {
                "sim_s": stats["sim_time_s"],
                "decoded": stats["decoded_tokens"],
                "running": stats["running"],
                "waiting": stats["waiting"],
                "bound": metrics.get("thinkfleet_inflight_bound", float("nan")),
                "inflight": metrics.get("thinkfleet_inflight_requests", float("nan")),
            }

        sampler = Sampler(probe, interval_s=1.0).start()
        commit(staged)
        time.sleep(wall_s)
        samples = [s for s in sampler.stop() if "error" not in s]
        done = client.scard(settings.keys.done(JOB))
    finally:
        for worker in workers:
            worker.terminate()
        sim.stop()
    t_end = samples[-1]["sim_s"]
    half = [s for s in samples if s["sim_s"] >= t_end / 2]
    bounds = [s["bound"] for s in half]
    mean = statistics.fmean(bounds)
    return {
        "bound": "adaptive" if fixed is None else str(fixed),
        "sim_s": t_end,
        "tok_s": (half[-1]["decoded"] - half[0]["decoded"]) / (half[-1]["sim_s"] - half[0]["sim_s"]),
        "prompts_done": done,
        "bound_mean": mean,
        "bound_cv": statistics.pstdev(bounds) / mean,
        "bound_spread": (max(bounds) - min(bounds)) / mean,
        "waiting_mean": statistics.fmean(s["waiting"] for s in half),
        "running_mean": statistics.fmean(s["running"] for s in half),
        "timeline": [(s["sim_s"], s["bound"], s["running"], s["waiting"]) for s in samples],
    }


def bench_http(best_fixed: int, default_fixed: int, time_scale: float = TIME_SCALE, wall_s: float = RUN_WALL_S) -> dict:
    """Adaptive, the best fixed bound and the default one, one after the other on one private Redis."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-adaptive-http-"))
    redis_proc = RedisProcess(workdir / "redis").start()
    try:
        runs = [run_one(redis_proc.url(), workdir, fixed, time_scale, wall_s) for fixed in (None, best_fixed)]
        if default_fixed != best_fixed:
            runs.append(run_one(redis_proc.url(), workdir, default_fixed, time_scale, wall_s))
    finally:
        redis_proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"time_scale": time_scale, "wall_s_per_run": wall_s, "engine": ENGINE, "runs": runs}
