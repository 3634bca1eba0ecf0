"""What one Redis and the producer can sustain, measured on this machine.

- :func:`redis_ceiling` — Redis's CPU seconds per completed prompt, read from ``/proc`` during a fleet
  run (every command of the real traffic: kombu delivery and ack emulation, Celery events, claims,
  group commits, heartbeats), turned into "prompts per second at one saturated core"; cross-checked
  with redis-benchmark's raw command rate and the commands per prompt counted by INFO commandstats.
- :func:`enqueue_rate` — ``producer.enqueue`` (encode + stage + one atomic commit) of token-id prompts,
  prompts/s and the Redis memory the queued messages take.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import bench_settings, commit, make_prompts, stage
from testing.redis_process import RedisProcess


def redis_benchmark_ops(port: int, requests: int = 100_000, clients: int = 50) -> dict[str, float]:
    """redis-benchmark requests/s without pipelining (each command its own round trip, as in our traffic)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {}
    out = subprocess.run(
        [
            binary,
            "-p",
            str(port),
            "-q",
            "-n",
            str(requests),
            "-c",
            str(clients),
            "-r",
            "100000",
            "-t",
            "set,get,lpush,rpop,hset,sadd,zadd",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    rates = {}
    for line in out.stdout.replace("\r", "\n").splitlines():
        m = re.match(r"([A-Z_]+)(?:\s*\([^)]*\))?: ([\d.]+) requests per second", line.strip())
        if m:
            rates[m.group(1).lower()] = float(m.group(2))
    return rates


#: Commands a Lua script runs are counted by commandstats too; these never cross the network.
_INSIDE_SCRIPTS = ("sismember", "hexists", "exists")


def redis_ceiling(redis_cpu_ms_per_prompt: float, commands_per_prompt: dict[str, float]) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-redis-"))
    proc = RedisProcess(workdir).start()
    try:
        rates = redis_benchmark_ops(proc.port)
    finally:
        proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    bench_polling = ("scard", "llen", "info", "hgetall")  # the benchmark's own probes, not the system's
    per_prompt = {k: v for k, v in commands_per_prompt.items() if k not in bench_polling}
    round_trips = sum(v for k, v in per_prompt.items() if k not in _INSIDE_SCRIPTS)
    median_rate = float(np.median(list(rates.values()))) if rates else float("nan")
    return {
        "redis_cpu_ms_per_prompt": redis_cpu_ms_per_prompt,
        "prompts_per_s_at_one_core_from_cpu": round(1000 / redis_cpu_ms_per_prompt, 0),
        "redis_benchmark_requests_per_s": rates,
        "commands_per_prompt": round(sum(per_prompt.values()), 2),
        "round_trips_per_prompt_approx": round(round_trips, 2),
        "prompts_per_s_from_command_rate": round(median_rate / round_trips, 0) if round_trips else None,
    }


def enqueue_rate(prompts: int = 88_088, seed: int = 5) -> dict[str, Any]:
    """Encode, stage and commit ``prompts`` token-id prompts (128–512 tokens) into a private Redis."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-enqueue-"))
    proc = RedisProcess(workdir).start()
    try:
        client = proc.client()
        settings = bench_settings(proc.url(), str(workdir / "out"))
        data = make_prompts(prompts, seed=seed)
        before = int(client.info("memory")["used_memory"])
        t = time.perf_counter()
        staged = stage(settings, "enqueue-rate", data)
        commit(staged)
        seconds = time.perf_counter() - t
        queued = int(client.llen(settings.queue))
        after = int(client.info("memory")["used_memory"])
    finally:
        proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "prompts": prompts,
        "queued": queued,
        "seconds": round(seconds, 2),
        "prompts_per_s": round(prompts / seconds, 0),
        "redis_bytes_per_message": round((after - before) / prompts, 0),
        "mean_prompt_tokens": round(float(np.mean([len(v) for v in data.values()])), 0),
    }
