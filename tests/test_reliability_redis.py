"""Reliability when Redis fails: a restart with AOF mid-job, and losing Redis entirely.

Each test runs its own redis-server (so it may kill it) with real workers and the simulator.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from producer import render
from producer.job import JobRecord
from storage.reader import stored_prompt_ids
from testing.datasets import chat_rows, write_jsonl
from testing.fleet import (
    RecoveryWatch,
    WorkerProcess,
    in_flight,
    job_progress,
    job_progress_or_down,
    stuck_report,
    wait_until,
)
from testing.harness import (
    cli_env,
    fast_env,
    isolated_settings,
    make_prompts,
    producer_cli,
    sim_stats,
    simulator,
    submit_ids,
)
from testing.record import check_job, record_result
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir


def test_redis_restarted_with_aof_mid_job_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    # Given a Redis with appendfsync always, two workers and a job in progress.
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    started = time.monotonic()
    try:
        with simulator(tmp_path, "--time-scale", "60") as sim:
            env = fast_env(settings, sim, max_inflight=6)
            workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
            try:
                for w in workers:
                    w.wait_ready(client, keys)
                job = submit_ids(settings, "aof", make_prompts(60))
                # `producer wait` polls the job all along (it must ride through the restart, not die).
                wait_err = tmp_path / "wait.err"
                waiter = subprocess.Popen(
                    [sys.executable, "-m", "producer.cli", "wait", "aof", "--interval", "0.2", "--timeout", "600"],
                    env=cli_env(settings),
                    stdout=subprocess.DEVNULL,
                    stderr=wait_err.open("w"),
                )
                wait_until(lambda: job_progress(client, keys, "aof")["done"] >= 15, 120, what="15 rows")
                wait_until(lambda: in_flight(client, keys, "aof"), 30, what="work in flight")
                # When Redis is killed mid-job and restarted from its AOF on the same port (once wait has seen
                # it gone: a condition, not a sleep, so a busy machine cannot skip the outage).
                watch = RecoveryWatch(server.url(), keys, "aof", "redis-restart").start()
                server.stop(kill=True)
                wait_until(lambda: "does not answer" in wait_err.read_text(), 60, what="wait to see Redis gone")
                server.start()
                wait_until(lambda: job_progress_or_down(client, keys, "aof")["done"] == 60, 180, what="60 rows")
                # Then wait says finished (exit 0) after saying the outage in one line, with no traceback.
                assert waiter.wait(timeout=120) == 0, wait_err.read_text()
                said = wait_err.read_text()
                assert "Traceback" not in said and "Redis answers again" in said, said
            finally:
                for w in workers:
                    w.terminate()
        # Then every prompt is stored once, byte-exact.
        outcome = check_job(settings, "aof", job.prompts, job.sampling_params)
        record_result(
            "Redis SIGKILL + restart from AOF",
            outcome,
            "Redis down 1 s mid-job (appendfsync always)",
            [watch.stop()],
            time.monotonic() - started,
            workers=2,
        )
        outcome.assert_clean()
    finally:
        server.stop()


def test_redis_rolled_back_to_an_older_snapshot_mid_job_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    # Given a Redis without AOF (as a head node with appendfsync everysec loses its last writes on a crash, or a
    # promoted replica that lagged), two workers and a job in progress.
    server = RedisServer(tmp_path / "redis").start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    started = time.monotonic()
    try:
        with simulator(tmp_path, "--time-scale", "60") as sim:
            env = fast_env(settings, sim, max_inflight=6)
            workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
            try:
                for w in workers:
                    w.wait_ready(client, keys)
                job = submit_ids(settings, "rollback", make_prompts(60))
                wait_until(lambda: job_progress(client, keys, "rollback")["done"] >= 15, 120, what="15 rows")
                # When a snapshot is taken, the job goes on past it (rows committed and finalized, messages acked),
                # and Redis then dies and comes back from that older snapshot.
                before = client.lastsave()
                client.bgsave()
                wait_until(lambda: client.lastsave() != before, 60, what="the snapshot written")
                at_snapshot = job_progress(client, keys, "rollback")["done"]
                wait_until(
                    lambda: job_progress(client, keys, "rollback")["done"] >= min(60, at_snapshot + 15), 120,
                    what="15 more rows after the snapshot",
                )  # fmt: skip
                watch = RecoveryWatch(server.url(), keys, "rollback", "redis-rollback").start()
                server.stop(kill=True)
                server.start()
                rolled_back = job_progress_or_down(client, keys, "rollback")["done"]
                report = lambda: stuck_report(client, settings, "rollback", workers)  # noqa: E731
                wait_until(
                    lambda: job_progress_or_down(client, keys, "rollback")["done"] == 60,
                    180,
                    what="60 rows",
                    explain=report,
                )
                wait_until(lambda: not client.hlen(keys.claims("rollback")), 60, what="no claim left", explain=report)
            finally:
                for w in workers:
                    w.terminate()
        # Then every prompt is stored once in the committed view, byte-exact, and that view is what Redis counted.
        outcome = check_job(settings, "rollback", job.prompts, job.sampling_params)
        record_result(
            "Redis SIGKILL + restart from an older snapshot (lost writes)",
            outcome,
            f"BGSAVE at {at_snapshot} rows, killed later, back at {rolled_back} rows done",
            [watch.stop()],
            time.monotonic() - started,
            workers=2,
            notes="finalizes lost with the rollback: re-finalized from their parts, or re-run (the older row fenced)",
        )
        outcome.assert_clean()
        assert rolled_back < 60, "the snapshot should be older than the job's end"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


def _rid_prompts(stats: dict[str, object], job: str) -> dict[str, int]:
    """prompt id → /generate calls, from the simulator's rids (``job/prompt/r0/a1-…``)."""
    counts: dict[str, int] = {}
    for rid in stats.get("rids") or []:
        m = re.match(rf"{re.escape(job)}/(.+)/r\d+/a\d+-", str(rid))
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


@pytest.mark.parametrize("claim_in_snapshot", [True, False], ids=["claim-kept", "claim-lost-too"])
def test_a_rollback_that_loses_a_finished_prompts_message_too_is_finalized_again_from_its_row(
    tmp_path: Path, claim_in_snapshot: bool
) -> None:
    # Given one prompt claimed by a worker, a snapshot taken while it generates, and the prompt then stored,
    # finalized and acked. (claim-lost-too: the snapshot was taken before the claim — the message already
    # delivered, so in kombu's unacked hash — and the ack of the stored row landed on the restored Redis, deleting
    # that entry: no claim names the worker and no message is left. Seen in the nemesis, seed 20.)
    from thinkfleet.broker.keys import KombuKeys

    server = RedisServer(tmp_path / "redis").start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    started = time.monotonic()
    try:
        with simulator(tmp_path, "--time-scale", "1", "--per-request-tok-s", "40") as sim:
            env = fast_env(settings, sim, max_inflight=2, request_timeout_floor_s=120)
            worker = WorkerProcess("w1", env, tmp_path).start()
            try:
                worker.wait_ready(client, keys)
                job = submit_ids(settings, "lost-msg", make_prompts(1), max_new_tokens=512)  # ~13 s to generate
                wait_until(lambda: client.hexists(keys.claims("lost-msg"), "p00000"), 60, what="the claim")
                before = client.lastsave()
                client.bgsave()  # the fork is the snapshot: it holds the claim and the delivered message
                assert not client.sismember(keys.done("lost-msg"), "p00000"), "finished before the snapshot"
                wait_until(lambda: client.lastsave() != before, 60, what="the snapshot written")
                wait_until(lambda: job_progress(client, keys, "lost-msg")["done"] == 1, 120, what="the row stored")
                # When Redis comes back from that snapshot, and without the prompt's message: whatever loses it
                # (here: the unacked record is gone), no delivery will ever run it again.
                server.stop(kill=True)
                server.start()
                kombu = KombuKeys(settings.key_prefix)
                client.delete(kombu.unacked, kombu.unacked_index, settings.queue)
                assert json.loads(client.hget(keys.claims("lost-msg"), "p00000"))["worker"] == "w1"
                if not claim_in_snapshot:
                    client.hdel(keys.claims("lost-msg"), "p00000")
                # Then the worker that stored the row finalizes it again from that row (its claim still names it;
                # or, with no claim left, its finalize mark in Redis is older than its latest finalize).
                wait_until(
                    lambda: job_progress_or_down(client, keys, "lost-msg")["done"] == 1, 60, what="finalized again"
                )
                wait_until(lambda: not client.hlen(keys.claims("lost-msg")), 30, what="no claim left")
            finally:
                worker.terminate()
        assert "finalized lost-msg/p00000 again" in worker.tail(400)
        outcome = check_job(settings, "lost-msg", job.prompts, job.sampling_params)
        record_result(
            "Redis rollback that also loses a finished prompt's message"
            + ("" if claim_in_snapshot else " and its claim"),
            outcome,
            "BGSAVE mid-generation, the row stored and acked, Redis back from the snapshot without the message"
            + ("" if claim_in_snapshot else " and the claim"),
            [],
            time.monotonic() - started,
            workers=1,
            notes="the worker that stored the row finalizes it again from the part (it remembers its recent rows)",
        )
        outcome.assert_clean()
    finally:
        server.stop()


def test_redis_lost_entirely_resubmit_runs_exactly_the_missing_prompts(tmp_path: Path, tok_dir: Path) -> None:
    # Given a job submitted with the real producer, half done, on a Redis without persistence.
    server = RedisServer(tmp_path / "redis").start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    rows = chat_rows(40, words=20)
    data = write_jsonl(tmp_path / "alpha.jsonl", rows)
    submit_args = ("submit", str(data), "--job", "lost", "--tokenizer", str(tok_dir), "--processes", "1")
    submit_args += ("--max-new-tokens", "2048", "--seed", "7", "--json", "--no-progress")
    started = time.monotonic()
    try:
        with simulator(tmp_path, "--time-scale", "40") as sim:
            env = fast_env(settings, sim, max_inflight=4)
            worker = WorkerProcess("w1", env, tmp_path).start()
            try:
                worker.wait_ready(client, keys)
                first = producer_cli(settings, *submit_args)
                assert first.returncode == 0, first.stderr
                assert json.loads(first.stdout)["enqueued"] == 40
                sampling = JobRecord.load(client, keys, "lost").sampling_params
                wait_until(lambda: job_progress(client, keys, "lost")["done"] >= 12, 120, what="12 rows")
                # When Redis is lost entirely (killed, and an empty one takes its place).
                watch = RecoveryWatch(server.url(), keys, "lost", "redis-lost").start()
                server.stop(kill=True)
                server.start()
                worker.wait_ready(client, keys)  # its heartbeat reappears in the empty Redis
                # …and the requests that were in flight have settled (stored, or handed back to nowhere),
                settled = [-1]

                def quiet() -> bool:
                    completed = int(sim_stats(sim)["completed"])
                    still = completed == settled[0]
                    settled[0] = completed
                    return still

                wait_until(quiet, 60, interval_s=1.5, what="in-flight requests settled")
                missing = {f"alpha/r{i}" for i in range(40)} - stored_prompt_ids(settings.output_uri, "lost")
                calls_before = _rid_prompts(sim_stats(sim, rids=True), "lost")
                # …and the same `producer submit` runs again.
                again = producer_cli(settings, *submit_args)
                assert again.returncode == 0, again.stderr
                report = json.loads(again.stdout)
                wait_until(lambda: job_progress(client, keys, "lost")["done"] == 40, 180, what="40 rows")
                calls_after = _rid_prompts(sim_stats(sim, rids=True), "lost")
            finally:
                worker.terminate()
        # Then it enqueued exactly the prompts storage lacked, and exactly those ran again.
        assert report["enqueued"] == len(missing) > 0
        rerun = {pid for pid, n in calls_after.items() if n > calls_before.get(pid, 0)}
        assert rerun == missing
        tok = render.load_tokenizer(str(tok_dir))
        prompts = {
            f"alpha/r{i}": render.render_ids(tok, row["messages"][:2], None, {"thinking": True})
            for i, row in enumerate(rows)
        }
        outcome = check_job(settings, "lost", prompts, sampling)
        record_result(
            "Redis lost entirely, then the same `producer submit`",
            outcome,
            f"Redis SIGKILL, empty Redis started; re-submit enqueued {report['enqueued']} missing",
            [watch.stop()],
            time.monotonic() - started,
            notes="recovery includes the operator's re-submit",
        )
        outcome.assert_clean()
    finally:
        server.stop()
