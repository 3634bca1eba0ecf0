"""A stall is seen: what a worker publishes of its progress with its heartbeat, and the bound of a stuck commit stream.

A fleet that stops quietly (heartbeats fresh, prompts "running", only ``wait --timeout`` ending it) is the failure
this module makes visible. Every :data:`PUBLISH_EVERY_S` the :class:`StallWatch` writes into the heartbeat's info
(workers/lease.py: the ``{prefix}:workers`` hash ``producer status`` reads, producer/stalls.py) and into Prometheus:

- ``progress_at`` / ``progress_age_s``: the last progress — a commit that succeeded or a generation that completed;
- ``held``: the messages this worker holds, ``commit_waiting``: the rows its committer holds;
- ``gate``: the server gate's state and the storage gate's (``ok``, or ``failing: <error>``);
- ``stalled``: why the worker is stalled, or null. It is stalled when it holds work and makes none of it progress
  for ``stall_flush_intervals`` flush intervals (at least :data:`MIN_STALL_S`): rows wait in its committer with no
  commit (the reason names the error the commit fails with, the attempt that hangs, or the wait), or its server
  gate is closed while it holds prompts.

A commit stream that is **stuck** — rows waiting and no commit for ``commit_stuck_exit_s`` while the commit is not
simply waiting out an I/O outage behind the storage gate (an attempt hangs: a storage call that never returns, or it
keeps failing with an error that is not I/O) — cannot be recovered from inside the process (a thread blocked in a
write cannot be cancelled), so the worker exits with :data:`COMMIT_STUCK_EXIT` (75, EX_TEMPFAIL) for its supervisor
(compose, Slurm, k8s) to restart it. Its held messages come back after the lease; its uncommitted rows are generated
again. An I/O outage is not stuck: its rows wait in memory and the closed storage gate says so in ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.commit_faults import CommitProgress

log = logging.getLogger("thinkfleet.worker")

#: Seconds between two publications of the progress fields (the heartbeat writes them at its own pace).
PUBLISH_EVERY_S = 1.0
#: A stall is called after this long at least, whatever the flush interval (a 0.2 s test interval would flag a
#: first commit that loads its job's tokenizer on a loaded box).
MIN_STALL_S = 10.0
#: While a worker stays stalled its log says so again this often (its reason's seconds change every publication).
STALL_LOG_EVERY_S = 60.0
#: The exit code of a worker whose commit stream is stuck past ``commit_stuck_exit_s`` (EX_TEMPFAIL: try again).
COMMIT_STUCK_EXIT = 75


def exit_for_supervisor(code: int) -> None:
    """Flush the logs and end the process at once (a thread blocked in a storage call cannot be joined)."""
    logging.shutdown()
    os._exit(code)


def stall_reason(p: CommitProgress, held: int, gate: Any, progress_age_s: float, after_s: float) -> str | None:
    """Why a worker with this commit progress, ``held`` messages and server ``gate`` is stalled (None: it is not)."""
    if p.waiting and (p.oldest_s or 0.0) > after_s and p.since_commit_s > after_s:
        if p.failing:
            where = "at storage" if p.failing_io else "with an error that is not I/O"
            return f"commit failing {where} for {p.since_commit_s:.0f} s: {p.failing}"
        if p.attempt_s is not None and p.attempt_s > after_s:
            return f"commit attempt running for {p.attempt_s:.0f} s ({p.waiting} rows waiting)"
        return f"{p.waiting} rows waiting {p.oldest_s:.0f} s to commit"
    if held and gate is not None and not gate.healthy and progress_age_s > after_s:
        return f"server {gate.state} for {progress_age_s:.0f} s: {gate.detail}".rstrip(": ")
    return None


def stuck(p: CommitProgress, bound_s: float) -> bool:
    """The commit stream is stuck past ``bound_s``: a row has waited that long with no commit meanwhile, and it is
    not an I/O outage waited out behind the storage gate — one attempt has run (hung) that long, or the commit keeps
    failing with an error that is not I/O."""
    if bound_s <= 0 or not p.waiting or (p.oldest_s or 0.0) <= bound_s or p.since_commit_s <= bound_s:
        return False
    return (p.attempt_s or 0.0) > bound_s or (p.failing is not None and not p.failing_io)


@dataclass
class StallWatch:
    """Publishes the worker's progress (see the module docstring) and ends a stuck commit stream."""

    committer: Any  # workers.committer.GroupCommitter
    gate: Any  # workers.health.HealthGate
    held: Callable[[], int]
    info: dict[str, Any]  # the heartbeat's info (workers/lease.py), updated in place
    metrics: Any = None  # workers.metrics.WorkerMetrics
    flush_interval_s: float = 30.0
    stall_flush_intervals: int = 4
    stuck_exit_s: float = 900.0
    exit: Callable[[int], None] = exit_for_supervisor
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def after_s(self) -> float:
        return max(MIN_STALL_S, self.stall_flush_intervals * self.flush_interval_s)

    def snapshot(self) -> dict[str, Any]:
        """The heartbeat's progress fields now."""
        p: CommitProgress = self.committer.progress()
        now = time.monotonic()
        completed = getattr(self.gate, "last_completion", float("-inf"))
        age = min(p.since_commit_s, now - completed)
        held = self.held()
        storage = "ok" if not (p.failing and p.failing_io) else f"failing: {p.failing}"
        server = getattr(self.gate, "state", "unknown")
        return {
            "progress_at": round(time.time() - age, 3),
            "progress_age_s": round(age, 1),
            "held": held,
            "commit_waiting": p.waiting,
            "gate": {"server": server, "storage": storage},
            "stalled": stall_reason(p, held, self.gate, age, self.after_s),
            "stall_after_s": self.after_s,
        }

    def publish(self) -> dict[str, Any]:
        fields = self.snapshot()
        self.info.update(fields)
        if self.metrics is not None:
            self.metrics.note_progress(fields["progress_age_s"], fields["commit_waiting"], fields["stalled"])
        return fields

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="stall-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        reported: str | None = None
        logged_at = float("-inf")
        # For the worker's life, a turn every PUBLISH_EVERY_S (an error costs one turn, never the watch); its
        # escalations are the stalled state status shows and the exit past commit_stuck_exit_s (docs/reliability.md).
        while True:
            try:
                stalled = self.publish()["stalled"]
                now = time.monotonic()
                # one line when it stalls, a reminder while it stays stalled, one when it moves again
                if stalled and (not reported or now - logged_at >= STALL_LOG_EVERY_S):
                    log.error("worker stalled: %s", stalled)
                    logged_at = now
                elif reported and not stalled:
                    log.warning("worker makes progress again (was stalled: %s)", reported)
                reported = stalled
                p = self.committer.progress()
                if stuck(p, self.stuck_exit_s):
                    log.critical(
                        "commit stream stuck for %.0f s with %d rows waiting (%s): exiting with %d for the supervisor "
                        "to restart this worker (its messages come back after the lease)",
                        p.since_commit_s, p.waiting, p.failing or "an attempt that does not return",
                        COMMIT_STUCK_EXIT,
                    )  # fmt: skip
                    self.exit(COMMIT_STUCK_EXIT)
            except Exception as exc:  # publishing is best effort: never the reason a worker stops
                log.warning("stall watch: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(PUBLISH_EVERY_S)
