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
    Sampler,
    bench_settings,
    commandstats,
    commandstats_delta,
    commit,
    cpu_pressure_s,
    loadavg,
    proc_cpu_s,
    proc_runqueue_wait_s,
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
from testing.redis_process import RedisProcess


@dataclass
class FleetConfig:
    hosts: int
    bound: int
    time_scale: float
    tick_ms: float = 20.0
    #: Per-host speed factors (1.0 = the seed's server); a degraded host has e.g. 0.5.
    host_speed: tuple[float, ...] | None = None
    sample_interval_s: float = 0.5


def run_fleet(cfg: FleetConfig, prompts: dict[str, list[int]], order: list[str], job: str) -> dict[str, Any]:
    """Run the job on both sides; returns figures (see :func:`_figures`) and raw per-request arrays."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{cfg.hosts}-"))
    redis_proc = RedisProcess(workdir / "redis").start()
    client = redis_proc.client()
    settings = bench_settings(redis_proc.url(), str(workdir / "out"))
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

        groups = {
            "workers": [w.proc.pid for w in workers],
            "system_sims": [s.proc.pid for s in sims],  # type: ignore[union-attr]
            "pool_sims": [s.proc.pid for s in pool_sims],  # type: ignore[union-attr]
            "pool_client": [pool.pid],
            "redis": [redis_proc.pid],
        }

        def probe() -> dict[str, Any]:
            out: dict[str, Any] = {"done": client.scard(keys.done(job)), "queued": client.llen(settings.queue)}
            for name, port in ports.items():
                m = scrape(port)
                out[f"inflight_seconds:{name}"] = m.get("thinkfleet_inflight_seconds_total", 0.0)
            for side, group in (("system", sims), ("pool", pool_sims)):
                for i, sim in enumerate(group):
                    sent = time.time()
                    st = sim_stats(sim.url)
                    # Stamped at the middle of the round trip: the engine advanced to "now" while answering.
                    out[f"{side}:{i}"] = ((sent + time.time()) / 2, st["decoded_tokens"], st["running"])
            for name, members in groups.items():
                out[f"wait:{name}"] = sum(proc_runqueue_wait_s(pid) for pid in members)
            out["cpu_pressure_s"] = cpu_pressure_s()
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
    cpu_groups = {
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
        **_both_sides({"system": system, "pool": reference}, start_at, cfg, samples, list(groups)),
        "start_skew_s": {
            "system_commit": round(t0 - start_at, 4),
            "pool_client": round(pool_result["t0"] - start_at, 4),
        },
        "cpu": {
            "cores_used": {k: round(v / run_wall, 3) for k, v in cpu_groups.items()},
            "worker_ms_per_request": round(1000 * cpu_groups["workers"] / n, 3),
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


def _both_sides(
    sides: dict[str, tuple[np.ndarray, ...]],
    t_start: float,
    cfg: FleetConfig,
    samples: list[dict[str, Any]],
    groups: list[str],
) -> dict[str, Any]:
    """Figures of both sides over the same instants: one start (the instant both were told to begin), one
    end definition (the last generation back at the client), one steady window for both."""
    k = cfg.time_scale
    ok = [s for s in samples if "error" not in s]
    all_full, drained = {}, {}
    for side, (starts, ends, _, hosts, _) in sides.items():
        per_host = [analysis.first_full(starts[hosts == h], ends[hosts == h], cfg.bound) for h in set(hosts.tolist())]
        all_full[side] = max(per_host)
        drained[side] = float(starts.max())
    # The steady window: every host of both sides at its bound, until the first side's queue drained.
    a, b = max(all_full.values()), min(drained.values())
    window_kind = "all hosts of both sides at their bound → first queue drained"
    if not (np.isfinite(a) and a < b):
        a, window_kind = t_start + 0.1 * (b - t_start), "after the first 10 % of the queue phase → first queue drained"
    out: dict[str, Any] = {
        "steady_window": {
            "from_sim_s": round((a - t_start) * k, 1),
            "to_sim_s": round((b - t_start) * k, 1),
            "kind": window_kind,
            "samples": sum(1 for s in ok if a <= s["t"] <= b),
        },
        "starvation": _starvation(ok, groups, a, b, t_start, drained),
    }
    for side, arrays in sides.items():
        out[side] = _figures(side, arrays, t_start, cfg, ok, (a, b), all_full[side], drained[side])
    out["inflight_series"] = _inflight_series(sides, ok, t_start, k)
    return out


def _inflight_series(
    sides: dict[str, tuple[np.ndarray, ...]], samples: list[dict[str, Any]], t_start: float, k: float
) -> dict[str, list[float]]:
    """At each sample: requests running in each side's simulators (as they reported) and in flight by the
    client's own timestamps — the gap is requests sent but not yet admitted, or answered but not yet read."""
    out: dict[str, list[float]] = {"t_sim_s": []}
    for s in samples:
        out["t_sim_s"].append(round((s["t"] - t_start) * k, 1))
        for side, (starts, ends, *_) in sides.items():
            sim = [v[2] for key, v in s.items() if key.startswith(f"{side}:")]
            out.setdefault(f"{side}_sim_running", []).append(float(sum(sim)))
            out.setdefault(f"{side}_client_inflight", []).append(float(np.sum((starts <= s["t"]) & (ends > s["t"]))))
    return out


def _starvation(
    samples: list[dict[str, Any]], groups: list[str], a: float, b: float, t_start: float, drained: dict[str, float]
) -> dict[str, Any]:
    """Threads of each process group waiting for a CPU (run-queue wait ÷ wall), in the steady window and from
    the start to the last queue drained; and the share of time some task on the machine waited (CPU PSI)."""
    out: dict[str, Any] = {}
    end = max(drained.values())
    for label, (t_from, t_to) in (("steady_window", (a, b)), ("queue_phase", (t_start, end))):
        row = {}
        for name in [*(f"wait:{g}" for g in groups), "cpu_pressure_s"]:
            pts = [s for s in samples if np.isfinite(s.get(name, float("nan")))]
            if len(pts) < 2 or t_to <= t_from:
                continue
            row[name.removeprefix("wait:")] = round(
                (analysis.counter_at(pts, name, t_to) - analysis.counter_at(pts, name, t_from)) / (t_to - t_from), 3
            )
        out[label] = row
    return out


def _sim_series(samples: list[dict[str, Any]], side: str) -> dict[str, list[tuple[float, float, float]]]:
    """Per simulator of ``side``: (wall time, decoded tokens, requests running) as that simulator reported them."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for s in samples:
        for key, value in s.items():
            if key.startswith(f"{side}:"):
                out.setdefault(key, []).append(tuple(value))
    return out


def _figures(
    side: str,
    arrays: tuple[np.ndarray, ...],
    t_start: float,
    cfg: FleetConfig,
    samples: list[dict[str, Any]],
    window: tuple[float, float],
    all_full: float,
    drained: float,
) -> dict[str, Any]:
    starts, ends, done, hosts, tokens = arrays
    k = cfg.time_scale
    a, b = window
    gen = analysis.tail(ends, t_start)  # the last generation back at the client: the same end on both sides
    makespan = gen["makespan_s"]
    per_host_occ = {}
    for h in sorted(set(hosts.tolist())):
        # A host's own steady state: from reaching its bound until its last prompt started (its share of the
        # queue, including messages it had reserved, ran out).
        mine = hosts == h
        t, last = analysis.first_full(starts[mine], ends[mine], cfg.bound), float(starts[mine].max())
        ok_window = np.isfinite(t) and t < last
        per_host_occ[str(h)] = (
            round(analysis.occupancy(starts[mine], ends[mine], cfg.bound, t, last), 4) if ok_window else None
        )
    # GPU-side throughput in the common window, from each simulator's own decoded-token counter.
    series = _sim_series(samples, side)
    decoded = sum(
        float(
            np.interp(b, [p[0] for p in pts], [p[1] for p in pts])
            - np.interp(a, [p[0] for p in pts], [p[1] for p in pts])
        )
        for pts in series.values()
    )
    running = [p[2] for pts in series.values() for p in pts if a <= p[0] <= b]
    n_hosts = len(set(hosts.tolist()))
    return {
        "makespan_sim_s": round(makespan * k, 1),
        "makespan_wall_s": round(makespan, 3),
        "done_makespan_sim_s": round((float(np.max(done)) - t_start) * k, 1),
        "commit_lag_after_last_generation_s": round((float(np.max(done)) - float(ends.max())) * k, 1),
        "throughput_tok_s": round(float(tokens.sum()) / (makespan * k), 1),
        "steady_throughput_tok_s": round(decoded / ((b - a) * k), 1),
        # In the window, per host: requests the client counted as in flight vs. running in the simulator.
        "steady_client_inflight_per_host": round(
            analysis.occupancy(starts, ends, cfg.bound, a, b) * cfg.bound / n_hosts, 1
        ),
        "steady_sim_running_per_host": round(float(np.mean(running)), 1) if running else None,
        "tail_95_to_100_share": round(gen["tail_s"] / makespan, 4),
        "tail_sim_s": round(gen["tail_s"] * k, 1),
        "queue_drained_sim_s": round((drained - t_start) * k, 1),
        "occupancy_steady_per_host": per_host_occ,
        "all_hosts_at_bound_after_sim_s": round((all_full - t_start) * k, 1) if np.isfinite(all_full) else None,
        "host_finish_sim_s": {h: round(v * k, 1) for h, v in analysis.per_host_finish(hosts, ends, t_start).items()},
    }
