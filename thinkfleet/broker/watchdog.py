"""The consumer's watchdog: a worker whose broker consumer is stuck past a bound exits for its supervisor.

The consumer thread runs kombu's event loop (the hub): it pops messages, records and settles deliveries, runs the
restore sweep and reads the Redis clock, each a synchronous Redis command. Every connection kombu opens has a socket
timeout, a health check and keepalive (thinkfleet/broker/celery_app.py ``broker_timeouts``) and a Sentinel head is
asked again on every reconnect, so no command should hold the loop longer than a few timeouts. Should one do it
anyway — a bug, a library's own wait, a lock that is never released — the worker would hold its prompts with fresh
heartbeats (the state clients run on another thread) and consume nothing: the silent stall of issue 43.

So the hub stamps every turn of its loop (it turns at least once a second when idle), and a thread checks the stamp:
past :func:`stuck_bound_s` without a turn while the loop runs (the process itself running: a paused or starved
process restarts the count), the worker logs why and exits with
:data:`CONSUMER_STUCK_EXIT`. Compose (``restart: unless-stopped``), Kubernetes and the Slurm scripts restart it; its
deliveries come back after the lease as a dead worker's do, and the claims make a second run cost nothing. Time
outside the loop — Celery reconnecting to a broker that is down, a warm shutdown draining — is not watched: a
Redis restart must not cost every worker a restart too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: The exit status of a worker whose consumer was stuck (EX_TEMPFAIL: try again; its supervisor restarts it).
CONSUMER_STUCK_EXIT = 75
#: The shortest bound, whatever the lease: longer than a starved consumer thread on a loaded host (14-17 s seen on a
#: 2-core CI box) and than a command's worst case (its timeout and the client's three retries, each a Sentinel query).
MIN_STUCK_S = 120.0
#: How often the watchdog looks at the stamp.
CHECK_EVERY_S = 1.0
#: A look this much later than due means the process itself did not run (paused or starved): no verdict on the loop.
PAUSE_S = 5.0
#: The transport option (thinkfleet/broker/transit.py ``enable_transit``) that arms it, in seconds.
OPTION = "consumer_stuck_s"


def stuck_bound_s(lease_s: float, configured_s: float | None = None) -> float:
    """How long the consumer's loop may go without a turn: ``consumer_stuck_s`` when set, else two leases (by then
    every delivery it holds has been restored to others), at least :data:`MIN_STUCK_S`."""
    if configured_s is not None:
        return float(configured_s)
    return max(MIN_STUCK_S, 2 * lease_s)


class ConsumerWatchdog:
    """Stamps the hub's turns; exits the process once the loop, while armed, has not turned for ``bound_s``."""

    def __init__(self) -> None:
        self.bound_s: float | None = None
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, bound_s: float) -> None:
        """The loop runs (again): watch it from now."""
        with self._lock:
            self.bound_s = bound_s
            self._last = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="thinkfleet-consumer-watchdog", daemon=True)
                self._thread.start()

    def disarm(self, **_: Any) -> None:
        """The loop stopped on purpose (the connection closed, the worker shuts down): nothing to watch."""
        with self._lock:
            self.bound_s = None

    def tick(self) -> None:
        self._last = time.monotonic()

    def stuck_for(self) -> float | None:
        """Seconds the armed loop has gone without a turn past its bound, else None."""
        with self._lock:
            if self.bound_s is None:
                return None
            waited = time.monotonic() - self._last
            return waited if waited > self.bound_s else None

    def _watch(self) -> None:
        checked = time.monotonic()
        # For the life of the process, a turn every CHECK_EVERY_S; its escalation is the exit (docs/reliability.md).
        while True:
            time.sleep(CHECK_EVERY_S)
            now = time.monotonic()
            if now - checked > CHECK_EVERY_S + PAUSE_S:
                # This thread overslept: the whole process was paused (SIGSTOP, a frozen VM) or starved, not the loop
                # alone. The loop gets a whole bound from now (a worker paused past its lease resumes as one).
                self.tick()
            checked = now
            waited = self.stuck_for()
            if waited is not None:
                self._exit(waited)

    def _exit(self, waited: float) -> None:
        text = (
            f"thinkfleet worker: the broker consumer has been stuck for {waited:.0f} s (bound {self.bound_s:.0f} s: "
            f"THINKFLEET_CONSUMER_STUCK_S); exiting with status {CONSUMER_STUCK_EXIT} for the supervisor to restart "
            "the worker (its prompts return to the queue after the lease)"
        )
        log.critical(text)
        for handler in logging.getLogger().handlers:
            handler.flush()
        print(text, file=sys.stderr, flush=True)
        os._exit(CONSUMER_STUCK_EXIT)


#: This process's watchdog (one consumer per worker process).
WATCHDOG = ConsumerWatchdog()
_shutdown_hooked = False


class WatchedTransport:
    """A kombu Redis transport whose event loop the watchdog watches, when the transport options arm it
    (``consumer_stuck_s``: worker processes only)."""

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)  # type: ignore[misc]
        bound = connection.client.transport_options.get(OPTION)
        if not bound:
            return
        _hook_shutdown()
        loop.on_tick.add(WATCHDOG.tick)
        WATCHDOG.arm(float(bound))

    def close_connection(self, connection: Any) -> None:
        WATCHDOG.disarm()  # Celery closes it to reconnect or to stop: the loop does not run meanwhile
        super().close_connection(connection)  # type: ignore[misc]


def _hook_shutdown() -> None:
    global _shutdown_hooked
    if _shutdown_hooked:
        return
    from celery import signals

    signals.worker_shutting_down.connect(WATCHDOG.disarm, weak=False)
    _shutdown_hooked = True
