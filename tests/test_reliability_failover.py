"""A head that fails over (issue 34): the job state and the queue on a Sentinel-managed Redis (one primary, two
replicas, three Sentinels on loopback: testing/sentinel.py), its primary killed, frozen, or its Sentinels lost.

Every process opens Redis through one ``sentinel://`` URL (thinkfleet/redis_client.py): the workers' job-state pool
and their broker channel (the transit transport over kombu's Sentinel pool), the producer, ``producer wait``. When
the primary dies the Sentinels promote a replica within seconds; whatever the replica had not received yet is a
rollback the product already recovers from (finalize marks, re-finalize from stored parts). Each job must end with
every prompt stored exactly once and byte-exact. The worst failover — acknowledged writes lost — is
test_reliability_failover_lossy.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from testing.fleet import in_flight, job_progress, wait_until
from testing.harness import make_prompts, submit_ids
from testing.record import check_job, record_result
from testing.sentinel import sentinel_fleet


def test_a_job_on_a_sentinel_head_survives_its_primary_killed_mid_job(tmp_path: Path) -> None:
    started = time.monotonic()
    with sentinel_fleet(tmp_path) as fleet:
        head, keys = fleet.head, fleet.settings.keys
        job = submit_ids(fleet.settings, "failover", make_prompts(60))
        waiter, wait_err = fleet.start_wait("failover")
        fleet.wait_done("failover", 15, "15 rows", 120)
        wait_until(lambda: in_flight(fleet.client, keys, "failover"), 30, what="work in flight")
        # When the primary is SIGKILLed mid-job (no restart: the Sentinels promote a replica).
        old = head.primary_port()
        assert old is not None
        killed_at = time.monotonic()
        head.process_on(old).stop(kill=True)
        new = head.wait_for_new_primary(old)
        promoted_s = time.monotonic() - killed_at
        fleet.settle("failover", 60)
        recovered_s = time.monotonic() - killed_at
        # Then `producer wait` returns 0 by itself, with no traceback.
        assert waiter.wait(timeout=120) == 0, wait_err.read_text()
        assert "Traceback" not in wait_err.read_text(), wait_err.read_text()
        fleet.stop_workers()
        # And every prompt is stored once, byte-exact (verify and status read the new primary through the URL).
        outcome = check_job(fleet.settings, "failover", job.prompts, job.sampling_params)
    record_result(
        "Sentinel head: primary SIGKILLed mid-job, a replica promoted",
        outcome,
        f"primary killed; promoted port {new} in {promoted_s:.1f} s (down-after 1 s)",
        [recovered_s],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
    # And each worker reconnected on the transit transport (kombu's failover switch would have put it on the stock
    # one: a message popped there is only in the worker's memory).
    for name in ("w1", "w2"):
        connected = re.findall(r"Connected to (\S+)", (tmp_path / f"worker-{name}.log").read_text())
        assert len(connected) >= 2, connected
        assert all(c.startswith("thinkfleet.broker.transit_sentinel:SentinelTransport") for c in connected), connected


def test_a_primary_frozen_past_the_failover_takes_no_write_that_is_then_lost(tmp_path: Path) -> None:
    # A primary SIGSTOPped (a frozen VM, a long GC of the host) past down-after is failed over; when it wakes it is
    # still a primary for a moment, with the workers' connections still open on it. With min-replicas-to-write 1
    # (the head's setting) it refuses those writes — NOREPLICAS, a connection error: retried, handed back — instead
    # of taking writes the Sentinels then discard when they make it a replica.
    started = time.monotonic()
    options = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")
    with sentinel_fleet(tmp_path, head_options=options) as fleet:
        head = fleet.head
        job = submit_ids(fleet.settings, "frozen", make_prompts(60))
        fleet.wait_done("frozen", 15, "15 rows", 120)
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
        fleet.settle("frozen", 60)
        recovered_s = time.monotonic() - frozen_at
        fleet.stop_workers()
        outcome = check_job(fleet.settings, "frozen", job.prompts, job.sampling_params)
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


@pytest.mark.slow  # CI runs the plain SIGKILL failover above; this one (≈ 85 s) by the documented -m slow command
def test_a_job_rides_through_losing_sentinels_and_a_failover_between_them(tmp_path: Path) -> None:
    # The Sentinels fail too: the first one the URL names dies (clients ask the next), then the primary (the two
    # left still make a quorum and fail over), then a second Sentinel (no failover is possible any more, but the one
    # left still names the primary to every client that reconnects). The job finishes exactly once.
    started = time.monotonic()
    with sentinel_fleet(tmp_path) as fleet:
        head = fleet.head
        job = submit_ids(fleet.settings, "sentinels", make_prompts(90))
        fleet.wait_done("sentinels", 10, "10 rows", 120)
        head.sentinels[0].stop()
        fleet.wait_done("sentinels", 25, "25 rows with one Sentinel gone", 120)
        old = head.primary_port()
        assert old is not None
        head.process_on(old).stop(kill=True)
        head.sentinels = head.sentinels[1:]  # the head's own view: the two left
        new = head.wait_for_new_primary(old)
        head.stable_primary()
        fleet.wait_done("sentinels", 50, "50 rows after the failover", 120)
        head.sentinels[0].stop()
        fleet.wait_done("sentinels", 90, "90 rows with one Sentinel left")
        assert job_progress(fleet.client, fleet.settings.keys, "sentinels")["done"] == 90
        fleet.stop_workers()
        outcome = check_job(fleet.settings, "sentinels", job.prompts, job.sampling_params)
    record_result(
        "Sentinel head: two of three Sentinels killed, the primary between them",
        outcome,
        f"Sentinel 1 killed, then the primary (port {new} promoted by the two left), then Sentinel 2",
        [],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
