"""A head that fails over (issue 34): the job state and the queue on a Sentinel-managed Redis (one primary, two
replicas, three Sentinels on loopback), its primary killed mid-job.

Every process opens Redis through one ``sentinel://`` URL (thinkfleet/redis_client.py): the workers' job-state pool
and their broker channel (the transit transport over kombu's Sentinel pool), the producer, ``producer wait``. When
the primary dies the Sentinels promote a replica within seconds; whatever the replica had not received yet is a
rollback the product already recovers from (finalize marks, re-finalize from stored parts). The job must end with
every prompt stored exactly once and byte-exact, and ``producer wait`` — started before the failover — must return
0 on its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from testing.fleet import WorkerProcess, in_flight, job_progress, job_progress_or_down, wait_until
from testing.harness import cli_env, fast_env, isolated_settings, make_prompts, simulator, submit_ids
from testing.record import check_job, record_result
from testing.sentinel import SentinelHead
from testing.services import RedisServer
from thinkfleet.redis_client import sync_client


def test_a_job_on_a_sentinel_head_survives_its_primary_killed_mid_job(tmp_path: Path) -> None:
    RedisServer(tmp_path / "probe")  # fails (CI) or skips the test when redis-server is missing
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
                job = submit_ids(settings, "failover", make_prompts(60))
                wait_err = tmp_path / "wait.err"
                waiter = subprocess.Popen(
                    [sys.executable, "-m", "producer.cli", "wait", "failover", "--interval", "0.2", "--timeout", "600"],
                    env=cli_env(settings),
                    stdout=subprocess.DEVNULL,
                    stderr=wait_err.open("w"),
                )
                wait_until(lambda: job_progress(client, keys, "failover")["done"] >= 15, 120, what="15 rows")
                wait_until(lambda: in_flight(client, keys, "failover"), 30, what="work in flight")
                # When the primary is SIGKILLed mid-job (no restart: the Sentinels promote a replica).
                old = head.primary_port()
                assert old is not None
                killed_at = time.monotonic()
                head.process_on(old).stop(kill=True)
                new = head.wait_for_new_primary(old)
                promoted_s = time.monotonic() - killed_at
                wait_until(lambda: job_progress_or_down(client, keys, "failover")["done"] == 60, 240, what="60 rows")
                recovered_s = time.monotonic() - killed_at
                # A loaded machine may fail over twice (a promoted replica that stalls past down-after is failed
                # over in turn: one more rollback, which the running workers recover too): once the head is
                # stable, no more failovers, and the job is finished on the Redis it ends on.
                head.stable_primary()
                head.freeze()
                wait_until(
                    lambda: job_progress_or_down(client, keys, "failover")["done"] == 60, 240, what="60 rows, settled"
                )
                # Then `producer wait` returns 0 by itself, with no traceback.
                assert waiter.wait(timeout=120) == 0, wait_err.read_text()
                assert "Traceback" not in wait_err.read_text(), wait_err.read_text()
            finally:
                for w in workers:
                    w.terminate()
        # Then every prompt is stored once, byte-exact (verify and status read the new primary through the URL).
        outcome = check_job(settings, "failover", job.prompts, job.sampling_params)
        record_result(
            "Sentinel head: primary SIGKILLed mid-job, a replica promoted",
            outcome,
            f"primary killed; promoted port {new} in {promoted_s:.1f} s (down-after 1 s)",
            [recovered_s],
            time.monotonic() - started,
            workers=2,
        )
        outcome.assert_clean()
        # And each worker reconnected on the transit transport (kombu's failover switch would have put it on the
        # stock one: a message popped there is only in the worker's memory).
        for name in ("w1", "w2"):
            connected = re.findall(r"Connected to (\S+)", (tmp_path / f"worker-{name}.log").read_text())
            assert len(connected) >= 2, connected
            assert all(c.startswith("thinkfleet.broker.transit_sentinel:SentinelTransport") for c in connected), (
                connected
            )
    finally:
        head.stop()


def test_a_primary_frozen_past_the_failover_takes_no_write_that_is_then_lost(tmp_path: Path) -> None:
    # A primary SIGSTOPped (a frozen VM, a long GC of the host) past down-after is failed over; when it wakes it is
    # still a primary for a moment, with the workers' connections still open on it. With min-replicas-to-write 1
    # (the head's setting) it refuses those writes — NOREPLICAS, handed back — instead of taking writes the
    # Sentinels then discard when they make it a replica.
    RedisServer(tmp_path / "probe")
    options = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")
    head = SentinelHead(tmp_path / "head", options=options).start()
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
                job = submit_ids(settings, "frozen", make_prompts(60))
                wait_until(lambda: job_progress(client, keys, "frozen")["done"] >= 15, 120, what="15 rows")
                old = head.primary_port()
                assert old is not None
                frozen = head.process_on(old)
                frozen_at = time.monotonic()
                os.kill(frozen.pid, signal.SIGSTOP)
                try:
                    new = head.wait_for_new_primary(old)
                finally:
                    os.kill(frozen.pid, signal.SIGCONT)
                promoted_s = time.monotonic() - frozen_at
                wait_until(lambda: job_progress_or_down(client, keys, "frozen")["done"] == 60, 240, what="60 rows")
                recovered_s = time.monotonic() - frozen_at
                head.stable_primary()
                head.freeze()
                wait_until(
                    lambda: job_progress_or_down(client, keys, "frozen")["done"] == 60, 240, what="60 rows, settled"
                )
            finally:
                for w in workers:
                    w.terminate()
        outcome = check_job(settings, "frozen", job.prompts, job.sampling_params)
        record_result(
            "Sentinel head: primary frozen (SIGSTOP) past the failover, then woken",
            outcome,
            f"primary stopped until port {new} was promoted ({promoted_s:.1f} s), then SIGCONT "
            "(min-replicas-to-write 1, max lag 2 s)",
            [recovered_s],
            time.monotonic() - started,
            workers=2,
        )
        outcome.assert_clean()
    finally:
        head.stop()


def test_a_job_rides_through_losing_sentinels_and_a_failover_between_them(tmp_path: Path) -> None:
    # The Sentinels fail too: the first one the URL names dies (clients ask the next), then the primary (the two
    # left still make a quorum and fail over), then a second Sentinel (no failover is possible any more, but the one
    # left still names the primary to every client that reconnects). The job finishes exactly once.
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
                job = submit_ids(settings, "sentinels", make_prompts(90))
                progress = lambda: job_progress_or_down(client, keys, "sentinels")["done"]  # noqa: E731
                wait_until(lambda: progress() >= 10, 120, what="10 rows")
                head.sentinels[0].stop()
                wait_until(lambda: progress() >= 25, 120, what="25 rows with one Sentinel gone")
                old = head.primary_port()
                assert old is not None
                head.process_on(old).stop(kill=True)
                head.sentinels = head.sentinels[1:]  # the head's own view: the two left
                new = head.wait_for_new_primary(old)
                head.stable_primary()
                wait_until(lambda: progress() >= 50, 120, what="50 rows after the failover")
                head.sentinels[0].stop()
                wait_until(lambda: progress() == 90, 240, what="90 rows with one Sentinel left")
            finally:
                for w in workers:
                    w.terminate()
        outcome = check_job(settings, "sentinels", job.prompts, job.sampling_params)
        record_result(
            "Sentinel head: two of three Sentinels killed, the primary between them",
            outcome,
            f"Sentinel 1 killed, then the primary (port {new} promoted by the two left), then Sentinel 2",
            [],
            time.monotonic() - started,
            workers=2,
        )
        outcome.assert_clean()
    finally:
        head.stop()
