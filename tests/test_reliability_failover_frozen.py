"""A silent head (issue 43): the Sentinel head's primary is SIGSTOPped — a frozen VM, a partition that drops packets —
so no connection to it is ever reset. The Sentinels promote a replica within seconds; the workers must notice the
silence by their own bounds (thinkfleet/broker/celery_app.py ``broker_timeouts``: socket timeouts, health checks and
keepalive on every kombu connection, a third of the lease at most; the same timeout on the state clients) and go on
on the promoted primary. Before those bounds, a worker's consumer thread waited for ever in a read from the frozen
primary: heartbeats fresh, the queue untouched on the new primary, ``producer wait`` 124.

The SIGKILL case (tests/test_reliability_failover.py) passes without any of that: a dead process resets every
connection. Each job here ends with ``wait`` 0, ``verify`` OK and every prompt stored once.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from testing.fleet import in_flight, wait_until
from testing.harness import make_prompts, submit_ids
from testing.record import check_job, record_result
from testing.sentinel import SentinelFleet, sentinel_fleet
from thinkfleet.redis_client import command_timeout_s

#: A lease long enough that a loaded CI box never lets it lapse by itself, short enough for cheap timeouts: the
#: commands' timeout is a third of it (5 s), the broker's health checks half of that.
LEASE_S = 15.0
PROMPTS = 80
#: How long after the promotion the job may take to finish: the Sentinels' down-after (1 s) plus a couple of
#: timeouts is what it costs on a quiet machine; this is a generous wait on a loaded one, never a timed assertion.
RESUME_WAIT_S = 240.0


def _freeze_primary_mid_job(fleet: SentinelFleet, job: str) -> tuple[int, int, float]:
    """SIGSTOP the primary while prompts are in flight; wait for the promotion. (frozen pid, promoted port, the
    monotonic time of the freeze)."""
    head, keys = fleet.head, fleet.settings.keys
    fleet.wait_done(job, 15, "15 rows before the freeze", 120)
    wait_until(lambda: in_flight(fleet.client, keys, job), 30, what="work in flight")
    old = head.primary_port()
    assert old is not None
    frozen = head.process_on(old)
    frozen_at = time.monotonic()
    os.kill(frozen.pid, signal.SIGSTOP)
    return frozen.pid, head.wait_for_new_primary(old), frozen_at


def _assert_reconnected_on_transit(tmp_path: Path) -> None:
    # Each worker reconnected on the transit transport (not kombu's stock one, where a pop lives only in memory).
    for name in ("w1", "w2"):
        connected = re.findall(r"Connected to (\S+)", (tmp_path / f"worker-{name}.log").read_text())
        assert connected, name
        assert all(c.startswith("thinkfleet.broker.transit_sentinel:SentinelTransport") for c in connected), connected


def test_a_job_finishes_when_its_sentinel_primary_freezes_for_good(tmp_path: Path) -> None:
    started = time.monotonic()
    timeout_s = command_timeout_s(LEASE_S)
    with sentinel_fleet(tmp_path, worker_options={"lease_s": LEASE_S}) as fleet:
        job = submit_ids(fleet.settings, "frozen", make_prompts(PROMPTS))
        waiter, wait_err = fleet.start_wait("frozen")
        # When the primary is SIGSTOPped mid-job and never woken (its sockets stay open, silent),
        _pid, new, frozen_at = _freeze_primary_mid_job(fleet, "frozen")
        promoted_s = time.monotonic() - frozen_at
        # Then the workers go on on the promoted primary and finish the job,
        fleet.wait_done("frozen", PROMPTS, f"{PROMPTS} rows on the promoted primary", RESUME_WAIT_S)
        finished_s = time.monotonic() - frozen_at
        fleet.settle("frozen", PROMPTS)
        # `producer wait` returns 0 by itself,
        assert waiter.wait(timeout=120) == 0, wait_err.read_text()
        fleet.stop_workers()
        # and every prompt is stored once, byte-exact.
        outcome = check_job(fleet.settings, "frozen", job.prompts, job.sampling_params)
    record_result(
        "Sentinel head: primary frozen (SIGSTOP) for the rest of the job",
        outcome,
        f"primary stopped for good; port {new} promoted in {promoted_s:.1f} s (down-after 1 s); lease {LEASE_S:.0f} s, "
        f"command timeout {timeout_s:.0f} s; job finished {finished_s - promoted_s:.1f} s after the promotion",
        [finished_s],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
    _assert_reconnected_on_transit(tmp_path)


@pytest.mark.slow  # ≈ 3 min; CI runs the frozen-for-good case above
def test_a_primary_frozen_for_three_leases_then_woken_stops_no_job(tmp_path: Path) -> None:
    started = time.monotonic()
    # min-replicas-to-write 1, as every deployed head (deploy/): the woken primary, still a primary in its own eyes
    # until the Sentinels reconfigure it, refuses writes (NOREPLICAS) instead of taking ones its resync then drops.
    options = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")
    with sentinel_fleet(tmp_path, head_options=options, worker_options={"lease_s": LEASE_S}) as fleet:
        first = submit_ids(fleet.settings, "thawed", make_prompts(PROMPTS))
        pid, new, frozen_at = _freeze_primary_mid_job(fleet, "thawed")
        promoted_s = time.monotonic() - frozen_at
        # The job goes on while the old primary stays frozen (three leases: every lease it held has lapsed),
        fleet.wait_done("thawed", PROMPTS, f"{PROMPTS} rows while the old primary is frozen", RESUME_WAIT_S)
        finished_s = time.monotonic() - frozen_at
        time.sleep(max(0.0, 3 * LEASE_S - (time.monotonic() - frozen_at)))  # the fault's length, not a wait
        # When it wakes (its old connections, its stale view of itself as the primary, until the Sentinels make it a
        # replica of the promoted one),
        os.kill(pid, signal.SIGCONT)
        woken_at = time.monotonic()
        fleet.head.stable_primary()
        # Then a job submitted after the wake runs too, and both end with each prompt once.
        second = submit_ids(fleet.settings, "after", make_prompts(PROMPTS // 2, seed=7))
        waiter, wait_err = fleet.start_wait("after")
        fleet.settle("after", PROMPTS // 2)
        after_wake_s = time.monotonic() - woken_at
        assert waiter.wait(timeout=120) == 0, wait_err.read_text()
        fleet.stop_workers()
        outcomes = [
            check_job(fleet.settings, name, job.prompts, job.sampling_params)
            for name, job in (("thawed", first), ("after", second))
        ]
    for outcome, what in zip(outcomes, ("during the freeze", "after the wake"), strict=True):
        record_result(
            f"Sentinel head: primary frozen (SIGSTOP) for three leases, then woken: the job {what}",
            outcome,
            f"primary stopped {3 * LEASE_S:.0f} s (lease {LEASE_S:.0f} s); port {new} promoted in {promoted_s:.1f} s; "
            f"first job done {finished_s - promoted_s:.1f} s after the promotion; a second job submitted after the "
            f"wake done in {after_wake_s:.1f} s",
            [finished_s if what == "during the freeze" else after_wake_s],
            time.monotonic() - started,
            workers=2,
            ci=False,
        )
    for outcome in outcomes:
        outcome.assert_clean()
    _assert_reconnected_on_transit(tmp_path)
