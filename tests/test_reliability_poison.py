"""Poison prompts and budgets: permanent errors go to the dead letter with their reason (never retried
blindly), `producer retry` re-queues them once fixed, and truncated rows re-run with a larger budget
replace the old ones in the committed view.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, submit_ids
from testing.record import check_job, record_result


def _resolved(client: redis.Redis, keys, job: str) -> int:
    p = job_progress(client, keys, job)
    return p["done"] + p["dead"]


def test_poison_prompts_are_dead_lettered_with_reasons_and_retried_on_request(redis_url: str, tmp_path: Path) -> None:
    # Given a server with a 4,096-token context and a job with one over-long prompt and one invalid id.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(6)
    prompts["too-long"] = prompts["p00000"] * 40  # ~2,500 ids + 2,048 new > 4,096
    prompts["bad-id"] = [*prompts["p00001"][:-1], 200_000, prompts["p00001"][-1]]  # beyond the vocabulary
    sim = SimulatorProcess("--time-scale", "400", "--context-length", "4096")
    sim.log_path = str(tmp_path / "sim.log")
    started = time.monotonic()
    sim.start()
    worker = WorkerProcess("w1", fast_env(settings, sim.url), tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "poison", prompts)
        wait_until(lambda: _resolved(client, keys, "poison") == 8, 120, what="all resolved")
        # Then both poison prompts are dead letters with their reason, after a single attempt.
        dead = dead_letters(client, keys, "poison")
        assert set(dead) == {"too-long", "bad-id"}
        assert dead["too-long"]["error_class"] == "context_overflow" and "context length" in dead["too-long"]["message"]
        assert dead["bad-id"]["error_class"] == "invalid_request" and "vocab" in dead["bad-id"]["message"]
        # Both are refused before /generate (the worker checks the server's context and the job's vocabulary),
        # or on the server's own 400 — either way never retried blindly.
        assert {d["attempts"] for d in dead.values()} <= {0, 1}, "a permanent error is never retried blindly"
        # When the server comes back with a longer context and the operator retries the overflows.
        closed = worker.gate_closures()
        sim.kill()
        wait_until(lambda: worker.gate_closures() > closed, 30, what="the worker saw the server go")
        sim.args = ["--time-scale", "400"]
        sim.start()
        retry = producer_cli(
            settings, "retry", "poison", "--error-class", "context_overflow", "--json", in_process=True
        )
        assert retry.returncode == 0, retry.stderr
        assert json.loads(retry.stdout)["prompt_ids"] == ["too-long"]
        wait_until(lambda: job_progress(client, keys, "poison")["done"] == 7, 120, what="the retried prompt stored")
    finally:
        worker.terminate()
        sim.kill()
    # Then the retried prompt is stored byte-exact; the invalid one stays a reported dead letter.
    outcome = check_job(settings, "poison", job.prompts, job.sampling_params, expected_dead={"bad-id"})
    record_result(
        "poison prompts: context overflow + invalid id, then `producer retry`",
        outcome,
        "1 over-long prompt, 1 id ≥ vocab; server restarted with a longer context",
        [],
        time.monotonic() - started,
        notes="overflow re-queued by `producer retry --error-class context_overflow`; invalid id stays dead",
    )
    outcome.assert_clean()
    assert set(dead_letters(client, keys, "poison")) == {"bad-id"}


def test_truncated_rows_rerun_with_a_larger_budget_replace_the_old_ones(redis_url: str, tmp_path: Path) -> None:
    # Given a job whose budget of 64 new tokens truncates most outputs.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    sim = SimulatorProcess("--time-scale", "400")
    sim.log_path = str(tmp_path / "sim.log")
    started = time.monotonic()
    sim.start()
    worker = WorkerProcess("w1", fast_env(settings, sim.url), tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "budget", make_prompts(20), max_new_tokens=64)
        wait_until(lambda: job_progress(client, keys, "budget")["done"] == 20, 120, what="20 rows")
        # When the truncated rows are re-run with 2,048 new tokens.
        retry = producer_cli(
            settings, "retry", "budget", "--truncated", "--max-new-tokens", "2048", "--json", in_process=True
        )
        assert retry.returncode == 0, retry.stderr
        rerun = set(json.loads(retry.stdout)["prompt_ids"])
        assert len(rerun) >= 10, "most outputs were cut at 64 tokens"
        wait_until(lambda: job_progress(client, keys, "budget")["done"] == 20, 120, what="20 rows again")
        wait_until(lambda: not client.llen(settings.queue), 60, what="the re-runs consumed")
    finally:
        worker.terminate()
        sim.kill()
    # Then the committed view holds the new revision of each re-run prompt (the old rows stay stored,
    # superseded, and are not duplicates).
    overrides = {pid: {"max_new_tokens": 2048} for pid in rerun}
    outcome = check_job(settings, "budget", job.prompts, job.sampling_params, overrides=overrides)
    record_result(
        "truncated rows re-run with a larger max_new_tokens",
        outcome,
        f"{len(rerun)} of 20 rows stopped at 64 tokens; `producer retry --truncated --max-new-tokens 2048`",
        [],
        time.monotonic() - started,
    )
    outcome.assert_clean()
