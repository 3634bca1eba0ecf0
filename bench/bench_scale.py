"""Scale benchmark: `producer status`/`wait`/`status --watch`/`submit` at the seed's size and ten times it.

    .venv/bin/python -m bench.bench_scale                               # 88,088 prompts (~5 min here)
    .venv/bin/python -m bench.bench_scale --prompts 88088 1000000       # and 1M (~20 min, ~2 GB of Redis)
    .venv/bin/python -m bench.bench_scale --prompts 88088 --submit      # + a real `producer submit` of a JSONL
    .venv/bin/python -m bench.bench_scale --from-json bench/results/scale.json  # the section only

Writes bench/results/scale.json and rewrites its section of BENCHMARKS.md.

Everything runs against a private ``redis-server --save ''`` on a free port. The fleet is not the point, so the
Redis state is built through the real code paths without it: messages encoded by the producer's
``Envelope``, staged by its ``Stager`` and ``PromptStager`` and committed by ``producer.state.commit`` (one
MULTI, as a submit does); then a real ``Ledger`` (two workers with heartbeats) claims and finalizes the first
half in group commits of 512, dead-letters 1 %, and holds 256 claims (their messages moved to kombu's unacked
hash, as a delivery does). The commands are then timed as subprocesses (``python -m producer.cli``):

- wall time and peak RSS (``wait4``'s ``ru_maxrss``; the submit's whole process tree, sampled from /proc);
- Redis time per call: the redis-server's CPU (``INFO cpu``, user + sys) before and after, ÷ calls, and INFO
  commandstats' own ``usec`` (what the commands cost inside Redis, without its event loop);
- ``wait`` and ``status --watch`` at their 2 s interval: Redis CPU over a 20 s window ÷ 20 s = share of a core;
- Redis memory per prompt (INFO used_memory after the state is built, less before, ÷ prompts).

The Redis ceiling is projected from the fleet benchmark's measured Redis CPU per completed prompt
(bench/results/fleet.json, all traffic of a real fleet) plus what this benchmark measures status and wait cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from bench.harness import RESULTS, code_version, write_json
from bench.report import code_stamp, table, update_section
from producer.enqueue import Stager
from producer.state import Existing, PromptStager, commit
from testing.harness import cli_env
from testing.redis_process import RedisProcess
from thinkfleet.broker.envelope import Envelope
from thinkfleet.broker.keys import KombuKeys
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.state.ledger import FinalRow, Ledger

JOB = "scale"
DATASETS = ("alpha", "beta")
#: Group commit size of the simulated workers (Settings.flush_rows).
GROUP = 512
#: Claims held (prompts running) while the commands are timed: 2 hosts × --max-inflight 128.
RUNNING = 256
#: `producer status` calls timed; the table shows the median's wall and RSS.
STATUS_RUNS = 5
#: Seconds `wait` and `status --watch` are watched for their Redis share.
WATCH_S = 20.0
#: The seed's measured rate per host (prompts/s), for the ceiling projection.
SEED_HOST_PROMPTS_S = 0.6


# -- Redis probes ---------------------------------------------------------------------------------------------
def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def idle_cpu_s_per_s(client: redis.Redis, seconds: float = 3.0) -> float:
    """The server's own CPU rate with no client working (serverCron, the probes themselves): subtracted from a
    command's measured CPU over its wall time, so what is left is what the command cost."""
    cpu0 = redis_cpu_s(client)
    commandstats_usec(client)
    time.sleep(seconds)
    commandstats_usec(client)
    return (redis_cpu_s(client) - cpu0) / seconds


def commandstats_usec(client: redis.Redis) -> tuple[int, int]:
    """(calls, usec) over every command so far."""
    calls = usec = 0
    for name, stats in client.info("commandstats").items():
        if name.startswith("cmdstat_"):
            calls += int(stats["calls"])
            usec += int(stats["usec"])
    return calls, usec


# -- building the state ---------------------------------------------------------------------------------------
def _task(settings: Settings, i: int, generation: str, prompt_tokens: int) -> PromptTask:
    ds = DATASETS[i % len(DATASETS)]
    ids = np.random.default_rng(i).integers(0, 163_584, prompt_tokens, dtype=np.uint32)  # Kimi's vocabulary
    return PromptTask(JOB, ds, f"{ds}/r{i}", i, content_hash(ids), pack_ids(ids), 0, 0, {}, generation)


def build_state(client: redis.Redis, settings: Settings, n: int, prompt_tokens: int) -> dict[str, Any]:
    """Enqueue ``n`` prompts through the producer's own staging and commit (no tokenizer)."""
    before = int(client.info("memory")["used_memory"])
    started = time.monotonic()
    generation = uuid.uuid4().hex[:16]
    envelope = Envelope(settings, 0)
    stager = Stager(client, settings.keys, JOB, settings.queue, 0)
    prompts = PromptStager(client, settings, JOB)
    per_ds: dict[str, int] = {}
    for start in range(0, n, 2000):
        tasks = [_task(settings, i, generation, prompt_tokens) for i in range(start, min(n, start + 2000))]
        for t in tasks:
            prompts.add(t.prompt_id, t.content_hash, t.dataset)
            per_ds[t.dataset] = per_ds.get(t.dataset, 0) + 1
        stager.push(envelope.encode_many(tasks))
    record = JobRecord(name=JOB, created_at=time.time())
    record.generation, record.datasets, record.prompts = generation, dict(sorted(per_ds.items())), n
    commit(client, settings, record, prompts, Existing(), stager)
    after = int(client.info("memory")["used_memory"])
    return {
        "build_s": round(time.monotonic() - started, 1),
        "redis_bytes_per_prompt": round((after - before) / n),
        "prompt_tokens": prompt_tokens,
        "redis_used_memory_mb": round(after / 2**20, 1),
    }


async def _progress(settings: Settings, n: int, generation: str, prompt_tokens: int) -> dict[str, Any]:
    """Half the job stored, 1 % dead, RUNNING claimed: through the real ledger, as two workers would."""
    ledgers = []
    for name in ("w1", "w2"):
        # a pool that waits for a connection (the default one refuses the 101st: GROUP claims run at once)
        client = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=64)
        )
        await client.set(settings.keys.heartbeat(name), "1")
        ledgers.append(Ledger(client, settings.keys, name))
    done, dead = n // 2, max(1, n // 100)
    sync = redis.Redis.from_url(settings.redis_url)
    cpu0, (calls0, usec0) = redis_cpu_s(sync), commandstats_usec(sync)
    for start in range(0, done, GROUP):
        ids = range(start, min(done, start + GROUP))
        ledger = ledgers[(start // GROUP) % 2]
        by_ds: dict[str, list[FinalRow]] = {}
        claims = await asyncio.gather(*(ledger.claim(JOB, f"{DATASETS[i % 2]}/r{i}") for i in ids))
        for i, claim in zip(ids, claims, strict=True):
            by_ds.setdefault(DATASETS[i % 2], []).append(FinalRow(f"{DATASETS[i % 2]}/r{i}", 800, True, False,
                                                                  epoch=claim.epoch))  # fmt: skip
        for ds, rows in by_ds.items():
            await ledger.finalize(JOB, ds, rows, alarm_min_rows=1000, alarm_share=0.5)
    cpu1, (calls1, usec1) = redis_cpu_s(sync), commandstats_usec(sync)
    for i in range(done, done + dead):
        task = _task(settings, i, generation, prompt_tokens)
        await ledgers[0].claim(JOB, task.prompt_id)
        await ledgers[0].dead_letter(task, "context_overflow", "bench", attempts=1)
    for i in range(done + dead, done + dead + RUNNING):
        await ledgers[i % 2].claim(JOB, f"{DATASETS[i % 2]}/r{i}")
    for ledger in ledgers:
        await ledger.r.aclose()
    # The first messages pushed are at the tail, where kombu pops: the finished ones leave the queue, the running
    # ones move to kombu's unacked hash (delivered, not acknowledged).
    k = done + dead + RUNNING
    taken = sync.lrange(settings.queue, -k, -1)
    unacked = KombuKeys(settings.key_prefix)
    with sync.pipeline(transaction=False) as p:
        p.ltrim(settings.queue, 0, -(k + 1))
        for j, raw in enumerate(taken[:RUNNING]):
            p.hset(unacked.unacked, f"tag-{j}", json.dumps([json.loads(raw), "", settings.queue]))
            p.zadd(unacked.unacked_index, {f"tag-{j}": time.time()})
        p.execute()
    sync.close()
    return {
        "done": done,
        "dead": dead,
        "running": RUNNING,
        "queued": n - k,
        "ledger_redis_cpu_us_per_prompt": round((cpu1 - cpu0) / done * 1e6, 1),
        "ledger_commands_per_prompt": round((calls1 - calls0) / done, 2),
        "ledger_usec_per_prompt": round((usec1 - usec0) / done, 1),
    }


# -- timing the commands --------------------------------------------------------------------------------------
def _run_cli(settings: Settings, *args: str, stop_after_s: float | None = None, idle: float = 0.0) -> dict[str, Any]:
    """Run ``python -m producer.cli ARGS``; returns wall time, peak RSS, Redis CPU (less ``idle`` CPU/s × wall)
    and commandstats spent."""
    client = redis.Redis.from_url(settings.redis_url)
    cpu0, (calls0, usec0) = redis_cpu_s(client), commandstats_usec(client)
    started = time.monotonic()
    # Peak RSS from GNU time: wait4's ru_maxrss of a child forked from this (large) process would count the
    # pages it shared before its exec; time's own child starts from a small process.
    rss_file = tempfile.NamedTemporaryFile(prefix="bench-scale-rss-", delete=False)  # noqa: SIM115
    rss_file.close()
    timed = ["/usr/bin/time", "-f", "%M", "-o", rss_file.name, sys.executable, "-m", "producer.cli", *args]
    proc = subprocess.Popen(timed, env=cli_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    out: list[str] = []
    err: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    errors = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    errors.start()
    if stop_after_s is not None:
        try:
            proc.wait(timeout=stop_after_s)
        except subprocess.TimeoutExpired:
            # --watch leaves on Ctrl-C; GNU time ignores SIGINT, so the signal goes to the whole group
            os.killpg(proc.pid, signal.SIGINT)
    _pid, status, _usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    try:
        peak_kb = int(Path(rss_file.name).read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        peak_kb = 0
    os.unlink(rss_file.name)
    reader.join(5)
    errors.join(5)
    cpu1, (calls1, usec1) = redis_cpu_s(client), commandstats_usec(client)
    client.close()
    return {
        "wall_s": round(wall, 3),
        "rc": os.waitstatus_to_exitcode(status),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "redis_cpu_ms": round(max(0.0, cpu1 - cpu0 - idle * wall) * 1e3, 2),
        "redis_commands": calls1 - calls0,
        "redis_command_usec": usec1 - usec0,
        "stdout": out[0] if out else "",  # the caller takes what it needs (pop) before the figures are kept
        "stderr_tail": (err[0] if err else "")[-600:],
    }


def measure_reads(settings: Settings, idle: float, reads: int = 20) -> dict[str, Any]:
    """``StatusReader.read()`` in this process (no interpreter start, no imports): the part that scales."""
    from producer.status import StatusReader

    client = redis.Redis.from_url(settings.redis_url)
    reader = StatusReader(client, settings, JOB)
    reader.read()  # scripts registered, connection open
    walls = []
    cpu0, (calls0, usec0) = redis_cpu_s(client), commandstats_usec(client)
    started = time.monotonic()
    for _ in range(reads):
        t = time.perf_counter()
        st = reader.read()
        walls.append(time.perf_counter() - t)
    wall = time.monotonic() - started
    cpu1, (calls1, usec1) = redis_cpu_s(client), commandstats_usec(client)
    client.close()
    return {
        "mode": st["mode"],
        "read_ms_median": round(float(np.median(walls)) * 1e3, 2),
        "redis_cpu_ms_per_read": round(max(0.0, cpu1 - cpu0 - idle * wall) / reads * 1e3, 3),
        "redis_commands_per_read": round((calls1 - calls0 - 2) / reads, 1),
        "redis_command_usec_per_read": round((usec1 - usec0) / reads, 1),
    }


def _last_json(text: str) -> dict[str, Any]:
    """The last JSON line a command printed ({} when it printed none: it failed, see its stderr_tail)."""
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def measure_commands(settings: Settings) -> dict[str, Any]:
    client = redis.Redis.from_url(settings.redis_url)
    idle = idle_cpu_s_per_s(client)
    client.close()
    reads = measure_reads(settings, idle)
    status = [_run_cli(settings, "status", JOB, "--json", idle=idle) for _ in range(STATUS_RUNS)]
    for s in status:
        s["mode"] = _last_json(s.pop("stdout")).get("mode")
    deep = _run_cli(settings, "status", JOB, "--json", "--deep", idle=idle)
    deep["unaccounted"] = _last_json(deep.pop("stdout")).get("unaccounted")
    wait = _run_cli(settings, "wait", JOB, "--timeout", str(WATCH_S), "--interval", "2", "--json", idle=idle)
    wait["mode"] = _last_json(wait.pop("stdout")).get("mode")
    watch = _run_cli(settings, "status", JOB, "--watch", "--interval", "2", stop_after_s=WATCH_S, idle=idle)
    # the periodic check wait and --watch run (every 300 s at most 1 % of Redis): its cost, in constant memory
    check = _run_cli(settings, "wait", JOB, "--timeout", "1", "--check-every", "0", "--interval", "2", "--json",
                     idle=idle)  # fmt: skip
    check["unaccounted"] = (_last_json(check.pop("stdout")).get("checked") or {}).get("unaccounted")
    watch["lines"] = len([line for line in watch.pop("stdout").splitlines() if line.strip()])
    median = sorted(status, key=lambda s: s["wall_s"])[len(status) // 2]
    return {
        "idle_redis_cpu_ms_per_s": round(idle * 1e3, 3),
        "read": reads,
        "check": check,
        "status": {
            **median,
            "redis_cpu_ms_median": float(np.median([s["redis_cpu_ms"] for s in status])),
            "walls_s": [s["wall_s"] for s in status],
        },
        "status_deep": deep,
        # the share from commandstats (the commands' own time): a small rate drowns in the server's idle CPU
        "wait": {**wait, "redis_core_share": round(wait["redis_command_usec"] / 1e6 / wait["wall_s"], 5)},
        "watch": {**watch, "redis_core_share": round(watch["redis_command_usec"] / 1e6 / watch["wall_s"], 5)},
    }


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total / 2**20


def measure_submit(settings: Settings, n: int, workdir: Path, processes: int) -> dict[str, Any]:
    """A real `producer submit` of an ``n``-row JSONL (short chats, the test tokenizer)."""
    from testing.corpus import synthetic_text
    from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir

    path = workdir / f"chats-{n}.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "You are a careful assistant."},
                        {"role": "user", "content": synthetic_text(24, i)}]  # fmt: skip
            f.write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    args = ["submit", str(path), "--job", f"sub{n}", "--tokenizer", str(tok), "--processes", str(processes),
            "--no-progress", "--json"]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", *args], env=cli_env(settings),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    peak, own_peak, samples = 0.0, 0.0, []
    while proc.poll() is None:
        rss, own = _tree_rss_mb(proc.pid), _rss_mb(proc.pid)
        peak, own_peak = max(peak, rss), max(own_peak, own)
        samples.append((round(time.monotonic() - started, 1), round(rss, 1), round(own, 1)))
        time.sleep(0.5)
    err = proc.stderr.read() if proc.stderr else ""
    client = redis.Redis.from_url(settings.redis_url)
    queued = client.llen(settings.queue)
    client.close()
    third = len(samples) // 3
    return {
        "rows": n,
        "rc": proc.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "peak_tree_rss_mb": round(peak, 1),
        # flat = the RSS of the last third of the run is no higher than in the middle third
        "rss_mid_third_mb": max((r for _t, r, _o in samples[third : 2 * third]), default=0.0),
        "rss_last_third_mb": max((r for _t, r, _o in samples[2 * third :]), default=0.0),
        # the producer process alone (the render pool's children share its pages: the tree counts them twice)
        "producer_peak_rss_mb": round(own_peak, 1),
        "producer_rss_mid_third_mb": max((o for _t, _r, o in samples[third : 2 * third]), default=0.0),
        "producer_rss_last_third_mb": max((o for _t, _r, o in samples[2 * third :]), default=0.0),
        "rss_samples": samples[:: max(1, len(samples) // 40)],
        "processes": processes,
        "queue_after": queued,
        "stderr_tail": err[-300:],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": {}, "code": code_version()}
    earlier: dict[str, Any] = {}
    if args.merge and args.merge.exists():  # sizes measured by an earlier run (e.g. 88k with --submit)
        earlier = json.loads(args.merge.read_text())["sizes"]
        results["sizes"].update(earlier)
    for n in args.prompts:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            server = RedisProcess(Path(tmp)).start()
            try:
                settings = Settings(redis_url=server.url(0), output_uri=str(Path(tmp) / "out"), key_prefix="bs",
                                    queue="bsq")  # fmt: skip
                client = server.client()
                figures: dict[str, Any] = {"prompts": n}
                print(f"[{n:,}] building the state …", flush=True)
                figures["state"] = build_state(client, settings, n, args.prompt_tokens)
                generation = json.loads(client.hget(settings.keys.job(JOB), "generation"))
                print(f"[{n:,}] ledger progress …", flush=True)
                figures["progress"] = asyncio.run(_progress(settings, n, generation, args.prompt_tokens))
                print(f"[{n:,}] timing status / wait / watch …", flush=True)
                figures.update(measure_commands(settings))
                if args.submit:
                    print(f"[{n:,}] producer submit of {n:,} rows …", flush=True)
                    client.flushdb()
                    figures["submit"] = measure_submit(settings, n, Path(tmp), args.processes)
                client.close()
                # a figure this run did not measure (the submit) is kept from the earlier one
                results["sizes"][str(n)] = {**earlier.get(str(n), {}), **figures}
                print(json.dumps(figures, indent=1), flush=True)
                write_json(args.out, results)  # what is measured so far survives a later size's failure
            finally:
                server.stop(kill=True)
    with tempfile.TemporaryDirectory(prefix="bench-scale-hb-") as tmp:
        server = RedisProcess(Path(tmp)).start()
        try:
            hb_settings = Settings(redis_url=server.url(0), key_prefix="bs", queue="bsq")
            results["heartbeat"] = measure_heartbeat(server.client(), hb_settings)
        finally:
            server.stop(kill=True)
    results["ceiling"] = ceiling(results)
    return results


def measure_heartbeat(client: redis.Redis, settings: Settings, held: int = 128, beats: int = 200) -> dict[str, Any]:
    """What one host costs Redis whatever its prompt rate: its heartbeat (workers/lease.py's script, which also
    re-scores every delivery it holds), ``held`` deliveries, every ``lease_s / 4`` seconds."""
    from thinkfleet.broker.visibility import clock_key
    from workers.lease import _BEAT

    kk = KombuKeys(settings.key_prefix)
    tags = [f"bench-tag-{i}" for i in range(held)]
    client.zadd(kk.unacked_index, dict.fromkeys(tags, time.time()))
    beat = client.register_script(_BEAT)
    info = json.dumps({"host": "bench", "pid": 1})
    hb = json.dumps({"nonce": "n1", "host": "bench"})
    keys = [settings.keys.heartbeat("bench"), settings.keys.workers, kk.unacked_index, kk.unacked_holder]
    keys.append(clock_key(kk.unacked_index))  # the visibility clock (thinkfleet/broker/visibility.py)
    held_args = [part for tag in tags for part in (tag, "")]  # per delivery: its tag, no holder recorded
    beat(keys=keys, args=["n1", hb, 60_000, "bench", info, "", *held_args])

    def evalsha_usec() -> int:  # the script's own time (its commands are counted once more on their own lines)
        return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0))

    rounds = []  # the least of 5 rounds: a busy box stretches a command's time by whatever else runs
    for _ in range(5):
        usec0 = evalsha_usec()
        for _ in range(beats // 5):
            beat(keys=keys, args=["n1", hb, 60_000, "bench", info, "", *held_args])
        rounds.append((evalsha_usec() - usec0) / (beats // 5))
    per_beat_us = min(rounds)
    interval_s = max(0.2, settings.lease_s / 4)
    return {"held": held, "usec_per_beat": round(per_beat_us, 1), "interval_s": interval_s,
            "host_redis_us_per_s": round(per_beat_us / interval_s, 2)}  # fmt: skip


def ceiling(results: dict[str, Any]) -> dict[str, Any]:
    """Hosts one Redis core serves at the seed's 0.6 prompts/s each, from the fleet benchmark's measured Redis CPU
    per completed prompt (all of a real fleet's traffic) and this benchmark's status/wait cost."""
    fleet_path = RESULTS / "fleet.json"
    per_prompt_ms = None
    if fleet_path.exists():
        per_prompt_ms = (
            json.loads(fleet_path.read_text()).get("ceilings", {}).get("redis", {}).get("redis_cpu_ms_per_prompt")
        )
    sizes = results["sizes"]
    largest = sizes[max(sizes, key=int)] if sizes else {}
    ledger_ms = (largest.get("progress", {}).get("ledger_redis_cpu_us_per_prompt") or 0) / 1e3
    share_watchers = (largest.get("wait", {}).get("redis_core_share") or 0) + (
        largest.get("watch", {}).get("redis_core_share") or 0
    )
    out: dict[str, Any] = {"fleet_redis_cpu_ms_per_prompt": per_prompt_ms, "ledger_cpu_ms_per_prompt": ledger_ms,
                           "watchers_core_share": round(share_watchers, 4)}  # fmt: skip
    if per_prompt_ms:
        budget = 1.0 - share_watchers  # one core, less a wait and a --watch running all along
        # a host costs its prompts (0.6/s × per prompt) and its heartbeat, whatever its rate
        host_s = (results.get("heartbeat") or {}).get("host_redis_us_per_s", 0.0) / 1e6
        per_host_s = SEED_HOST_PROMPTS_S * per_prompt_ms / 1e3 + host_s
        out["heartbeat_us_per_host_s"] = round(host_s * 1e6, 2)
        out["prompts_per_s_one_core"] = round(budget / (per_prompt_ms / 1e3))
        out["hosts_one_core"] = round(budget / per_host_s)
        out["hosts_at_half_core"] = round(out["hosts_one_core"] / 2)
    return out


# -- the section ----------------------------------------------------------------------------------------------
def markdown(r: dict[str, Any]) -> str:
    rows = []
    sizes = r["sizes"]
    for n, f in sizes.items():
        st, rd, dp, ck, w, wa = f["status"], f["read"], f["status_deep"], f["check"], f["wait"], f["watch"]
        rows.append([f"{int(n):,}", f"{st['wall_s']:.2f} s / {st['peak_rss_mb']:.0f} MB",
                     f"{rd['read_ms_median']:.1f} ms / {rd['redis_cpu_ms_per_read']:.2f} ms "
                     f"({rd['redis_command_usec_per_read'] / 1e3:.2f} ms in {rd['redis_commands_per_read']:.0f} cmds)",
                     f"{dp['wall_s']:.1f} s / {dp['redis_cpu_ms']:,.0f} ms",
                     f"{ck['redis_cpu_ms']:,.0f} ms / {ck['peak_rss_mb']:.0f} MB",
                     f"{w['peak_rss_mb']:.0f} MB / {w['redis_core_share']:.2%}",
                     f"{wa['redis_core_share']:.2%} ({wa['lines']} lines)",
                     f"{f['state']['redis_bytes_per_prompt']:,} B",
                     f"{f['progress']['ledger_redis_cpu_us_per_prompt']:.0f} µs"])  # fmt: skip
    body = [code_stamp(r.get("code")), "",
            "`.venv/bin/python -m bench.bench_scale --prompts 88088 1000000 --submit` — synthetic jobs (256-token "
            "prompts) built through the producer's staging and commit and a real ledger (half stored, 1 % dead, 256 "
            "running, the rest queued), against a private redis-server. CLI figures are `python -m producer.cli` "
            "subprocesses, interpreter start and imports included (status CLI: the median of 5 calls; the imports "
            "of click, rich, redis and the settings, ≈ 0.3 s of CPU on a quiet box (a busy one doubles it), are "
            "most of it: submit's, retry's and "
            "storage's modules load only when those run, tests/test_scale_cli_imports.py); *read* is "
            "`StatusReader.read()` in process, the part that scales. Redis CPU = the server's "
            "(INFO cpu) over the call less its idle rate; *cmds* = INFO commandstats. *Check* = the periodic "
            "check `wait`/`--watch` run (places counted in Redis, counters checked), here forced once.", "",
            table(["prompts", "status CLI (wall / RSS)", "status read (wall / Redis CPU)",
                   "status --deep (wall / Redis CPU)", "check (Redis CPU / RSS)", "wait 2 s (RSS / Redis share)",
                   "--watch 2 s (Redis share)", "Redis / prompt", "ledger Redis CPU / prompt"], rows)]  # fmt: skip
    if len(sizes) >= 2:
        small, big = (sizes[k] for k in sorted(sizes, key=int)[:: len(sizes) - 1])

        def x(a: str, b: str) -> float:
            return big[a][b] / max(1e-6, small[a][b])

        body += ["", f"Growth ×{big['prompts'] / small['prompts']:.1f} prompts → status read Redis CPU "
                 f"×{x('read', 'redis_cpu_ms_per_read'):.2f} (in commands "
                 f"×{x('read', 'redis_command_usec_per_read'):.2f}), "
                 f"status CLI wall ×{x('status', 'wall_s'):.2f}, wait RSS ×{x('wait', 'peak_rss_mb'):.2f}; the "
                 f"full scan (--deep) Redis CPU ×{x('status_deep', 'redis_cpu_ms'):.1f}, the periodic check "
                 f"×{x('check', 'redis_cpu_ms'):.1f}."]  # fmt: skip
    subs = [(n, f["submit"]) for n, f in sizes.items() if "submit" in f]
    if subs:
        body += ["", "`producer submit` (`--submit`; `--merge` keeps a size's row from the run that timed it) "
                 "of a JSONL of short chats (the test tokenizer, `--processes 2`): RSS of the "
                 "producer process alone, and of its whole tree (the render children share its pages, so the tree "
                 "counts them more than once), in the middle and the last third of the run.", "",
                 table(["rows", "wall", "producer RSS peak (mid / last third)", "tree RSS peak (mid / last third)",
                        "rc"],
                       [[f"{int(n):,}", f"{s['wall_s']:.0f} s",
                         f"{s['producer_peak_rss_mb']:.0f} MB ({s['producer_rss_mid_third_mb']:.0f} / "
                         f"{s['producer_rss_last_third_mb']:.0f})",
                         f"{s['peak_tree_rss_mb']:.0f} MB ({s['rss_mid_third_mb']:.0f} / {s['rss_last_third_mb']:.0f})",
                         s["rc"]] for n, s in subs])]  # fmt: skip
    c = r.get("ceiling", {})
    if c.get("hosts_one_core"):
        body += ["", f"Redis ceiling: a real fleet costs Redis {c['fleet_redis_cpu_ms_per_prompt']:.3f} ms of CPU per "
                 "completed prompt (bench/results/fleet.json: kombu delivery and acks, claim/finalize, heartbeats; "
                 f"of it the ledger's claim + finalize measured here: {c['ledger_cpu_ms_per_prompt']:.3f} ms); "
                 f"a `wait` and a `status --watch` running all along take {c['watchers_core_share']:.2%} of the core. "
                 f"One Redis core then serves ≈ {c['prompts_per_s_one_core']:,} prompts/s; with each host's heartbeat "
                 f"({c.get('heartbeat_us_per_host_s', 0):.0f} µs of Redis per second: it re-scores the 128 deliveries "
                 f"it holds every lease/4), ≈ **{c['hosts_one_core']:,} hosts** at the seed's "
                 f"{SEED_HOST_PROMPTS_S} prompts/s each "
                 f"(≈ {c['hosts_at_half_core']:,} keeping Redis at half a core, the headroom a latency-sensitive "
                 "Redis wants). Redis is single-threaded: past that, shard jobs over several Redis."]  # fmt: skip
    return "\n".join(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[88_088])
    ap.add_argument("--prompt-tokens", type=int, default=256, help="Token ids per synthetic prompt.")
    ap.add_argument("--submit", action="store_true", help="Also time a real `producer submit` of as many rows.")
    ap.add_argument("--processes", type=int, default=2, help="Render processes of the timed submit.")
    ap.add_argument("--from-json", type=Path, help="Rewrite the section from a saved result; run nothing.")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    ap.add_argument("--merge", type=Path, help="Keep the sizes of this earlier result, add the ones measured now.")
    ap.add_argument(
        "--turns-conversations",
        type=int,
        default=0,
        help="Time status at the end of a --turns all job of this many 4-turn conversations (bench/scale_turns.py; "
        "its own section and bench/results/scale_turns.json) and nothing else.",
    )
    ap.add_argument("--answer-bytes", type=int, default=10_000, help="Bytes of each answer record (--turns-...).")
    args = ap.parse_args()
    if args.turns_conversations or (args.from_json and args.from_json.name == "scale_turns.json"):
        from bench import scale_turns

        scale_turns.main(args, _run_cli)
        return
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
    else:
        figures = measure(args)
        write_json(args.out, figures)
    update_section("bench_scale", "Scale: status, wait and submit at 88k and 1M prompts", markdown(figures))


if __name__ == "__main__":
    main()
