"""One fleet run: N simulated hosts (a simulator and a worker each) against the pool client over N more.

Both sides start at the same instant on the same prompts in the same order; the system side goes
through Redis, Celery and Parquet, the pool side is ``bench.pool`` with the same bound per server.
Used by bench_fleet.py for the scaling sweep and the tail experiments.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import analysis
from bench.harness import (
    DECODE_TOK_S,
    PER_REQUEST_TOK_S,
    CpuMeter,
    PoolProcess,
    RedisProcess,
    Sampler,
    bench_settings,
    commandstats,
    commandstats_delta,
    commit,
    loadavg,
    proc_cpu_s,
    register_job,
    sampling_params,
    save_prompts,
    scrape,
    sim_args,
    sim_stats,
    stage,
    start_sims,
    start_workers,
    stop_sims,
    wait_for,
    worker_metrics_ports,
)


@dataclass
class FleetConfig:
    hosts: int
    bound: int
    time_scale: float
    tick_ms: float = 20.0
    #: Per-host speed factors (1.0 = the seed's server); a degraded host has e.g. 0.5.
    host_speed: tuple[float, ...] | None = None
    sample_interval_s: float = 1.0


def run_fleet(cfg: FleetConfig, prompts: dict[str, list[int]], order: list[str], job: str) -> dict[str, Any]:
    """Run the job on both sides; returns figures (see :func:`_figures`) and raw per-request arrays."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{cfg.hosts}-"))
    redis_proc = RedisProcess(workdir / "redis").start()
    client = redis_proc.client()
    settings = bench_settings(redis_proc.url, str(workdir / "out"))
    keys = settings.keys
    speeds = cfg.host_speed or (1.0,) * cfg.hosts

    def args_for(k: float) -> list[str]:
        return [
            *sim_args(cfg.time_scale, cfg.bound, DECODE_TOK_S * k, PER_REQUEST_TOK_S * k),
            "--tick-ms",
            str(cfg.tick_ms),
        ]

    sims = [start_sims(1, args_for(k))[0] for k in speeds]
    pool_sims = [start_sims(1, args_for(k))[0] for k in speeds]
    workers: list[Any] = []
    pool: PoolProcess | None = None
    try:
        workers = start_workers(settings, [s.url for s in sims], cfg.bound, workdir / "logs")
        ports = worker_metrics_ports(client, keys)
        params = sampling_params()
        register_job(client, keys, job, prompts, params)
        save_prompts(workdir / "prompts.npz", prompts, order)
        staged = stage(settings, job, prompts, order)
        start_at = time.time() + 3.0
        pool = PoolProcess(
            [s.url for s in pool_sims],
            cfg.bound,
            workdir / "prompts.npz",
            workdir / "pool.json",
            params=params,
            start_at=start_at,
        ).start()

        def probe() -> dict[str, Any]:
            out: dict[str, Any] = {"done": client.scard(keys.done(job)), "queued": client.llen(settings.queue)}
            for name, port in ports.items():
                m = scrape(port)
                out[f"inflight_seconds:{name}"] = m.get("thinkfleet_inflight_seconds_total", 0.0)
            out["system_decoded"] = sum(sim_stats(s.url)["decoded_tokens"] for s in sims)
            out["pool_decoded"] = sum(sim_stats(s.url)["decoded_tokens"] for s in pool_sims)
            return out

        pids = {f"worker:{w.name}": w.proc.pid for w in workers}
        pids |= {f"sim:{i}": s.proc.pid for i, s in enumerate(sims)}  # type: ignore[union-attr]
        pids |= {f"pool_sim:{i}": s.proc.pid for i, s in enumerate(pool_sims)}  # type: ignore[union-attr]
        meter = CpuMeter({**pids, "redis": redis_proc.pid, "pool": pool.pid})
        stats0 = commandstats(client)
        time.sleep(max(0.0, start_at - time.time()))
        sampler = Sampler(probe, interval_s=cfg.sample_interval_s).start()
        meter.start()
        load_before = loadavg()
        t0 = commit(staged)
        n = len(prompts)
        timeout = 20 * n * 1300 / (860 * cfg.hosts * min(speeds)) / cfg.time_scale + 300
        wait_for(lambda: client.scard(keys.done(job)) >= n, timeout, 0.1, "all prompts committed")
        t_done = time.time()
        workers_cpu = {w.name: proc_cpu_s(w.proc.pid) - meter.cpu0[f"worker:{w.name}"] for w in workers}
        redis_cpu = proc_cpu_s(redis_proc.pid) - meter.cpu0["redis"]
        stats1 = commandstats(client)
        pool_result = pool.result(timeout)
        meter.stop({"pool": pool_result["cpu_s"] + meter.cpu0["pool"]})
        samples = sampler.stop()
        load_after = loadavg()
    finally:
        if pool is not None:
            pool.kill()
        for w in workers:
            w.terminate(30)
        stop_sims(sims + pool_sims)
    stored = analysis.stored_requests(settings.output_uri, job)
    once = analysis.exactly_once(settings.output_uri, job, set(prompts))
    commits = analysis.commit_times(client, keys, job)
    redis_proc.stop()
    shutil.rmtree(workdir, ignore_errors=True)

    # Workers are named host0…host{N-1} in simulator order; the pool's servers are numbered the same way.
    server_names = np.array([f"host{i}" for i in pool_result["server"]])
    system = (stored["start"], stored["end"], commits, stored["worker"], stored["tokens"])
    reference = (
        np.array(pool_result["start"]),
        np.array(pool_result["end"]),
        np.array(pool_result["end"]),
        server_names,
        np.array(pool_result["tokens"]),
    )
    cpu = meter.summary()
    run_wall = t_done - t0
    groups = {
        "workers": sum(workers_cpu.values()),
        "system_sims": sum(meter.seconds(k) for k in pids if k.startswith("sim:")),
        "pool_sims": sum(meter.seconds(k) for k in pids if k.startswith("pool_sim:")),
        "pool_client": meter.seconds("pool"),
        "redis": redis_cpu,
    }
    return {
        "hosts": cfg.hosts,
        "host_speed": list(speeds),
        "prompts": n,
        "load_average_before_after": [load_before, load_after],
        "exactly_once": once,
        "system": _figures(system, t0, cfg, samples, "system_decoded"),
        "pool": _figures(reference, pool_result["t0"], cfg, samples, "pool_decoded"),
        "start_skew_s": round(pool_result["t0"] - t0, 4),
        "cpu": {
            "cores_used": {k: round(v / run_wall, 3) for k, v in groups.items()},
            "worker_ms_per_request": round(1000 * groups["workers"] / n, 3),
            "redis_ms_per_request": round(1000 * redis_cpu / n, 3),
            "max_worker_core_share": round(max(workers_cpu.values()) / run_wall, 3),
            "machine_busy_share": cpu["machine_busy_share"],
            "ours_share_of_machine": cpu["ours_share_of_machine"],
        },
        "redis_commands_per_prompt": {
            k: round(v["calls"] / n, 3) for k, v in commandstats_delta(stats0, stats1).items()
        },
        "redis_usec_per_prompt": round(sum(v["usec"] for v in commandstats_delta(stats0, stats1).values()) / n, 2),
        "_raw": {
            "system": system,
            "pool": reference,
            "t0": t0,
            "pool_json": {"prompt_ids": pool_result["prompt_ids"], "tokens": pool_result["tokens"]},
        },
    }


def _figures(
    side: tuple[np.ndarray, ...], t0: float, cfg: FleetConfig, samples: list[dict[str, Any]], decoded_key: str
) -> dict[str, Any]:
    starts, ends, done, hosts, tokens = side
    k = cfg.time_scale
    fig = analysis.tail(done, t0)
    # The last 5 % on the GPU side: generations ending (a row's commit may wait for its group).
    gpu = analysis.tail(ends, t0)
    drained = float(starts.max())
    makespan = fig["makespan_s"]
    # Steady state: from the moment every host has reached its bound until the queue drained.
    full = {}
    for h in sorted(set(hosts.tolist())):
        mine = hosts == h
        full[str(h)] = analysis.first_full(starts[mine], ends[mine], cfg.bound)
    all_full = max(full.values())
    a = all_full if np.isfinite(all_full) and all_full < drained else t0 + 0.1 * (drained - t0)
    # A host's own steady state: from reaching its bound until its last prompt started (its share of the
    # queue, including messages it had reserved, ran out).
    per_host_occ = {}
    for h, t in full.items():
        mine = hosts == h
        last = float(starts[mine].max())
        ok_window = np.isfinite(t) and t < last
        per_host_occ[h] = (
            round(analysis.occupancy(starts[mine], ends[mine], cfg.bound, t, last), 4) if ok_window else None
        )
    # GPU-side throughput over that window, from the simulators' own decoded-token counters.
    ok = [s for s in samples if decoded_key in s]
    steady = (analysis.counter_at(ok, decoded_key, drained) - analysis.counter_at(ok, decoded_key, a)) / (
        (drained - a) * k
    )
    return {
        "makespan_sim_s": round(makespan * k, 1),
        "makespan_wall_s": round(makespan, 3),
        "throughput_tok_s": round(float(tokens.sum()) / (makespan * k), 1),
        "steady_throughput_tok_s": round(steady, 1),
        "tail_95_to_100_share": round(gpu["tail_s"] / makespan, 4),
        "commit_lag_after_last_generation_s": round((makespan - gpu["makespan_s"]) * k, 1),
        "tail_sim_s": round(gpu["tail_s"] * k, 1),
        "queue_drained_sim_s": round((drained - t0) * k, 1),
        "occupancy_steady_per_host": per_host_occ,
        "all_hosts_at_bound_after_sim_s": round((a - t0) * k, 1),
        "host_finish_sim_s": {h: round(v * k, 1) for h, v in analysis.per_host_finish(hosts, ends, t0).items()},
    }
