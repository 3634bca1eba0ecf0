"""A head that fails over and loses acknowledged writes (issue 34): the Sentinel-managed head of
test_reliability_failover.py, its replicas cut off from the primary while the workers store and ack rows, then the
primary killed and a replica without those writes promoted — the worst failover, for single prompts and for a
``--turns all`` job whose every request draws its own answer.

Every process opens Redis through one ``sentinel://`` URL (thinkfleet/redis_client.py): the workers' job-state pool
and their broker channel (the transit transport over kombu's Sentinel pool), the producer, ``producer wait``. When
the primary dies the Sentinels promote a replica within seconds; whatever the replica had not received yet is a
rollback the product already recovers from (finalize marks, re-finalize from stored parts). The job must end with
every prompt stored exactly once and byte-exact, and ``producer wait`` — started before the failover — must return
0 on its own.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from testing.fleet import WorkerProcess, job_progress, job_progress_or_down, wait_until
from testing.harness import cli_env, fast_env, isolated_settings, make_prompts, simulator, submit_ids
from testing.record import Outcome, check_job, record_result
from testing.sentinel import SentinelHead
from testing.services import RedisServer
from thinkfleet.redis_client import sync_client


def test_a_failover_that_loses_acknowledged_writes_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    # The worst failover: the replicas stopped receiving while the workers went on storing and acking for a while,
    # then the primary died and a replica — lacking every write of that while — was promoted. Redis lost
    # finalizes, dead letters and acks the workers had already acted on: the rollback the finalize marks and the
    # stored parts recover.
    RedisServer(tmp_path / "probe")
    head = SentinelHead(tmp_path / "head").start()
    started = time.monotonic()
    try:
        settings = isolated_settings(head.url(), str(tmp_path / "out"))
        client = sync_client(head.url())
        keys = settings.keys
        with simulator(tmp_path, "--time-scale", "60") as sim:
            env = fast_env(settings, sim, max_inflight=6)
            workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
            try:
                for w in workers:
                    w.wait_ready(client, keys)
                job = submit_ids(settings, "lossy", make_prompts(80))
                wait_err = tmp_path / "wait.err"
                waiter = subprocess.Popen(
                    [sys.executable, "-m", "producer.cli", "wait", "lossy", "--interval", "0.2", "--timeout", "600"],
                    env=cli_env(settings),
                    stdout=subprocess.DEVNULL,
                    stderr=wait_err.open("w"),
                )
                wait_until(lambda: job_progress(client, keys, "lossy")["done"] >= 15, 120, what="15 rows")
                # When the replicas stop receiving the primary's writes and the workers store (and ack) at least
                # ten more rows…
                old = head.primary_port()
                assert old is not None
                replicas = head.cut_replication(old)
                cut_done = job_progress(client, keys, "lossy")["done"]
                try:
                    wait_until(
                        lambda: job_progress(client, keys, "lossy")["done"] >= min(cut_done + 10, 80),
                        120,
                        what="ten rows stored while the replicas receive nothing",
                    )
                    lost_done = job_progress(client, keys, "lossy")["done"] - cut_done
                    # …then the primary dies, and a replica without those writes is promoted.
                    killed_at = time.monotonic()
                    head.process_on(old).stop(kill=True)
                finally:
                    head.restore_replication(replicas)
                new = head.wait_for_new_primary(old)
                promoted_s = time.monotonic() - killed_at
                wait_until(lambda: job_progress_or_down(client, keys, "lossy")["done"] == 80, 240, what="80 rows")
                recovered_s = time.monotonic() - killed_at
                # A loaded machine may fail over twice (a promoted replica that stalls past down-after is failed
                # over in turn: one more rollback, which the running workers recover too): once the head is
                # stable, no more failovers, and the job is finished on the Redis it ends on.
                head.stable_primary()
                head.freeze()
                wait_until(
                    lambda: job_progress_or_down(client, keys, "lossy")["done"] == 80, 240, what="80 rows, settled"
                )
                assert waiter.wait(timeout=120) == 0, wait_err.read_text()
                assert "Traceback" not in wait_err.read_text(), wait_err.read_text()
            finally:
                for w in workers:
                    w.terminate()
        # Then every prompt is stored once, byte-exact.
        outcome = check_job(settings, "lossy", job.prompts, job.sampling_params)
        record_result(
            "Sentinel head: acknowledged writes lost in a failover",
            outcome,
            f"replicas cut off while {lost_done} rows were stored and acked, primary killed, a replica without "
            f"them promoted (port {new}, {promoted_s:.1f} s)",
            [recovered_s],
            time.monotonic() - started,
            workers=2,
        )
        outcome.assert_clean()
    finally:
        head.stop()


def test_a_turns_all_job_whose_failover_loses_acknowledged_writes_keeps_every_chain_whole(tmp_path: Path) -> None:
    # The lossy failover on a --turns all job whose every request draws its own answer (--sample-per-request): the
    # lost writes include finalizes that enqueued next turns. Each chain must still run turn by turn, turn i+1
    # rendered from the committed turn i, once — never from an answer that was generated again after the loss.
    import json

    from storage.reader import raw_duplicates, read_committed
    from testing.chains import chain_problems
    from testing.datasets import conversation_rows, write_jsonl
    from testing.harness import producer_cli
    from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
    from thinkfleet.state.job import JobRecord

    RedisServer(tmp_path / "probe")
    conversations, turns = 10, 3
    total = conversations * turns
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    data = write_jsonl(tmp_path / "chat.jsonl", conversation_rows(conversations, turns, 10, "Be careful."))
    head = SentinelHead(tmp_path / "head").start()
    started = time.monotonic()
    try:
        settings = isolated_settings(head.url(), str(tmp_path / "out"))
        client = sync_client(head.url())
        keys = settings.keys
        with simulator(tmp_path, "--time-scale", "60", "--sample-per-request", "--tool-call-share", "0") as sim:
            env = fast_env(settings, sim, max_inflight=6)
            workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
            try:
                for w in workers:
                    w.wait_ready(client, keys)
                submitted = producer_cli(
                    settings, "submit", str(data), "--job", "chains", "--tokenizer", str(tok_dir), "--processes",
                    "1", "--no-progress", "--max-new-tokens", "200", "--context-length", "131072", "--turns", "all",
                )  # fmt: skip
                assert submitted.returncode == 0, submitted.stderr
                wait_until(lambda: job_progress(client, keys, "chains")["done"] >= 8, 120, what="8 turns")
                old = head.primary_port()
                assert old is not None
                replicas = head.cut_replication(old)
                cut_done = job_progress(client, keys, "chains")["done"]
                try:
                    wait_until(
                        lambda: job_progress(client, keys, "chains")["done"] >= min(cut_done + 8, total),
                        120,
                        what="eight turns stored while the replicas receive nothing",
                    )
                    lost = job_progress(client, keys, "chains")["done"] - cut_done
                    head.process_on(old).stop(kill=True)
                finally:
                    head.restore_replication(replicas)
                head.wait_for_new_primary(old)
                done = lambda: job_progress_or_down(client, keys, "chains")["done"] == total  # noqa: E731
                wait_until(done, 240, what=f"{total} turns")
                head.stable_primary()
                head.freeze()
                wait_until(done, 240, what=f"{total} turns, settled")
            finally:
                for w in workers:
                    w.terminate()
        verify = producer_cli(settings, "verify", "chains", "--json")
        assert verify.returncode == 0, verify.stdout[-3000:]
        dups = raw_duplicates(settings.output_uri, "chains")
        duplicated = sorted(set(dups["prompt_id"].to_pylist())) if dups.num_rows else []
        rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "chains").to_pylist()}
        record = JobRecord.load(client, keys, "chains")
        assert record is not None
        problems = chain_problems(data, "chat", tok_dir, record, rows, exact_outputs=False)
        status = json.loads(producer_cli(settings, "status", "chains", "--json").stdout)
        record_result(
            "Sentinel head: a --turns all job's failover loses acknowledged writes",
            Outcome(total, len(rows), 0, [], duplicated, [], True, status.get("finished") is True, problems),
            f"replicas cut off while {lost} turns were stored and acked (next turns enqueued), primary killed; "
            "every request its own answer",
            [],
            time.monotonic() - started,
            workers=2,
        )
        assert not duplicated and not problems, (duplicated, problems)
        assert len(rows) == total and status.get("finished") is True, status
    finally:
        head.stop()
