"""Faults cost little: the bystanders of repeated worker deaths run as suspects *together* (group testing,
thinkfleet/state/ledger.py) instead of one at a time, none is dead-lettered; and a worker paused past its lease
that comes back is charged no death. A real poison prompt is still found: tests/test_reliability_outcomes.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, dead_letters, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, post_json, submit_ids
from testing.record import check_job, record_result
from thinkfleet.keys import Keys

#: A worker's log line for each last-chance run (workers/pipeline.py): the group it joined and its cap.
SUSPECT_RUN = re.compile(r"last-chance run of (\S+)/(\S+) in a suspect group of (\d+) \(cap (\w+);")


def _group_runs(client: redis.Redis, keys: Keys, job: str, worker: str) -> set[str]:
    """The prompts ``worker`` runs as last-chance runs right now (their claims name its suspect group)."""
    claims = client.hgetall(keys.claims(job))
    return {
        pid.decode()
        for pid, raw in claims.items()
        if (claim := json.loads(raw)).get("worker") == worker and claim.get("group")
    }


def _charged(client: redis.Redis, keys: Keys, job: str) -> dict[str, int]:
    """Prompt id → deaths charged to it (``k`` of its delivery record), for the prompts that have one."""
    return {pid.decode(): int(json.loads(raw).get("k", 0)) for pid, raw in client.hgetall(keys.deliveries(job)).items()}


def _done(client: redis.Redis, keys: Keys, job: str) -> set[str]:
    return {pid.decode() for pid in client.smembers(keys.done(job))}


def test_bystanders_of_repeated_kills_run_together_as_suspects_and_all_are_stored(
    redis_url: str, tmp_path: Path
) -> None:
    # Given one worker (12 in flight) on a job of 40 prompts whose runs take about a second and a half.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    job_name = "bystanders"
    sim = SimulatorProcess("--time-scale", "4")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    worker = WorkerProcess("fc1", fast_env(settings, sim.url, max_inflight=12), tmp_path)
    started = time.monotonic()
    kills: list[set[str]] = []
    try:
        worker.start().wait_ready(client, keys)
        job = submit_ids(settings, job_name, make_prompts(40), max_new_tokens=256)
        # When it is killed holding many prompts, restarted, and killed again holding several of the same ones:
        # those were in flight at two deaths they did not cause — one crash short of max_deliveries (3).
        for _ in range(2):
            before = kills[-1] if kills else set()
            wait_until(
                lambda b=before: len(held := in_flight(client, keys, job_name, "fc1")) >= 8
                and (not b or len(held & b) >= 3),
                120, 0.02, what="the worker holding many prompts (several of them killed once already)",
            )  # fmt: skip
            worker.kill()
            kills.append(in_flight(client, keys, job_name, "fc1"))  # the dead life's claims: its bystanders
            worker.start().wait_ready(client, keys)
        suspects = kills[0] & kills[1]
        # Then they run as suspects in one group at once, and a third death while they run splits the group.
        wait_until(lambda: len(_group_runs(client, keys, job_name, "fc1")) >= 2, 120, 0.02, what="two suspects at once")
        worker.kill()
        group = _group_runs(client, keys, job_name, "fc1")
        worker.start().wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, job_name)["done"] == 40, 240, what="all 40 stored")
    finally:
        worker.terminate()
        sim.kill()
    runs = [m.groups() for m in SUSPECT_RUN.finditer(worker.log_path.read_text(errors="replace"))]
    # No bystander is dead-lettered; every prompt is stored exactly once.
    assert dead_letters(client, keys, job_name) == {}
    outcome = check_job(settings, job_name, job.prompts, job.sampling_params)
    # Suspects overlapped: a run joined a group that already held another (never one at a time).
    assert len(suspects) >= 3 and len(group) >= 2
    assert {pid for _, pid, _, _ in runs} >= suspects | group
    assert max(int(size) for _, _, size, _ in runs) >= 2, runs
    # The group that died was split: its members' later runs carry a cap below its size (half of it; a run that
    # ended just before the kill may still have counted).
    split = [(pid, cap) for _, pid, _, cap in runs if pid in group and cap != "none"]
    assert split and all(int(cap) < len(group) for _, cap in split), (split, group)
    record_result(
        "bystanders of 3 worker kills run as suspects together",
        outcome,
        f"3 SIGKILLs of a worker holding 8-12 prompts; {len(suspects)} prompts in flight at two kills, a group of "
        f"{len(group)} at the third",
        [],
        time.monotonic() - started,
        notes=f"largest suspect group {max(int(s) for _, _, s, _ in runs)}; no bystander dead-lettered",
    )
    outcome.assert_clean()


def test_a_worker_paused_past_its_lease_is_charged_no_death(redis_url: str, tmp_path: Path) -> None:
    # Given worker A (fast server) holding the prompts of a 12-prompt job, and worker B whose server is slow
    # (a run there takes ~25 s, so B still holds what it took over while A comes back).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    job_name = "paused"
    fast, slow = SimulatorProcess("--time-scale", "8"), SimulatorProcess("--time-scale", "0.25")
    fast.log_path, slow.log_path = str(tmp_path / "fast.log"), str(tmp_path / "slow.log")
    fast.start()
    slow.start()
    a = WorkerProcess("pa", fast_env(settings, fast.url), tmp_path)
    b = WorkerProcess("pb", fast_env(settings, slow.url, request_timeout_floor_s=300), tmp_path)
    started = time.monotonic()
    try:
        a.start().wait_ready(client, keys)
        job = submit_ids(settings, job_name, make_prompts(12), max_new_tokens=256)
        wait_until(lambda: len(in_flight(client, keys, job_name, "pa")) >= 6, 60, 0.02, what="A holding 6")
        # When A is paused past its lease (SIGSTOP) and B takes its prompts over.
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        held = in_flight(client, keys, job_name, "pa")
        b.start().wait_ready(client, keys)
        wait_until(
            lambda: held <= in_flight(client, keys, job_name, "pb") | _done(client, keys, job_name),
            90, what="B took A's claims over",
        )  # fmt: skip
        # (A prompt A had committed before the pause is finalized by B from A's part: done, nothing to run.)
        watched = held & in_flight(client, keys, job_name, "pb")
        charged = _charged(client, keys, job_name)
        assert watched and all(charged.get(pid) == 1 for pid in watched), f"a lapse looks like a death: {charged}"
        # (B's server answers nothing until A has come back: B holds the prompts however long that takes on a loaded
        # box — a run of ~25 s once ended before A was seen taking the deaths back)
        post_json(f"{slow.url}/control/stall", {"seconds": 600})
        os.kill(a.proc.pid, signal.SIGCONT)
        # Then A comes back and takes those deaths back while B still runs the prompts: none stays charged.
        wait_until(
            lambda: not any(_charged(client, keys, job_name).get(pid) for pid in watched)
            and watched <= in_flight(client, keys, job_name, "pb"),
            180, 0.05, what=f"no death charged to {sorted(watched)} while B holds them",
        )  # fmt: skip
        post_json(f"{slow.url}/control/stall", {"seconds": 0})
        wait_until(lambda: job_progress(client, keys, job_name)["done"] == 12, 180, what="all 12 stored")
        assert a.alive(), "A lived through its pause"
    finally:
        a.cont()
        a.terminate()
        b.terminate()
        fast.kill()
        slow.kill()
    log = a.log_path.read_text(errors="replace")
    assert "fenced:" in log and "took back" in log, "A's late runs were fenced, and it took their deaths back"
    assert dead_letters(client, keys, job_name) == {}
    outcome = check_job(settings, job_name, job.prompts, job.sampling_params)
    record_result(
        "worker paused past its lease is charged no death",
        outcome,
        f"SIGSTOP of a worker holding {len(held)} prompts until another took {len(watched)} over, then SIGCONT",
        [],
        time.monotonic() - started,
        workers=2,
        notes="the takeover's death charges were taken back when the paused worker came back (came_back.lua)",
    )
    outcome.assert_clean()
