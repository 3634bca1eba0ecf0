"""Celery task events that show the work as it is: STARTED when the request goes to the server, the real runtime.

A worker's prompt is received by Celery's consumer, waits for admission, its claim and a request slot (the
in-flight bound), runs on the worker's event loop (workers/pool.py) and ends there; Celery's trace runs only
after that, so its own ``task-started`` (sent when the pool accepts the message) and its ``runtime`` (the task
function's, which returns the outcome already computed) say nothing about the generation. Here instead:

- **STARTED** — ``task-started`` is sent when the delivery's first ``/generate`` request goes to the server
  (:func:`request_sent`, called by the attempts' client, :class:`StartedOnSend`); a retried request sends no
  second one. A message that never reaches the server (dead-lettered at admission, a duplicate of a stored
  prompt, a paused job's) goes from RECEIVED straight to its end.
- **RUNTIME** — ``runtime`` of ``task-succeeded`` / ``task-failed`` / ``task-rejected`` is wall seconds from that
  request going out until the outcome was known (the row committed, the dead letter written, the hand-back
  decided), or from when the pool took the message if no request went out (:meth:`TaskClock.runtime_s`).
- **FAILURE** — a delivery that ended dead-lettered (``dead``) or in the malformed list (``malformed``,
  ``refused``) is acked like every outcome, but shown as ``task-failed`` (:func:`failed_outcome`); every other
  outcome (stored, already stored, parked, fenced …) is ``task-succeeded`` with the outcome as its result; a
  hand-back stays Celery's ``task-rejected`` (requeue).

Every task event goes through one :class:`EventOutbox` (a deque: appends and pops are atomic, so any thread may
put), which the consumer's own thread drains into Celery's event dispatcher and flushes every ``EVENT_FLUSH_S``
(workers/tasks.py ``EventOutboxFlush``): the event loop and the trace threads never touch kombu's connection or
hub, and a batch of events is one PUBLISH. No Celery import here (tests/test_architecture.py): the Celery side —
the request class, the bootstep — lives in workers/tasks.py and workers/pool.py.
"""

from __future__ import annotations

import contextvars
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.client import SGLangClient
from workers.sglang import Generation

#: Task events held for the consumer at most (a consumer away for long — a broker outage — drops the oldest:
#: events are Flower's view, never the job's state).
OUTBOX_MAX = 50_000

#: Outcomes (what the task returns) of a delivery that was refused rather than stored: Flower shows them as
#: FAILURE with this text as the exception (the reason itself is in the dead letter / the malformed list).
FAILED_OUTCOMES = {
    "dead": "DeadLettered('producer status JOB names the reason; producer retry JOB resends it')",
    "malformed": "Malformed('not a prompt task: recorded in the malformed list')",
    "refused": "Refused('unsigned or altered: recorded in the malformed list')",
}


@dataclass
class TaskClock:
    """One delivery's moments (``time.monotonic()``): taken by the pool, its first request sent, its outcome known."""

    task_id: str
    taken: float = field(default_factory=time.monotonic)
    sent: float | None = None
    done: float | None = None
    #: Why the delivery was refused (a dead letter's class and message), for Flower's FAILURE row.
    reason: str | None = None

    def runtime_s(self) -> float:
        """Seconds from the request going to the server (else from the pool taking the message) to the outcome."""
        end = self.done if self.done is not None else time.monotonic()
        return max(0.0, end - (self.sent if self.sent is not None else self.taken))


class EventOutbox:
    """Task events from any thread, published by the consumer's thread (:meth:`drain`)."""

    def __init__(self, limit: int = OUTBOX_MAX) -> None:
        self._events: deque[tuple[str, dict[str, Any]]] = deque(maxlen=limit)

    def put(self, type: str, **fields: Any) -> None:
        # The moment it happened, not the moment it is published (up to EVENT_FLUSH_S later): Flower's
        # "started" and "succeeded" columns are these timestamps.
        fields.setdefault("timestamp", time.time())
        self._events.append((type, fields))

    def drain(self, send: Callable[..., Any]) -> int:
        """``send(type, **fields)`` every event put so far, oldest first (the consumer's thread only)."""
        sent = 0
        while True:
            try:
                type, fields = self._events.popleft()
            except IndexError:
                return sent
            send(type, **fields)
            sent += 1

    def __len__(self) -> int:
        return len(self._events)


#: The worker process's one outbox.
outbox = EventOutbox()
#: Clocks of deliveries accepted by the pool and not yet taken by whoever runs them (task id → clock): the
#: request (workers/tasks.py ``QuietRequest.on_accepted``) makes one, the pool (or the task function, under
#: Celery's thread pool) takes it a moment later on the same thread.
_accepted: dict[str, TaskClock] = {}
#: The clock of the delivery whose prompt runs in this context (set for the prompt's asyncio task).
_current: contextvars.ContextVar[TaskClock | None] = contextvars.ContextVar("thinkfleet_task_clock", default=None)


def accept(task_id: str) -> TaskClock:
    """A delivery accepted by the pool: its clock starts (and waits for :func:`take`)."""
    clock = _accepted[task_id] = TaskClock(task_id)
    return clock


def take(task_id: str) -> TaskClock:
    """The clock :func:`accept` started for ``task_id`` (a new one if none did)."""
    return _accepted.pop(task_id, None) or TaskClock(task_id)


def forget(task_id: str) -> None:
    """Drop a clock nobody took (a message Celery's trace refused before the task function ran)."""
    _accepted.pop(task_id, None)


def context_for(clock: TaskClock) -> contextvars.Context:
    """A copy of the current context in which ``clock`` is the running delivery's (for ``loop.create_task``)."""
    context = contextvars.copy_context()
    context.run(_current.set, clock)
    return context


def enter(clock: TaskClock) -> contextvars.Token[TaskClock | None]:
    """Make ``clock`` the running delivery's in this thread's context (Celery's thread pool); :func:`leave` after."""
    return _current.set(clock)


def leave(token: contextvars.Token[TaskClock | None]) -> None:
    _current.reset(token)


def request_sent() -> None:
    """The running delivery's request is going to the server: the first time, its task is STARTED."""
    clock = _current.get()
    if clock is None or clock.sent is not None:
        return
    clock.sent = time.monotonic()
    outbox.put("task-started", uuid=clock.task_id)


def note_refusal(reason: str) -> None:
    """The running delivery is being refused for ``reason`` (a dead letter): its FAILURE row will say so."""
    clock = _current.get()
    if clock is not None:
        clock.reason = reason[:500]


def failed_outcome(result: Any, reason: str | None = None) -> str | None:
    """The exception text Flower shows for an outcome that is a refusal, or None for any other outcome.
    ``result`` is what Celery's trace reports: the outcome's repr (``"'dead'"``); ``reason``, what
    :func:`note_refusal` recorded for it."""
    text = str(result or "").strip("'\"")
    failure = FAILED_OUTCOMES.get(text)
    if failure is not None and reason:
        return f"DeadLettered({reason!r}; producer retry JOB resends it)" if text == "dead" else failure
    return failure


class StartedOnSend:
    """The SGLang client as the request attempts (workers/attempts.py) see it: each ``/generate`` first marks the
    running delivery's task STARTED (:func:`request_sent`; once per delivery). Everything else is the client's."""

    def __init__(self, client: SGLangClient) -> None:
        self._client = client

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        # Runs as the request's own asyncio task, in a copy of the prompt's context: the delivery's clock is there.
        request_sent()
        return await self._client.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
