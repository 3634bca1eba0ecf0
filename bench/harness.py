"""Real processes for the benchmarks: a private Redis, simulators, workers, a fast enqueue, a sampler.

Everything runs as its own process so its CPU time can be read from ``/proc`` (no psutil): the
simulators (``sglang-sim``), the workers (``worker``, a real ``celery worker``), redis-server and the
in-process pool client (``python -m bench.pool``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from producer.enqueue import Stager
from sglang_sim.testing import SimulatorProcess
from testing.datasets import kimi_id_prompt
from testing.fleet import WorkerProcess, register_id_job, worker_env
from thinkfleet import kimi
from thinkfleet.broker.envelope import Envelope
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
_CLK_TCK = os.sysconf("SC_CLK_TCK")

#: The seed's server, per simulated host (sglang_sim.engine.EngineConfig defaults, stated explicitly).
DECODE_TOK_S = 860.0
PER_REQUEST_TOK_S = 40.0
#: The seed's generation budget (its length limit).
MAX_NEW_TOKENS = 10_240


# -- CPU and load ------------------------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads), from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def proc_runqueue_wait_s(pid: int) -> float:
    """Seconds the threads of a live process spent runnable but waiting for a CPU (/proc/PID/task/*/schedstat).

    Summed over the threads alive now; divided by wall time it is how many of them were, on average, starved.
    """
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return float("nan")
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def cpu_pressure_s() -> float:
    """Seconds (since boot) in which some runnable task on this machine waited for a CPU (/proc/pressure/cpu)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_cpu() -> tuple[float, float]:
    """(busy seconds, total seconds) summed over all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / _CLK_TCK, sum(values) / _CLK_TCK


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class CpuMeter:
    """CPU seconds of named processes and of the whole machine between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.t0 = self.t1 = 0.0
        self.cpu0: dict[str, float] = {}
        self.cpu1: dict[str, float] = {}
        self.machine0 = self.machine1 = (0.0, 0.0)

    def add(self, name: str, pid: int) -> None:
        self.pids[name] = pid
        if self.t0:
            self.cpu0[name] = proc_cpu_s(pid)

    def start(self) -> CpuMeter:
        self.t0 = time.monotonic()
        self.cpu0 = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        self.machine0 = machine_cpu()
        return self

    def stop(self, exited: dict[str, float] | None = None) -> CpuMeter:
        """``exited``: final CPU seconds of processes that already ended (read by their owner)."""
        self.t1 = time.monotonic()
        self.cpu1 = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        self.cpu1.update(exited or {})
        self.machine1 = machine_cpu()
        return self

    def seconds(self, name: str) -> float:
        return self.cpu1[name] - self.cpu0.get(name, 0.0)

    def summary(self) -> dict[str, Any]:
        wall = self.t1 - self.t0
        busy = self.machine1[0] - self.machine0[0]
        total = self.machine1[1] - self.machine0[1]
        per = {k: round(self.seconds(k), 3) for k in self.pids}
        return {
            "wall_s": round(wall, 2),
            "cpu_s": per,
            "utilisation_of_one_core": {k: round(v / wall, 3) for k, v in per.items()},
            "machine_cores": os.cpu_count(),
            "machine_busy_share": round(busy / total, 3) if total else None,
            "ours_share_of_machine": round(sum(per.values()) / (wall * (os.cpu_count() or 1)), 3),
        }


# -- Redis ---------------------------------------------------------------------------------------------------
def commandstats(client: redis.Redis) -> dict[str, dict[str, float]]:
    """INFO commandstats as {command: {calls, usec, ...}}."""
    raw = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): {f: float(v) for f, v in d.items()} for k, d in raw.items()}


def commandstats_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    out = {}
    for cmd, now in after.items():
        was = before.get(cmd, {})
        calls = now.get("calls", 0) - was.get("calls", 0)
        if calls:
            out[cmd] = {"calls": int(calls), "usec": int(now.get("usec", 0) - was.get("usec", 0))}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["calls"]))


# -- simulators and workers -----------------------------------------------------------------------------------
def sim_args(
    time_scale: float,
    max_running: int,
    decode_tok_s: float = DECODE_TOK_S,
    per_request_tok_s: float = PER_REQUEST_TOK_S,
) -> list[str]:
    """Flags of one simulated host. The overload pause is off: a busy simulator process delays its
    answers (which the client then sees) but never stops its GPU clock, as a real GPU would not."""
    return [
        "--time-scale",
        str(time_scale),
        "--decode-tok-s",
        str(decode_tok_s),
        "--per-request-tok-s",
        str(per_request_tok_s),
        "--max-running-requests",
        str(max_running),
        "--max-tick-lag-ms",
        "1e12",
        "--log-level",
        "WARNING",
    ]


def start_sims(n: int, args: list[str]) -> list[SimulatorProcess]:
    sims = [SimulatorProcess(*args) for _ in range(n)]
    for sim in sims:
        sim.start()
    return sims


def stop_sims(sims: list[SimulatorProcess]) -> None:
    """SIGTERM each simulator and remove its log file."""
    for sim in sims:
        sim.stop()
        Path(sim.log_path).unlink(missing_ok=True)


def sim_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/control/stats?rids=0", timeout=5) as resp:
        return json.loads(resp.read())


def bench_settings(redis_url: str, output_uri: str) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(redis_url=redis_url, output_uri=output_uri, key_prefix=f"b{tag}", queue=f"bq{tag}")


def start_workers(
    settings: Settings, sim_urls: list[str], bound: int, log_dir: Path, **extra: object
) -> list[WorkerProcess]:
    """One worker per simulator (a host), started together, returned once all are consuming."""
    workers = []
    for i, url in enumerate(sim_urls):
        env = worker_env(
            settings.redis_url,
            url,
            settings.output_uri,
            max_inflight=bound,
            key_prefix=settings.key_prefix,
            queue=settings.queue,
            **extra,
        )
        workers.append(WorkerProcess(f"host{i}", env, log_dir).start())
    client = redis.Redis.from_url(settings.redis_url)
    for w in workers:
        w.wait_ready(client, settings.keys, timeout_s=120)
    return workers


def worker_metrics_ports(client: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(json.loads(v)["metrics_port"]) for k, v in client.hgetall(keys.workers).items()}


def scrape(port: int) -> dict[str, float]:
    """A worker's Prometheus counters and gauges, summed over label sets."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


# -- prompts and the job --------------------------------------------------------------------------------------
def make_prompts(n: int, seed: int = 0, min_tokens: int = 128, max_tokens: int = 512) -> dict[str, list[int]]:
    """Kimi-shaped token-id prompts (system, user, assistant header, ``<think>``) of random bodies."""
    rng = np.random.default_rng(seed)
    prompts = {}
    for i in range(n):
        body = rng.integers(100, 150_000, size=int(rng.integers(min_tokens, max_tokens + 1))).tolist()
        prompts[f"p{i:06d}"] = kimi_id_prompt(body)
    return prompts


def sampling_params(max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "stop_token_ids": list(kimi.DEFAULT_STOP_TOKEN_IDS),
        "sampling_seed": 7,
    }


def register_job(
    client: redis.Redis,
    keys: Keys,
    job: str,
    prompts: dict[str, list[int]],
    params: dict[str, Any],
    dataset: str = "bench",
) -> None:
    """The job record and prompt hashes, as ``producer submit`` writes them (token ids, no tokenizer)."""
    register_id_job(client, keys, job, prompts, params, dataset, fingerprint="bench-ids")


def stage(
    settings: Settings,
    job: str,
    prompts: dict[str, list[int]],
    order: Iterable[str] | None = None,
    dataset: str = "bench",
) -> Stager:
    """Encode and stage every message (producer.enqueue); :func:`commit` then moves them onto the queue."""
    client = redis.Redis.from_url(settings.redis_url)
    envelope = Envelope(settings)
    stager = Stager(client, settings.keys, job, settings.queue)
    index = {pid: i for i, pid in enumerate(prompts)}
    tasks = [
        PromptTask(
            job=job,
            dataset=dataset,
            prompt_id=pid,
            row_index=index[pid],
            content_hash=content_hash(prompts[pid]),
            ids_blob=pack_ids(prompts[pid]),
        )
        for pid in (order if order is not None else prompts)
    ]
    stager.push(envelope.encode_many(tasks))
    stager.flush()
    return stager


def commit(stager: Stager) -> float:
    """All staged messages onto the queue at once (one Lua call); returns that instant."""
    t = time.time()
    stager.commit()
    return t


# -- sampling over time ---------------------------------------------------------------------------------------
@dataclass
class Sampler:
    """Calls ``probe()`` every ``interval_s`` in a thread; keeps (time.time(), result) pairs."""

    probe: Callable[[], dict[str, Any]]
    interval_s: float = 0.25
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                self.samples.append({"t": t, **self.probe()})
            except Exception as exc:  # a probe failing once must not end the benchmark
                self.samples.append({"t": t, "error": repr(exc)})
            self._stop.wait(max(0.0, self.interval_s - (time.time() - t)))

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        return self.samples


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{what or 'condition'} not reached within {timeout_s:.0f}s")


# -- the pool client as a subprocess --------------------------------------------------------------------------
def save_prompts(path: Path, prompts: dict[str, list[int]], order: Iterable[str] | None = None) -> None:
    ids = list(order if order is not None else prompts)
    lengths = np.array([len(prompts[p]) for p in ids], dtype=np.int64)
    flat = np.concatenate([np.asarray(prompts[p], dtype=np.uint32) for p in ids])
    np.savez(path, prompt_ids=np.array(ids), lengths=lengths, flat=flat)


class PoolProcess:
    """``python -m bench.pool``: the plain asyncio client, in its own process (its CPU is read apart)."""

    def __init__(
        self,
        urls: list[str],
        bound: int,
        prompts_path: Path,
        out_path: Path,
        mode: str = "pool",
        params: dict[str, Any] | None = None,
        start_at: float = 0.0,
    ) -> None:
        self.out_path = out_path
        self.args = [
            sys.executable,
            "-m",
            "bench.pool",
            "--urls",
            ",".join(urls),
            "--bound",
            str(bound),
            "--prompts",
            str(prompts_path),
            "--out",
            str(out_path),
            "--mode",
            mode,
            "--sampling",
            json.dumps(params or sampling_params()),
            "--start-at",
            str(start_at),
        ]
        self.log_path = out_path.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PoolProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def result(self, timeout_s: float = 900) -> dict[str, Any]:
        assert self.proc is not None
        if self.proc.wait(timeout_s) != 0:
            raise RuntimeError(f"pool client failed:\n{self.log_path.read_text()[-3000:]}")
        return json.loads(self.out_path.read_text())


def tool_path(name: str) -> Path | None:
    """An optional console tool of the ``bench`` extra (py-spy): beside this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return beside
    found = shutil.which(name)
    return Path(found) if found else None


#: The generated reports and their data (benchmarks, RELIABILITY.md): writing them must not make the next
#: run's stamp dirty.
STAMP_EXCLUDES = ("bench/results", "BENCHMARKS.md", "RELIABILITY.md")


def code_version(root: Path = ROOT) -> dict[str, Any]:
    """The whole tree a benchmark ran on: ``git rev-parse HEAD``, whether anything differs from it, and if so
    a hash of the difference (tracked changes and untracked files, ``bench/`` included; only the benchmarks'
    own outputs, :data:`STAMP_EXCLUDES`, are left out), so two runs on the same uncommitted tree compare equal.
    """

    def git(*args: str, text: bool = True) -> Any:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=text, check=False)
        return out.stdout.rstrip("\n") if text else out.stdout

    spec = ["--", ".", *(f":(exclude){p}" for p in STAMP_EXCLUDES)]
    commit = git("rev-parse", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=all", *spec).splitlines()
    stamp: dict[str, Any] = {"commit": commit, "dirty": bool(changed)}
    if changed:
        digest = hashlib.sha256(git("diff", "HEAD", "--binary", *spec, text=False))
        for path in sorted(git("ls-files", "--others", "--exclude-standard", *spec).splitlines()):
            digest.update(path.encode() + b"\0")
            with contextlib.suppress(OSError):
                digest.update((root / path).read_bytes())
        stamp["diff_sha256"] = digest.hexdigest()[:16]
        stamp["changed_paths"] = sorted(line[3:] for line in changed)
    return stamp


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
