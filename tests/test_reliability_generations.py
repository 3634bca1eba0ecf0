"""``producer purge J --force`` and a new ``producer submit J`` with other settings while workers run: the old
generation's messages never run with the new record, and the new ones never with the old record a worker cached.

Given a worker that cached generation 1 of a job and holds some of its messages in flight (stopped by the
failpoint ``during_generate=stop``), when the job is purged and submitted again with another budget and the worker
resumes, then its in-flight runs of generation 1 are fenced (their finalize finds another generation), every
prompt is stored once with generation 2's sampling (byte-exact against the simulator), and a stray copy of a
generation-1 message is skipped without a generation — and counted (``stale_generation``, shown by ``producer
status``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from producer import lifecycle
from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import _publish, fast_env, isolated_settings, make_prompts, producer_cli, register_ids
from testing.record import check_job, record_result
from thinkfleet import failpoints

PROMPTS = 24


def _submit(settings, job: str, generation: str, **sampling: object):
    """The job as ``producer submit`` writes it, with its record's generation, and its messages published."""
    id_job, tasks = register_ids(settings, job, make_prompts(PROMPTS, seed=11), **sampling)
    client = redis.Redis.from_url(settings.redis_url)
    client.hset(settings.keys.job(job), "generation", json.dumps(generation))
    tasks = [dataclasses.replace(t, generation=generation) for t in tasks]
    _publish(settings, tasks)
    return id_job, tasks


def test_purge_and_resubmit_under_a_running_worker_never_mixes_generations(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # purge --force waits (PURGE_FORCE_WAIT_S, 60 s) for the job's running prompts, then purges anyway: here they run
    # on the stopped worker, which resumes only after the purge, so no wait can see them end; a short one takes
    # the same path (the in-process CLI below reads the constant).
    monkeypatch.setattr(lifecycle, "PURGE_FORCE_WAIT_S", 3.0)
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    job_name = "regen"
    started = time.monotonic()
    with SimulatorProcess("--time-scale", "1000") as sim:
        env = fast_env(settings, sim.url, max_inflight=4, lease_s=60)
        env.update({failpoints.ENV: "during_generate=stop", failpoints.DIR_ENV: str(fp_dir)})
        env[failpoints.TIMES_ENV] = "1"
        worker = WorkerProcess("w", env, tmp_path).start()
        try:
            worker.wait_ready(client, keys)
            # Given generation 1 (budget 64) running: the worker stops itself with requests in flight.
            _old_job, old_tasks = _submit(settings, job_name, "gen1", max_new_tokens=64)
            wait_until(lambda: worker.stopped(), 120, 0.05, what="the worker stopped mid-generation")
            # When the job is purged and submitted anew with budget 32, then the worker resumes.
            purged = producer_cli(settings, "purge", job_name, "--force", in_process=True)
            assert purged.returncode == 0, purged.stdout + purged.stderr
            new_job, _ = _submit(settings, job_name, "gen2", max_new_tokens=32)
            assert worker.proc is not None
            os.kill(worker.proc.pid, signal.SIGCONT)
            wait_until(lambda: job_progress(client, keys, job_name)["done"] == PROMPTS, 180, 0.1, what="all stored")
            # And a stray copy of a generation-1 message arrives after that.
            _publish(settings, old_tasks[:1])
            wait_until(
                lambda: b"message of job generation gen1" in worker.log_path.read_bytes(), 60, 0.1, what="skipped"
            )
        finally:
            worker.cont()
            worker.terminate()
    # Then every prompt is stored once, byte-exact with generation 2's budget; verify passes.
    outcome = check_job(settings, job_name, new_job.prompts, new_job.sampling_params)
    record_result(
        "producer purge + re-submit with another budget while a worker holds the old generation in flight",
        outcome,
        "1 worker stopped mid-generation (during_generate=stop), purge --force, submit, SIGCONT",
        [],
        time.monotonic() - started,
        notes="the old generation's runs fenced, a stray old message skipped",
    )
    outcome.assert_clean()
    log = worker.log_path.read_text(errors="replace")
    assert "is held by generation now" in log, "the in-flight generation-1 runs should have been fenced"
    assert int(client.hget(keys.counters(job_name), "done")) == PROMPTS
    # And the skipped stray copy was counted where `producer status` shows it (never acked unseen).
    skipped = int(client.hget(keys.counters(job_name), "stale_generation") or 0)
    assert skipped >= 1, "a skipped message of the purged generation is counted"
    status = producer_cli(settings, "status", job_name, "--json", in_process=True)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["stale_generation"] == skipped
    text = producer_cli(settings, "status", job_name, in_process=True)
    assert "earlier generation of this job" in text.stdout, text.stdout
