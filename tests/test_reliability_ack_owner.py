"""A late outcome of a fenced run must not settle the delivery that took its message over.

kombu restores an expired delivery with its original delivery tag, and the next worker records it as unacked
under that same tag. A worker paused past its lease (worker A) that comes back and acks its now-fenced run used
to delete that unacked entry — the one worker B holds: when B then died (or handed the message back), nothing
restored it and the prompt was never stored. The ack, reject and hand-back of a delivery act on the entry only
while it is still that delivery's (thinkfleet/broker/transit.py).

Real ``worker`` processes, a real Redis, the simulator over HTTP; the race is held open with failpoints
(B stops itself right after claiming one of A's prompts) and every wait is on a condition.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, submit_ids
from testing.record import check_job, record_result

PROMPTS = 8
#: Short, so that A's lease lapses soon after it is paused (its messages are restored and B takes them over).
LEASE = {"lease_s": 4, "reaper_interval_s": 0.5}


def _log(worker: WorkerProcess) -> str:
    return worker.log_path.read_text(errors="replace")


def _fenced_in(worker: WorkerProcess, job: str, prompt: str) -> bool:
    """The worker's run of ``prompt`` ended ``fenced`` (Celery logs the outcome right before the late ack)."""
    return re.search(rf"generate\[{re.escape(job)}/{prompt}/r0\] succeeded in \S+: 'fenced'", _log(worker)) is not None


def test_a_fenced_runs_late_ack_leaves_the_takers_delivery_and_the_prompt_is_still_stored(
    sim: SimulatorProcess, redis_url: str, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    job_name = "ack-owner"
    last = f"p{PROMPTS - 1:05d}"
    started = time.monotonic()
    # Rows wait up to 10 s for their group commit; each worker counts its failpoints in its own directory.
    env = fast_env(settings, sim.url, max_inflight=PROMPTS, flush_interval_s=10, **LEASE)
    for worker in ("a", "b"):
        (tmp_path / worker).mkdir()
    # Given worker A that takes every prompt and stops itself (a pause: SIGSTOP) once it has claimed the last one.
    a_points = {"THINKFLEET_FAILPOINTS": f"after_claim=stop@{last}", "THINKFLEET_FAILPOINT_DIR": str(tmp_path / "a")}
    a = WorkerProcess("a", {**env, **a_points}, tmp_path).start()
    # And worker B, which takes A's messages over once A's lease lapsed (kombu restores them with the same delivery
    # tags) and stops itself at its first group commit: its claims marked, its part not written.
    b_points = {"THINKFLEET_FAILPOINTS": "after_mark=stop", "THINKFLEET_FAILPOINT_DIR": str(tmp_path / "b")}
    b = WorkerProcess("b", {**env, **b_points}, tmp_path)
    try:
        a.wait_ready(client, keys)
        job = submit_ids(settings, job_name, make_prompts(PROMPTS, seed=5), max_new_tokens=64)
        wait_until(a.stopped, 120, 0.05, what="A paused holding its prompts")
        held = in_flight(client, keys, job_name, "a")
        b.start()
        wait_until(b.stopped, 180, 0.05, what="B stopped at its group commit")
        taken = sorted(held & in_flight(client, keys, job_name, "b"))
        assert taken, "B must hold some of A's prompts for the scenario to mean anything"
        # When A resumes: its runs of the prompts B holds are fenced and acked (late).
        a.cont()
        for prompt in taken:
            wait_until(lambda p=prompt: _fenced_in(a, job_name, p), 120, 0.1, what=f"A's run of {prompt} fenced")
        # And B dies before its part is written (SIGKILL: its rows are gone with it).
        b.kill()
        # Then B's deliveries were not A's to settle: they return after B's lease, and A stores every prompt.
        wait_until(lambda: job_progress(client, keys, job_name)["done"] == PROMPTS, 120, 0.2, what="every row stored")
    finally:
        a.cont()
        a.kill()
        b.cont()
        b.kill()
    outcome = check_job(settings, job_name, job.prompts, job.sampling_params)
    record_result(
        "a paused worker's late ack of its fenced runs, then the taker killed",
        outcome,
        f"2 workers, lease {LEASE['lease_s']} s; A paused holding {len(held)}, B took {len(taken)} and was SIGKILLed",
        [],
        time.monotonic() - started,
        workers=2,
        notes="the fenced runs' acks left B's unacked entries alone; the visibility sweep restored them",
    )
    outcome.assert_clean()
    # Each late ack logged why it settled nothing: B's entry left to B, or (when A came back slower than B's lease)
    # already restored by the sweep.
    log = _log(a)
    assert log.count("left to its holder b/") + log.count("its unacked entry is gone") >= len(taken)
