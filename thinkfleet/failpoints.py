"""Named fault-injection points on a prompt's trip, enabled only by an environment variable (tests).

``THINKFLEET_FAILPOINTS="after_claim=raise,after_part_write=kill"`` arms points; each fires at most
``THINKFLEET_FAILPOINT_TIMES`` times (default 1) *across all processes*, counted by marker files in
``THINKFLEET_FAILPOINT_DIR`` (default: the temp dir), so a worker restarted after a ``kill`` does not
die again at the same point. An item may narrow itself to one prompt and set its own count:
``during_generate=raise:always@p00003`` (``:N`` or ``:always``; ``@`` matches the ``key`` the call
site passes, the prompt id — the per-prompt points pass one; the group-commit points ``after_mark``
… ``after_finalize`` act on a batch and pass none, so an ``@`` arming never fires there).
Unset, :func:`failpoint` costs one dict lookup.

Actions: ``raise`` (a :class:`FailpointError`, which nothing in thinkfleet catches on purpose — it
must travel the "unexpected exception" path), ``kill`` (SIGKILL of this process, no cleanup), ``stop``
(SIGSTOP of this process — every thread, the heartbeat too, as a GC pause, a frozen VM or a partition would;
the test sends SIGCONT when it wants the process back).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from dataclasses import dataclass
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
#: Points only an agentic job's executor steps pass (workers/tool_exec.py), between the generate and the part write.
TOOL_POINTS = (
    "after_tool_call",  # the executor answered, its results not yet recorded
    "after_tool_record",  # … recorded, the step's part not yet written
)
PRODUCER_POINTS = ("submit_after_stage",)  # messages staged, the commit MULTI not yet run
POINTS = WORKER_POINTS + TOOL_POINTS + PRODUCER_POINTS
ACTIONS = ("raise", "kill", "stop")


class FailpointError(RuntimeError):
    """Raised by an armed ``raise`` failpoint."""


@dataclass(frozen=True)
class _Arm:
    action: str
    times: int | None  # None: the environment's default; -1: always
    key: str | None  # fire only for this key (prompt id)


def _parse(spec: str) -> dict[str, _Arm]:
    armed: dict[str, _Arm] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition("=")
        rest, _, key = rest.partition("@")
        action, _, times = rest.partition(":")
        if name not in POINTS or action not in ACTIONS or (times and times != "always" and not times.isdigit()):
            raise ValueError(
                f"{ENV}: bad item {item!r}; form name=action[:N|:always][@key]; "
                f"points: {', '.join(POINTS)}; actions: {', '.join(ACTIONS)}"
            )
        count = None if not times else -1 if times == "always" else int(times)
        armed[name] = _Arm(action, count, key or None)
    return armed


_ARMED: dict[str, _Arm] = _parse(os.environ.get(ENV, ""))


def arm(spec: str) -> None:
    """Re-read the arming (tests that set the variable after import)."""
    global _ARMED
    _ARMED = _parse(spec)


def _take_shot(name: str, times: int | None) -> bool:
    """True if this firing is still within the budget (a marker file per shot, created atomically)."""
    if times == -1:
        return True
    directory = Path(os.environ.get(DIR_ENV) or tempfile.gettempdir())
    if times is None:
        times = int(os.environ.get(TIMES_ENV, "1"))
    for shot in range(times):
        try:
            fd = os.open(directory / f"failpoint-{name}-{shot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        return True
    return False


def failpoint(name: str, key: str | None = None) -> None:
    """Fire ``name`` if it is armed (for ``key``, when the arming names one) and has shots left."""
    arm = _ARMED.get(name)
    if arm is None or (arm.key is not None and arm.key != key) or not _take_shot(name, arm.times):
        return
    action = arm.action
    log.warning("failpoint %s: %s (pid %d)", name, action, os.getpid())
    if action in ("kill", "stop"):
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        if action == "stop":
            log.warning("failpoint %s: continued (pid %d)", name, os.getpid())
            return
    raise FailpointError(f"failpoint {name}")
