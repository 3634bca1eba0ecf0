"""The nemesis: a randomized schedule of the fleet's faults in one job — workers SIGKILLed and restarted, workers
paused (SIGSTOP) past their lease and resumed, Redis rolled back to an older snapshot, the server down, the output
location unwritable — and every prompt still stored exactly once, byte-exact, with ``producer verify`` passing.

The schedule is drawn from a seed (:func:`schedule`), so a failing run is re-run exactly:
``THINKFLEET_NEMESIS_SEED=N .venv/bin/pytest tests/test_reliability_nemesis.py -m slow``. CI runs one short fixed
seed (:data:`CI_SEED`, 5 faults); the soak (``-m slow``) runs 16 faults on a larger job.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, draw_schedule, exchange_paths, job_progress, job_settled, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, submit_ids
from testing.invariant_watch import InvariantWatch
from testing.record import check_job, record_result
from testing.services import RedisServer
from thinkfleet.settings import Settings

FAULTS = ("kill", "pause", "redis_rollback", "server_down", "storage_blocked")
CI_SEED = 20
LEASE_S = 4


@dataclass(frozen=True)
class Fault:
    at: float  # share of the job done when it strikes
    kind: str  # one of FAULTS
    target: int  # which worker (kill, pause)
    length_s: float  # how long it lasts (pause, server_down, storage_blocked)


def schedule(seed: int, faults: int) -> list[Fault]:
    """``faults`` faults at increasing shares of the job, each kind at least once when there is room."""
    rng = random.Random(seed)
    return [
        Fault(share, kind, rng.randrange(3), rng.uniform(1.0, 2.5) * LEASE_S if kind == "pause" else rng.uniform(1, 4))
        for share, kind in draw_schedule(rng, FAULTS, faults, 0.05, 0.85)
    ]


def _done(client: redis.Redis, settings: Settings, job: str) -> int:
    try:
        return job_progress(client, settings.keys, job)["done"]
    except redis.RedisError:
        return -1


def run_nemesis(tmp_path: Path, seed: int, prompts: int, faults: int) -> None:
    plan = schedule(seed, faults)
    server = RedisServer(tmp_path / "redis").start()  # no AOF: a rollback loses writes, as everysec or a replica do
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    sim = SimulatorProcess("--time-scale", "200")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    env = fast_env(settings, sim.url, max_inflight=6, storage_retry_max_s=1)
    workers = [WorkerProcess(f"n{i}", env, tmp_path) for i in range(3)]
    job_name = f"nemesis-{seed}"
    started = time.monotonic()
    struck: list[str] = []
    invariant = InvariantWatch(settings, job_name, interval_s=0.5)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(client, settings.keys)
        job = submit_ids(settings, job_name, make_prompts(prompts, seed=seed), max_new_tokens=256)
        invariant.start()
        for fault in plan:
            wait_until(lambda f=fault: _done(client, settings, job_name) >= f.at * prompts, 300, 0.1, what=str(fault))
            _strike(fault, workers, server, sim, settings, job_name, client)
            struck.append(f"{fault.kind}@{fault.at:.2f}")
        # No fault may end a worker by itself: only the schedule's kills do, and each is restarted at once.
        dead = [w for w in workers if not w.alive()]
        assert not dead, "a worker exited on its own:\n" + "\n".join(w.tail(60) for w in dead)
        wait_until(lambda: job_settled(client, settings, job_name, prompts), 600, 0.2, what="the job settled")
        dead = [w for w in workers if not w.alive()]
        assert not dead, "a worker exited on its own:\n" + "\n".join(w.tail(60) for w in dead)
    finally:
        invariant.stop()
        for w in workers:
            w.cont()
            w.terminate()
        sim.kill()
    try:
        outcome = check_job(settings, job_name, job.prompts, job.sampling_params)
        record_result(
            f"nemesis: {faults} random faults (seed {seed})",
            outcome,
            ", ".join(struck),
            [],
            time.monotonic() - started,
            workers=3,
            notes="kills, pauses past the lease, Redis rollbacks, server outages, unwritable output",
        )
        outcome.assert_clean()
        invariant.assert_held()
    finally:
        server.stop()


def _strike(
    fault: Fault,
    workers: list[WorkerProcess],
    server: RedisServer,
    sim: SimulatorProcess,
    settings: Settings,
    job: str,
    client: redis.Redis,
) -> None:
    worker = workers[fault.target]
    if fault.kind == "kill":
        worker.kill()
        worker.start()  # under the same name: its previous life's claims are let go
    elif fault.kind == "pause" and worker.alive() and worker.proc is not None:
        os.kill(worker.proc.pid, signal.SIGSTOP)
        time.sleep(fault.length_s)  # the fault itself: a GC pause, a frozen VM
        os.kill(worker.proc.pid, signal.SIGCONT)
    elif fault.kind == "redis_rollback":
        before = client.lastsave()
        client.bgsave()
        wait_until(lambda: client.lastsave() != before, 60, 0.1, what="snapshot")
        done_at_snapshot = _done(client, settings, job)
        total = len(client.hkeys(settings.keys.prompts(job)))
        # Writes after the snapshot, for the rollback to lose — unless the job finished before it was taken (the
        # earlier faults' own waits can take that long on a busy box): then the rollback loses nothing.
        wait_until(
            lambda: _done(client, settings, job) > done_at_snapshot or done_at_snapshot >= total, 120, 0.1,
            what="writes after it",
        )  # fmt: skip
        server.stop(kill=True)
        server.start()
    elif fault.kind == "server_down":
        sim.kill()
        time.sleep(fault.length_s)  # the outage itself
        sim.start()
    elif fault.kind == "storage_blocked":
        out = Path(settings.output_uri) / job
        aside = out.with_name(out.name + ".away")
        if out.is_dir():
            aside.write_text("blocked")  # root ignores chmod: a file where the job's directory was
            exchange_paths(aside, out)  # in one step (a part written between a move and a write made it again)
            time.sleep(fault.length_s)  # the block itself
            exchange_paths(aside, out)
            aside.unlink()


def test_schedule_is_reproducible_and_covers_every_fault() -> None:
    assert schedule(7, 8) == schedule(7, 8)
    assert {f.kind for f in schedule(CI_SEED, len(FAULTS))} == set(FAULTS)
    shares = [f.at for f in schedule(3, 16)]
    assert shares == sorted(shares) and all(0 < s < 1 for s in shares)


# Back in CI (2026-12-02): the lost prompts it found in about 1 run in 8 — a rollback that took a finalize, the
# claim (made after the snapshot) and the message (its ack landed on the restored Redis) — are finalized again by
# the worker that stored them (its finalize mark, Ledger.lost_finalizes); and a worker restarted while Redis
# restarted waits for it (redis_start_wait_s). On a 2-core box at load 10–20: 27 of 30 runs passed while those
# fixes landed (each failure led to one), and every run since the last one.
def test_nemesis_short_fixed_seed(tmp_path: Path) -> None:
    run_nemesis(tmp_path, CI_SEED, prompts=240, faults=len(FAULTS))


@pytest.mark.slow
def test_nemesis_soak(tmp_path: Path) -> None:
    seed = int(os.environ.get("THINKFLEET_NEMESIS_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"nemesis seed {seed} (THINKFLEET_NEMESIS_SEED={seed} re-runs this schedule)")
    run_nemesis(tmp_path, seed, prompts=1500, faults=16)
