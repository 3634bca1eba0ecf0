"""A worker whose broker consumer is stuck past its bound exits for its supervisor (issue 43, thinkfleet/broker/
watchdog.py), instead of holding its prompts with fresh heartbeats and consuming nothing.

The consumer is made stuck for real: its Redis is SIGSTOPped while the worker runs with a command timeout far longer
than the watchdog's bound (``redis_timeout_s`` 600 s, ``consumer_stuck_s`` 6 s), so kombu's event loop waits in a
read from a silent socket — what every kombu connection did before it had a timeout.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from testing.fleet import WorkerProcess, wait_until
from testing.harness import fast_env, isolated_settings, simulator
from testing.services import RedisServer
from thinkfleet.broker.watchdog import CONSUMER_STUCK_EXIT, MIN_STUCK_S, ConsumerWatchdog, stuck_bound_s


def test_the_stuck_bound_is_two_leases_and_never_short() -> None:
    assert stuck_bound_s(4) == MIN_STUCK_S
    assert stuck_bound_s(600) == 1200
    assert stuck_bound_s(60, configured_s=30) == 30


def test_only_an_armed_loop_that_stopped_turning_is_stuck() -> None:
    watchdog = ConsumerWatchdog()
    assert watchdog.stuck_for() is None  # never armed: a process that is not a consuming worker
    watchdog.bound_s, watchdog._last = 30.0, time.monotonic() - 31  # armed, last turn 31 s ago
    assert (watchdog.stuck_for() or 0) >= 31
    watchdog.tick()
    assert watchdog.stuck_for() is None
    watchdog._last = time.monotonic() - 31
    watchdog.disarm()  # Celery closed the connection to reconnect: the loop is not running
    assert watchdog.stuck_for() is None


def test_a_worker_whose_consumer_is_stuck_exits_for_its_supervisor(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        settings = isolated_settings(server.url(), str(tmp_path / "out"))
        with simulator(tmp_path, "--time-scale", "60") as sim:
            env = fast_env(settings, sim, lease_s=60, redis_timeout_s=600, consumer_stuck_s=6)
            worker = WorkerProcess("stuck", env, tmp_path).start()
            try:
                worker.wait_ready(server.client(), settings.keys)
                worker.wait_consuming()
                # When its Redis stops answering without closing a socket (and no timeout would notice for 10 min),
                os.kill(server.pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
                try:
                    # Then the worker exits by itself with the documented status, naming why.
                    wait_until(lambda: not worker.alive(), 180, what="the stuck worker to exit")
                finally:
                    os.kill(server.pid, signal.SIGCONT)
                assert worker.proc is not None
                assert worker.proc.returncode == CONSUMER_STUCK_EXIT, worker.tail()
                assert "the broker consumer has been stuck" in worker.tail()
                assert time.monotonic() - stopped_at >= 6  # not before its bound
            finally:
                if worker.alive():
                    worker.terminate()
    finally:
        server.stop()
