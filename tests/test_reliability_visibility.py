"""Reliability when a prompt outlives the visibility timeout: kombu redelivers it while its first run
continues, and the claims still make exactly one row (and one generation) of it.

Kombu's restore sweep in *any* worker uses *that* worker's visibility timeout ("the shortest value
wins": kombu reads ``visibility_timeout`` from the sweeping channel's own transport options). Here a
worker with a 1 s lease sweeps next to one with a 60 s lease, whose renewals (every 15 s) therefore come far
too late: its slow generations are redelivered mid-run.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import redis

from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, sim_stats, simulator, submit_ids
from testing.record import check_job, record_result


def _generations_per_prompt(sim: str, job: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for rid in sim_stats(sim, rids=True).get("rids") or {}:  # type: ignore[union-attr]
        m = re.match(rf"{re.escape(job)}/(.+)/r\d+/a\d+-", str(rid))
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def test_prompt_redelivered_past_the_visibility_timeout_is_stored_once(redis_url: str, tmp_path: Path) -> None:
    # Given a worker with a long lease, busy with generations of ~13 s (longer than a second worker takes to start
    # on a loaded box: with ~3 s ones the job was done before the sweeper joined, and nothing was redelivered),
    # and a second worker with a 1 s lease whose kombu sweep restores every message not renewed within 1 s.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "1") as sim:
        slow = {"request_timeout_floor_s": 120}  # the generations outlast FAST_WORKER's 5 s request deadline
        holder = WorkerProcess("holder", fast_env(settings, sim, max_inflight=6, lease_s=60, **slow), tmp_path).start()
        sweeper = WorkerProcess("sweeper", fast_env(settings, sim, max_inflight=2, lease_s=1, **slow), tmp_path)
        try:
            holder.wait_ready(client, keys)
            job = submit_ids(settings, "vis", make_prompts(12), max_new_tokens=512)
            wait_until(lambda: sim_stats(sim)["running"] >= 6, 30, what="the holder generating")
            # When the sweeper joins: the holder's messages are redelivered while their first runs continue.
            sweeper.start().wait_ready(client, keys)
            wait_until(lambda: job_progress(client, keys, "vis")["done"] == 12, 180, what="12 rows")
            generations = _generations_per_prompt(sim, "vis")
        finally:
            holder.terminate()
            sweeper.terminate()
    logs = holder.log_path.read_text() + sweeper.log_path.read_text()
    deliveries = len(re.findall(r"generate\[vis/p\d+/r0\] received", logs))
    waited = len(re.findall(r"'already-done'", logs))
    # Then each prompt was generated once and stored once, though delivered more often.
    outcome = check_job(settings, "vis", job.prompts, job.sampling_params)
    record_result(
        "message redelivered past the visibility timeout",
        outcome,
        f"{deliveries} deliveries of 12 messages; {waited} copies waited for the first run",
        [],
        time.monotonic() - started,
        workers=2,
        notes="a 1 s-lease worker's kombu sweep next to a 60 s-lease worker",
    )
    outcome.assert_clean()
    assert deliveries > 12 and waited > 0, "the scenario must really redeliver running prompts"
    assert generations == dict.fromkeys(job.prompts, 1), "a redelivered copy never generates again"
