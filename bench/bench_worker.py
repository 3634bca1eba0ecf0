"""Worker occupancy and overhead (issue #4): one host against the plain asyncio pool client.

Three identical simulated hosts run side by side, from the same instant, on the same prompts:

1. **system** — a real ``worker`` (celery) fed from Redis, committing Parquet, bound ``--bound``;
2. **pool** — ``bench.pool``: ``--bound`` coroutines refilling from an in-memory queue (the ideal);
3. **batch** — ``bench.pool --mode batch``: send ``--bound``, wait for all, repeat (the anti-pattern).

Reported: steady-state occupancy (time-weighted in-flight ÷ bound, from the first moment the bound
is reached until the last prompt has started — i.e. until the queue drains), makespans and their
ratio to the pool's, and the worker process's CPU per completed request (``/proc``), Parquet included.

    .venv/bin/python -m bench.bench_worker            # ~2 min; writes bench/results/worker.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import analysis
from bench.harness import (
    RESULTS,
    CpuMeter,
    PoolProcess,
    Sampler,
    bench_settings,
    code_version,
    commandstats,
    commandstats_delta,
    commit,
    loadavg,
    make_prompts,
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
    tool_path,
    wait_for,
    worker_metrics_ports,
    write_json,
)
from bench.report import code_stamp, table, update_section
from testing.redis_process import RedisProcess
from thinkfleet.settings import Settings
from workers.runtime import early_flush_rows

JOB = "bench-worker"
#: Prompts per second one real host completes: 860 output tok/s ÷ the seed's mean of 1,416 tokens.
REAL_PROMPTS_PER_S = round(860 / 1416, 3)
#: Worker CPU per completed request the worker should stay under here (issue: a lighter worker).
GOAL_MS = 3.0


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    redis_proc = RedisProcess(workdir / "redis").start()
    client = redis_proc.client()
    settings = bench_settings(redis_proc.url(), str(workdir / "out")).with_overrides(max_inflight=args.bound)
    keys = settings.keys
    sims = start_sims(3, sim_args(args.time_scale, max_running=args.bound))
    workers: list[Any] = []
    pools: list[PoolProcess] = []
    try:
        workers = start_workers(settings, [sims[0].url], args.bound, workdir / "logs")
        port = next(iter(worker_metrics_ports(client, keys).values()))
        # The worker's background cost (heartbeats, health probes, Celery's loop) while the queue is empty.
        idle0, idle_t0 = proc_cpu_s(workers[0].proc.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_share = (proc_cpu_s(workers[0].proc.pid) - idle0) / (time.monotonic() - idle_t0)
        prompts = make_prompts(args.prompts, seed=args.seed)
        params = sampling_params()
        register_job(client, keys, JOB, prompts, params)
        save_prompts(workdir / "prompts.npz", prompts)
        staged = stage(settings, JOB, prompts)
        start_at = time.time() + 3.0
        pool = PoolProcess(
            [sims[1].url], args.bound, workdir / "prompts.npz", workdir / "pool.json", params=params, start_at=start_at
        ).start()
        batch = PoolProcess(
            [sims[2].url],
            args.bound,
            workdir / "prompts.npz",
            workdir / "batch.json",
            mode="batch",
            params=params,
            start_at=start_at,
        ).start()
        pools = [pool, batch]

        def probe() -> dict[str, Any]:
            m = scrape(port)
            out = {
                "inflight": m.get("thinkfleet_inflight_requests", 0.0),
                "inflight_seconds": m.get("thinkfleet_inflight_seconds_total", 0.0),
                "held": m.get("thinkfleet_held_messages", 0.0),
                "queued": client.llen(settings.queue),
                "done": client.scard(keys.done(JOB)),
            }
            for name, sim in zip(("system", "pool", "batch"), sims, strict=True):
                out[f"{name}_running"] = sim_stats(sim.url)["running"]
            return out

        meter = CpuMeter(
            {
                "worker": workers[0].proc.pid,
                "sim_system": sims[0].proc.pid,  # type: ignore[union-attr]
                "sim_pool": sims[1].proc.pid,
                "sim_batch": sims[2].proc.pid,  # type: ignore[union-attr]
                "redis": redis_proc.pid,
                "pool": pool.pid,
                "batch": batch.pid,
            }
        )
        stats0 = commandstats(client)
        time.sleep(max(0.0, start_at - time.time()))
        sampler = Sampler(probe, interval_s=0.25).start()
        meter.start()
        load_before = loadavg()
        t0 = commit(staged)
        timeout = 20 * args.prompts * 1300 / 860 / args.time_scale + 120
        wait_for(lambda: client.scard(keys.done(JOB)) >= args.prompts, timeout, 0.05, "all prompts committed")
        worker_cpu_done = proc_cpu_s(workers[0].proc.pid)  # type: ignore[union-attr]
        t_done = time.time()
        stats1 = commandstats(client)
        pool_result = pool.result(timeout)
        batch_result = batch.result(timeout)
        meter.stop(
            {"pool": pool_result["cpu_s"] + meter.cpu0["pool"], "batch": batch_result["cpu_s"] + meter.cpu0["batch"]}
        )
        samples = sampler.stop()
        load_after = loadavg()
        sim_end = [sim_stats(s.url) for s in sims]
    finally:
        for p in pools:
            p.kill()
        for w in workers:
            w.terminate(30)
        stop_sims(sims)
    stored = analysis.stored_requests(settings.output_uri, JOB)
    once = analysis.exactly_once(settings.output_uri, JOB, set(prompts))
    commits = analysis.commit_times(client, keys, JOB)
    redis_proc.stop()

    out: dict[str, Any] = {
        "config": {
            "prompts": args.prompts,
            "bound": args.bound,
            "time_scale": args.time_scale,
            "seed": args.seed,
            "decode_tok_s": 860,
            "per_request_tok_s": 40,
            "max_new_tokens": params["max_new_tokens"],
            "worker_settings": worker_defaults(settings),
        },
        "load_average_before_after": [load_before, load_after],
        "code": code_version(),
        "exactly_once": once,
        "output_tokens": {
            n: s["generation_tokens_total"] for n, s in zip(("system", "pool", "batch"), sim_end, strict=True)
        },
        "peak_running": {n: s["peak_running"] for n, s in zip(("system", "pool", "batch"), sim_end, strict=True)},
    }
    sides = {
        "system": (stored["start"], stored["end"], commits),
        "pool": _arrays(pool_result),
        "batch": _arrays(batch_result),
    }
    # Each side from its own start: the commit of the enqueue, and the pool clients' first request.
    starts_at = {"system": t0, "pool": pool_result["t0"], "batch": batch_result["t0"]}
    out["start_skew_s"] = {k: round(v - t0, 4) for k, v in starts_at.items()}
    for name, (starts, ends, done) in sides.items():
        t0 = starts_at[name]
        full = analysis.first_full(starts, ends, args.bound)
        drained = float(starts.max())
        fig = analysis.tail(done, t0)
        # The last 5 % on the GPU side: generations ending (a row's commit may wait for its group).
        gpu = analysis.tail(ends, t0)
        out[name] = {
            "makespan_wall_s": round(fig["makespan_s"], 3),
            "makespan_sim_s": round(fig["makespan_s"] * args.time_scale, 1),
            "tail_95_to_100_share": round(gpu["tail_s"] / fig["makespan_s"], 4),
            "commit_lag_after_last_generation_s": round((fig["makespan_s"] - gpu["makespan_s"]) * args.time_scale, 1),
            "reached_bound_after_s": round(full - t0, 3),
            "queue_drained_after_s": round(drained - t0, 3),
            "occupancy_steady": round(analysis.occupancy(starts, ends, args.bound, full, drained), 4),
            "occupancy_from_enqueue": round(analysis.occupancy(starts, ends, args.bound, t0, drained), 4),
        }
    s = out["system"]
    t0 = starts_at["system"]
    full, drained = t0 + s["reached_bound_after_s"], t0 + s["queue_drained_after_s"]
    s["occupancy_steady_worker_metric"] = round(
        analysis.metric_occupancy(samples, "inflight_seconds", args.bound, full, drained), 4
    )
    for name in ("system", "batch"):
        out[name]["makespan_vs_pool"] = round(out[name]["makespan_wall_s"] / out["pool"]["makespan_wall_s"], 4)
    worker_cpu = worker_cpu_done - meter.cpu0["worker"]
    cpu = meter.summary()
    cpu["worker_cpu_s_until_done"] = round(worker_cpu, 3)
    cpu["worker_ms_per_request"] = round(1000 * worker_cpu / args.prompts, 3)
    cpu["pool_client_ms_per_request"] = round(1000 * meter.seconds("pool") / args.prompts, 3)
    cpu["sim_ms_per_request"] = round(1000 * meter.seconds("sim_system") / args.prompts, 3)
    cpu["redis_ms_per_request"] = round(1000 * meter.seconds("redis") / args.prompts, 3)
    cpu["worker_utilisation_while_running"] = round(worker_cpu / (t_done - t0), 3)
    cpu["worker_idle_core_share"] = round(idle_share, 4)
    cpu["worker_ms_per_request_above_idle"] = round(1000 * (worker_cpu - idle_share * (t_done - t0)) / args.prompts, 3)
    out["cpu"] = cpu
    out["redis_commands_per_prompt"] = {
        k: round(v["calls"] / args.prompts, 3) for k, v in commandstats_delta(stats0, stats1).items()
    }
    out["timeseries"] = _timeseries(samples, t0)
    try:
        _plot(out, sides, starts_at, args)
    except ImportError as exc:
        print(f"bench_worker: plot skipped ({exc.name} is not installed: pip install -e '.[bench]')")
    return out


#: Where the worker's CPU goes: the first bucket whose marker is in a sampled stack takes the sample.
PROFILE_BUCKETS = (
    ("Parquet write (storage.writer)", ("PartWriter.write",)),
    ("row + spans (workers.rows, storage.spans)", ("build_row",)),
    ("Celery task events (kombu fanout publish)", ("_flush_events", "EventDispatcher")),
    ("kombu ack emulation (MULTI HDEL/ZREM)", ("basic_ack", "QoS.ack")),
    ("kombu delivery + Celery dispatch (BRPOP, QoS.append, strategy)", ("_brpop_read", "Transport._deliver")),
    (
        "Celery pool threads (trace, hand-off to the loop)",
        ("fast_trace_task", "apply_target", "_WorkItem.run", "LoopPool."),
    ),
    ("SGLang call: HTTP + JSON (workers.client)", ("SGLangClient.generate",)),
    ("Redis ledger: claim / mark_part / finalize", ("Ledger.",)),
    ("heartbeat, health gate, metrics", ("LeaseKeeper", "HealthGate", "WorkerMetrics", "prometheus_client")),
    ("other work on the worker's event loop", ("EventLoopThread._run",)),
    ("Celery consumer loop, other", ("asynloop", "Hub.create_loop")),
)


def profile_worker(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """A second, shorter run of the worker alone under py-spy (GIL holder only, non-blocking)."""
    redis_proc = RedisProcess(workdir / "redis-profile").start()
    client = redis_proc.client()
    settings = bench_settings(redis_proc.url(), str(workdir / "out-profile"))
    sims = start_sims(1, sim_args(args.time_scale, max_running=args.bound))
    workers: list[Any] = []
    folded = workdir / "worker.folded"
    try:
        workers = start_workers(settings, [sims[0].url], args.bound, workdir / "logs-profile")
        prompts = make_prompts(args.profile_prompts, seed=args.seed + 1)
        register_job(client, settings.keys, JOB, prompts, sampling_params())
        staged = stage(settings, JOB, prompts)
        pid = workers[0].proc.pid
        spy = subprocess.Popen(
            [str(tool_path("py-spy")), "record", "--gil", "--nonblocking", "-r", "200",
             "-f", "raw", "-o", str(folded), "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)
        cpu0 = proc_cpu_s(pid)
        commit(staged)
        wait_for(lambda: client.scard(settings.keys.done(JOB)) >= len(prompts), 1800, 0.05, "profiled run")
        cpu = proc_cpu_s(pid) - cpu0
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    finally:
        for w in workers:
            w.terminate(30)
        stop_sims(sims)
        redis_proc.stop()
    return {"prompts": len(prompts), "worker_ms_per_request": round(1000 * cpu / len(prompts), 3),
            **summarise_profile(folded)}  # fmt: skip


def summarise_profile(folded: Path) -> dict[str, Any]:
    buckets: dict[str, int] = {name: 0 for name, _ in PROFILE_BUCKETS}
    buckets["other"] = 0
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        name = next((b for b, markers in PROFILE_BUCKETS if any(m in stack for m in markers)), "other")
        buckets[name] += n
    return {"samples": total, "shares": {k: round(v / total, 3) for k, v in buckets.items()} if total else {}}


def before_figures(r: dict[str, Any]) -> dict[str, Any]:
    """What a before/after comparison keeps of an earlier run: its CPU per request and its profile."""
    if r.get("before"):  # a run that was itself an "after" passes its own "before" on
        return r["before"]
    cpu = r["cpu"]
    keep = ("worker_ms_per_request", "pool_client_ms_per_request", "sim_ms_per_request", "redis_ms_per_request")
    return {
        "code": r.get("code", {}),
        "cpu": {k: cpu[k] for k in keep},
        "redis_commands_per_prompt": r.get("redis_commands_per_prompt", {}),
        "profile": r.get("profile"),
    }


def worker_defaults(settings: Settings) -> str:
    """The worker settings that shape occupancy, as this run had them (all defaults)."""
    s = settings
    return (
        f"defaults — group commit every flush_interval_s={s.flush_interval_s:g} or at "
        f"{early_flush_rows(s)} waiting rows, messages held = bound + {s.commit_headroom} (LoopPool: no thread each), "
        f"lease_s={s.lease_s:g}"
    )


def _arrays(result: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ends = np.array(result["end"])
    return np.array(result["start"]), ends, ends


def _timeseries(samples: list[dict[str, Any]], t0: float) -> dict[str, list[float]]:
    keep = [s for s in samples if "error" not in s]
    series: dict[str, list[float]] = {"t": [round(s["t"] - t0, 3) for s in keep]}
    for key in ("inflight", "held", "queued", "done", "system_running", "pool_running", "batch_running"):
        series[key] = [s.get(key, float("nan")) for s in keep]
    return series


def _plot(out: dict[str, Any], sides: dict[str, Any], starts_at: dict[str, float], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    k = args.time_scale
    for name, colour in (("system", "tab:blue"), ("pool", "tab:orange"), ("batch", "tab:grey")):
        starts, ends, done = sides[name]
        t0 = starts_at[name]
        t, inflight = analysis.inflight_curve(starts, ends, t0, 0.05)
        ax1.plot(
            t * k / 60, inflight, color=colour, lw=1, label=f"{name} (occupancy {out[name]['occupancy_steady']:.3f})"
        )
        ax2.plot(
            (np.sort(done) - t0) * k / 60,
            np.arange(1, len(done) + 1),
            color=colour,
            lw=1.2,
            label=f"{name}: makespan {out[name]['makespan_sim_s'] / 60:.1f} min",
        )
    ax1.axhline(args.bound, color="k", lw=0.5, ls=":")
    ax1.set_ylabel("requests in flight")
    ax1.legend(loc="lower left", fontsize=8)
    ax2.set_ylabel("prompts done")
    ax2.set_xlabel(f"simulated minutes (wall × {k:g})")
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"One host, bound {args.bound}, {args.prompts} prompts of the seed's length distribution")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    plt.close(fig)


def before_after(r: dict[str, Any]) -> str:
    """The CPU figures and profile of the ``--before`` run next to this run's (empty without one)."""
    before = r.get("before")
    if not before:
        return ""
    b, a = before["cpu"], r["cpu"]
    out = (
        f"- **Before / after** (the before run: {code_stamp(before.get('code')).rstrip('.')}): worker "
        f"{b['worker_ms_per_request']:.2f} → {a['worker_ms_per_request']:.2f} ms/request, with the bare pool client "
        f"at {b['pool_client_ms_per_request']:.2f} and {a['pool_client_ms_per_request']:.2f} ms/request in the same "
        f"runs (the pool client's figure shows how busy the machine was)."
    )
    pb, pa = before.get("profile"), r.get("profile")
    if not (pb and pa):
        return out
    rows = []
    for name in [n for n, _ in PROFILE_BUCKETS] + ["other"]:
        x, y = pb["shares"].get(name, 0.0), pa["shares"].get(name, 0.0)
        rows.append(
            [
                name,
                f"{x:.0%}",
                f"{x * pb['worker_ms_per_request']:.2f}",
                f"{y:.0%}",
                f"{y * pa['worker_ms_per_request']:.2f}",
            ]
        )
    rows.append(
        ["total (profiled run)", "", f"{pb['worker_ms_per_request']:.2f}", "", f"{pa['worker_ms_per_request']:.2f}"]
    )
    heads = ["where (py-spy, GIL holder)", "before share", "before ms/req", "after share", "after ms/req"]
    return out + "\n\n" + table(heads, rows) + "\n"


def markdown(r: dict[str, Any]) -> str:
    c, s, p, b, cpu = r["config"], r["system"], r["pool"], r["batch"], r["cpu"]
    rows = [
        [
            name,
            f"{d['occupancy_steady']:.4f}",
            f"{d['occupancy_from_enqueue']:.4f}",
            f"{d['makespan_sim_s'] / 60:.1f}",
            f"{d['makespan_wall_s']:.1f}",
            f"{d.get('makespan_vs_pool', 1.0):.3f}",
            f"{d['tail_95_to_100_share']:.3f}",
        ]
        for name, d in (
            ("worker (celery + Redis + Parquet)", s),
            ("in-process pool client", p),
            ("batch-and-wait client", b),
        )
    ]
    per = cpu["utilisation_of_one_core"]
    real_share = cpu["worker_ms_per_request"] * REAL_PROMPTS_PER_S / 1000
    prof = r.get("profile")
    breakdown = ""
    if prof:
        parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(prof["shares"].items(), key=lambda kv: -kv[1]) if v)
        breakdown = (
            "- **Where the worker's CPU goes** (py-spy `--gil --nonblocking`, a second run of "
            f"{prof['prompts']} prompts, "
            f"{prof['samples']} samples of the GIL holder, {prof['worker_ms_per_request']:.2f} ms/request): {parts}. "
            "A few hundred samples: shares move by several points between runs; 'other' is mostly stacks that "
            "py-spy read without their thread's root (non-blocking sampling)."
        )
    return f"""
`.venv/bin/python -m bench.bench_worker` — {c["prompts"]} prompts (seed's length distribution, `max_new_tokens`
{c["max_new_tokens"]}), one simulated host each (860 tok/s, ≤ 40 tok/s per request, `--max-running-requests`
{c["bound"]}), bound {c["bound"]}, time scale {c["time_scale"]:g}× — all three clients started at the same instant
against identical simulators. Worker settings: {c["worker_settings"]}. {code_stamp(r.get("code"))} Raw figures:
`bench/results/worker.json`.

{
        table(
            [
                "client",
                "occupancy (steady)",
                "occupancy (from enqueue)",
                "makespan (sim min)",
                "makespan (wall s)",
                "× pool",
                "last-5 % tail / makespan",
            ],
            rows,
        )
    }

- **Occupancy** = time-weighted mean in flight ÷ bound from the moment the bound is first reached until the
  last prompt has been sent (the queue drained); the worker's own `thinkfleet_inflight_seconds_total` gives
  {s["occupancy_steady_worker_metric"]:.4f} over the same window. It reached the bound
  {s["reached_bound_after_s"] * c["time_scale"]:.0f} sim s ({s["reached_bound_after_s"]:.2f} wall s) after the enqueue.
- **Worker CPU per completed request** (the whole `worker` process: Celery, Redis claim/finalize, HTTP,
  spans, Parquet; from `/proc`): **{cpu["worker_ms_per_request"]:.2f} ms** (goal ≤ {GOAL_MS:g} ms). The bare pool
  client spends {cpu["pool_client_ms_per_request"]:.2f} ms, the simulator {cpu["sim_ms_per_request"]:.2f} ms and
  Redis {cpu["redis_ms_per_request"]:.2f} ms per request; an idle worker uses {
        cpu["worker_idle_core_share"]:.1%} of a core.
  At real speed it hardly matters: a real host completes ≈ {REAL_PROMPTS_PER_S} prompts/s (860 tok/s ÷ 1,416
  tokens), which costs the worker {real_share:.2%} of one core (the benchmark's {c["time_scale"]:g}× time scale is what
  made it {cpu["worker_utilisation_while_running"]:.0%} here). Occupancy did not suffer from it.
- Exactly once: {r["exactly_once"]["committed_rows"]} committed rows, {r["exactly_once"]["raw_duplicate_rows"]} raw
  duplicates; all three simulators decoded the same tokens ({r["output_tokens"]["system"]:,} /
  {r["output_tokens"]["pool"]:,} / {r["output_tokens"]["batch"]:,}); peak running {r["peak_running"]["system"]}.
- CPU (share of one core over the run): worker {per["worker"]:.2f}, its simulator {per["sim_system"]:.2f},
  pool client {per["pool"]:.2f}, Redis {per["redis"]:.2f}; machine {cpu["machine_cores"]} cores,
  {cpu["machine_busy_share"]:.0%} busy overall (other engineers' tests included; load average
  {r["load_average_before_after"][0]} → {r["load_average_before_after"][1]}).
{breakdown}
{before_after(r)}

![in flight and done over time](bench/results/worker.png)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--bound", type=int, default=150)
    parser.add_argument("--time-scale", type=float, default=50.0, help="simulated seconds per wall second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--idle-s", type=float, default=10.0, help="measure the idle worker's CPU this long first")
    parser.add_argument("--out", type=Path, default=RESULTS / "worker.json")
    parser.add_argument("--no-markdown", action="store_true", help="don't rewrite the BENCHMARKS.md section")
    parser.add_argument("--profile-prompts", type=int, default=800, help="then profile the worker alone (0: skip)")
    parser.add_argument("--from-json", type=Path, help="only rewrite the BENCHMARKS.md section from a saved run")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, Parquet)")
    parser.add_argument(
        "--before", type=Path, help="a saved run (worker.json) to report as 'before' next to this one's CPU figures"
    )
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        result = json.loads(args.from_json.read_text())  # re-render the section from a saved run
    else:
        workdir = Path(tempfile.mkdtemp(prefix="bench-worker-"))
        try:
            result = run(args, workdir)
            if args.profile_prompts and tool_path("py-spy") is None:
                print("bench_worker: profile skipped (py-spy is not installed: pip install -e '.[bench]')")
            elif args.profile_prompts:
                result["profile"] = profile_worker(args, workdir)
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        if args.before:
            result["before"] = before_figures(json.loads(args.before.read_text()))
        write_json(args.out, result)
    if not args.no_markdown:
        update_section("bench_worker", "Worker occupancy & overhead", markdown(result))
    s, cpu = result["system"], result["cpu"]
    print(
        f"bench_worker: occupancy {s['occupancy_steady']:.4f} (goal ≥ 0.99), makespan {s['makespan_vs_pool']:.3f}× "
        f"pool (goal ≤ 1.05), batch-and-wait {result['batch']['makespan_vs_pool']:.3f}× pool, "
        f"worker CPU {cpu['worker_ms_per_request']:.2f} ms/request (goal ≤ {GOAL_MS:g}; pool client "
        f"{cpu['pool_client_ms_per_request']:.2f}), "
        f"exactly-once {'ok' if result['exactly_once']['ok'] else 'FAILED'} → {args.out}"
    )


if __name__ == "__main__":
    main()
