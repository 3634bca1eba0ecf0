"""Named fault-injection points on a prompt's trip, enabled only by an environment variable (tests).

``THINKFLEET_FAILPOINTS="after_claim=raise,after_part_write=kill"`` arms points; each fires at most
``THINKFLEET_FAILPOINT_TIMES`` times (default 1) *across all processes*, counted by marker files in
``THINKFLEET_FAILPOINT_DIR`` (default: the temp dir), so a worker restarted after a ``kill`` does not
die again at the same point. Unset, :func:`failpoint` costs one dict lookup.

Actions: ``raise`` (a :class:`FailpointError`, which nothing in thinkfleet catches on purpose — it
must travel the "unexpected exception" path), ``kill`` (SIGKILL of this process, no cleanup).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from pathlib import Path

log = logging.getLogger("thinkfleet.failpoints")

ENV = "THINKFLEET_FAILPOINTS"
DIR_ENV = "THINKFLEET_FAILPOINT_DIR"
TIMES_ENV = "THINKFLEET_FAILPOINT_TIMES"

#: Every point, in the order a prompt passes them. Worker points first, then the producer's.
WORKER_POINTS = (
    "after_pop",  # the task body has the message, nothing else happened
    "after_claim",  # the prompt is claimed in Redis
    "during_generate",  # the /generate request is in flight
    "after_mark",  # the claims name the part about to be written
    "before_part_write",
    "after_part_write",  # the part file exists, the prompts are not yet done
    "after_finalize",  # done in Redis, the message not yet acked
    "before_ack",  # the task returns its outcome to Celery
)
PRODUCER_POINTS = ("submit_after_stage",)  # messages staged, the commit MULTI not yet run
POINTS = WORKER_POINTS + PRODUCER_POINTS
ACTIONS = ("raise", "kill")


class FailpointError(RuntimeError):
    """Raised by an armed ``raise`` failpoint."""


def _parse(spec: str) -> dict[str, str]:
    armed: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        if name not in POINTS or action not in ACTIONS:
            raise ValueError(f"{ENV}: bad item {item!r}; points: {', '.join(POINTS)}; actions: {', '.join(ACTIONS)}")
        armed[name] = action
    return armed


_ARMED: dict[str, str] = _parse(os.environ.get(ENV, ""))


def arm(spec: str) -> None:
    """Re-read the arming (tests that set the variable after import)."""
    global _ARMED
    _ARMED = _parse(spec)


def _take_shot(name: str) -> bool:
    """True if this firing is still within the budget (a marker file per shot, created atomically)."""
    directory = Path(os.environ.get(DIR_ENV) or tempfile.gettempdir())
    times = int(os.environ.get(TIMES_ENV, "1"))
    for shot in range(times):
        try:
            fd = os.open(directory / f"failpoint-{name}-{shot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        return True
    return False


def failpoint(name: str) -> None:
    """Fire ``name`` if it is armed and has shots left; otherwise do nothing."""
    action = _ARMED.get(name)
    if action is None or not _take_shot(name):
        return
    log.warning("failpoint %s: %s (pid %d)", name, action, os.getpid())
    if action == "kill":
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    raise FailpointError(f"failpoint {name}")
