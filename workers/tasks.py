"""The Celery task and the signal hooks that tie a worker process to its WorkerRuntime.

Message-level refusals happen here, before kombu or Celery decode anything a sender controls:

- **compression**: kombu decompresses a body whose ``compression`` header names a codec while it
  builds the ``Message`` — before any content check, with no output limit (a 2 KB zlib frame
  is 64 MiB). A worker's consumer (:class:`GuardedConsumer`) installs ``refuse_compression``
  (thinkfleet/broker/guard.py) first: every codec raises ``CompressionRefused`` instead of inflating, kombu
  hands the message to ``on_decode_error``, which records it in the malformed list (``compressed_message``), counts it
  and acks (drops) it. thinkfleet never sends compressed messages (ids are zstd-packed inside).
- **size**: a message body over ``Settings.message_byte_limit`` is recorded as ``oversize`` in the
  malformed list, counted and acked by the task's strategy (:func:`guarded_strategy`) before Celery
  decodes the msgpack body.

Everything inside a decoded message (names, overrides, ids, hash, vocabulary) is checked by
``thinkfleet.message`` in the runtime.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, bootsteps, signals
from celery.exceptions import Reject
from celery.worker.consumer import Consumer
from celery.worker.request import Request

from thinkfleet.broker.guard import CompressionRefused, refuse_compression
from thinkfleet.broker.transit import enable_transit
from thinkfleet.message import TASK_NAME
from thinkfleet.settings import Settings
from workers import events as task_events
from workers.runtime import HandBack, RuntimeStartError, WorkerRuntime, current_runtime, get_runtime

log = logging.getLogger("thinkfleet.worker")


class OneLineHandBack(logging.Filter):
    """Celery logs a task's ``Reject`` with the Reject's own traceback (its log policy says so): 11 lines for each
    hand-back, hundreds while a server restarts. A hand-back is normal operation (counted as
    ``thinkfleet_handed_back``): one line. An unexpected error behind one is logged by ``generate`` with its own
    traceback, before the Reject."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info = None
            record.exc_text = None
        return True


logging.getLogger("celery.app.trace").addFilter(OneLineHandBack())

#: Exit status of a worker whose runtime could not be built (sysexits' EX_CONFIG).
START_FAILED_EXIT = 78
#: Seconds Celery task events (received, started, succeeded) wait in the buffer, so that one PUBLISH carries many.
EVENT_FLUSH_S = 1.0
#: The events that end a delivery here: they carry its runtime (workers/events.py).
ENDING_EVENTS = frozenset({"task-succeeded", "task-failed", "task-rejected"})


def _message_summary(message: Any) -> dict[str, Any]:
    headers = getattr(message, "headers", None) or {}
    body = getattr(message, "body", b"") or b""
    return {
        "message_id": str(headers.get("id", ""))[:200] or None,
        "task": str(headers.get("task", ""))[:200],
        "argsrepr": str(headers.get("argsrepr", ""))[:500],
        "compression": str(headers.get("compression", ""))[:64] or None,
        "body_bytes": len(body) if hasattr(body, "__len__") else None,
    }


def record_refused(kind: str, message: Any, reason: str) -> None:
    """Log, count (``thinkfleet_internal_errors{kind}``) and record a message refused before decoding in
    the malformed list (its headers, never its body). Best effort: the message is dropped either way."""
    summary = _message_summary(message)
    log.error("refused message %s (%s): %s; headers %s", summary["message_id"], kind, reason, summary)
    rt = current_runtime()
    if rt is None:
        return
    rt.metrics.errors.labels(kind).inc()
    record = {**summary, "error": f"{kind}: {reason}", "at": time.time()}
    try:
        rt.loop.run(rt.push_malformed(json.dumps(record)), timeout_s=10)
    except Exception as exc:
        log.error("could not record refused message %s: %s", summary["message_id"], exc)


class GuardedConsumer(Consumer):
    """Celery's consumer with compressed messages refused before kombu inflates them, and its task events
    published in batches (:class:`EventOutboxFlush`, every :data:`EVENT_FLUSH_S`) instead of one publish per
    loop turn."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_compression()  # before any message is received
        super().__init__(*args, **kwargs)

    def on_send_event_buffered(self) -> None:
        # Celery flushes the task-event buffer on the next loop turn: at our rate that is a PUBLISH per event.
        # EventOutboxFlush flushes it every EVENT_FLUSH_S instead (the buffer also flushes itself at 24 events).
        pass

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        if isinstance(exc, CompressionRefused):
            record_refused("compressed_message", message, str(exc))
        super().on_decode_error(message, exc)  # logs it and acks: the message leaves the queue


class EventOutboxFlush(bootsteps.StartStopStep):
    """Every :data:`EVENT_FLUSH_S`, on the consumer's thread: the task events of workers/events.py's outbox (put
    by the event loop and the trace threads, which must not touch kombu's connection or hub) go to Celery's event
    dispatcher, and its buffer — those and the ``task-received`` events Celery buffers itself — is published, a
    batch in one PUBLISH. A consumer bootstep, so it starts again on the new connection after a reconnect."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        self._timer = c.timer.call_repeatedly(EVENT_FLUSH_S, self.flush, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush(c)  # what is waiting goes before the dispatcher closes

    def flush(self, c: Any) -> None:
        dispatcher = c.event_dispatcher
        if dispatcher is None:  # reconnecting: the events wait in the outbox
            return
        task_events.outbox.drain(dispatcher.send)
        dispatcher.flush()


class QuietRequest(Request):
    """Celery's request with its task events as workers/events.py says: no ``task-started`` when the pool accepts
    the message (the event loop sends it when the request goes to the server), ``runtime`` from that moment to the
    outcome, a refused delivery (dead-lettered, malformed) as ``task-failed`` — and every event put in the
    outbox, never published from the thread that ends the task."""

    #: This delivery's moments (workers/events.py), from the pool's accepting it.
    clock: task_events.TaskClock | None = None

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        self.clock = task_events.accept(self.id)  # taken by the pool (or the task function) on this thread
        super().on_accepted(pid, time_accepted)

    def send_event(self, type: str, **fields: Any) -> None:
        if type == "task-started" or not (self._eventer and self._eventer.enabled and self.task.send_events):
            return
        if type in ENDING_EVENTS:
            task_events.forget(self.id)
            if self.clock is not None:
                fields["runtime"] = self.clock.runtime_s()
        if type == "task-succeeded":
            failure = task_events.failed_outcome(fields.get("result"), self.clock.reason if self.clock else None)
            if failure is not None:  # acked like every outcome; in Flower, a failure
                type, fields = "task-failed", {"exception": failure, "runtime": fields.get("runtime")}
        task_events.outbox.put(type, uuid=self.id, **fields)


def guarded_strategy(settings: Settings) -> Callable[..., Any]:
    """The task's Celery strategy: Celery's own, behind the size check (and a compression check, should
    a message ever arrive inflated)."""
    limit = settings.message_byte_limit

    def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
        from celery.worker.strategy import default

        handle = default(task, app, consumer, **kwargs)

        def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> Any:
            raw = message.body if body is None else None
            size = len(raw) if isinstance(raw, bytes | bytearray | str | memoryview) else 0
            reason = kind = None
            if message.headers.get("compression"):
                kind, reason = "compressed_message", "a compression header reached the task (kombu inflated it)"
            elif size > limit:
                kind, reason = "oversize", f"body of {size:,} bytes is over the limit of {limit:,} (max_message_bytes)"
            if kind is None:
                return handle(message, body, ack, reject, callbacks, **kw)
            record_refused(kind, message, str(reason))
            message.ack_log_error(log, consumer.connection_errors)
            return None

        return on_message

    return strategy


def _run_here(rt: WorkerRuntime, args: Any, task_id: str) -> str:
    """The prompt run from the task function, this thread waiting (Celery's thread pool; LoopPool's fallback for
    a body it could not read): the loop's task for it copies this thread's context, which holds its clock."""
    clock = task_events.take(task_id)
    token = task_events.enter(clock)
    try:
        return rt.handle(args, task_id)
    finally:
        clock.done = time.monotonic()
        task_events.leave(token)


def worker_identity(settings: Settings, celery_hostname: str | None) -> str:
    """--name / THINKFLEET_WORKER_NAME, else Celery's -n when given, else hostname-pid."""
    if settings.worker_name:
        return settings.worker_name
    if celery_hostname and not celery_hostname.startswith("celery@"):
        return celery_hostname.replace("@", "-")
    return f"{socket.gethostname()}-{os.getpid()}"


def fail_start(exc: BaseException) -> None:
    """Exit the worker process now, non-zero, naming the cause (and the fix, where we know it)."""
    if isinstance(exc, RuntimeStartError):
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {exc}"
        log.error("worker runtime failed to start", exc_info=exc)
    text = f"thinkfleet worker cannot start, nothing was consumed: {message}"
    log.critical(text)
    for handler in logging.getLogger().handlers:
        handler.flush()
    print(text, file=sys.stderr, flush=True)
    os._exit(START_FAILED_EXIT)


def register_tasks(app: Celery, settings: Settings) -> None:
    state: dict[str, Any] = {"hostname": None}

    def runtime() -> Any:
        return get_runtime(settings, worker_identity(settings, state["hostname"]))

    # Compressed messages are refused by the consumer before kombu inflates them (GuardedConsumer).
    app.conf.worker_consumer = f"{__name__}:GuardedConsumer"
    app.steps["consumer"].add(EventOutboxFlush)  # task events published in batches from the consumer's thread

    @app.task(
        name=TASK_NAME,
        bind=True,
        acks_late=True,
        ignore_result=True,
        Strategy=staticmethod(guarded_strategy(settings)),  # oversize bodies refused before decoding
        Request=QuietRequest,
    )
    def generate(self: Any, *args: Any) -> str:
        # The only exits: an outcome (acked: stored, dead-lettered, malformed recorded) or Reject with
        # requeue (handed back). Celery acks a task that raises anything else, which would drop it.
        try:
            rt = current_runtime()
            if rt is None:  # worker_init builds it before consuming; never acked without one
                log.error("message %s arrived before the worker runtime exists: handing it back", self.request.id)
                raise HandBack()
            ahead = rt.take_outcome(self.request.id)  # LoopPool ran the prompt on the loop (workers/pool.py)
            if ahead is not None:
                if ahead.cancelled():  # only when the loop stops under it: never acked
                    raise HandBack()
                return ahead.result()
            return _run_here(rt, args, self.request.id)
        except HandBack:
            raise Reject("handed back", requeue=True) from None
        except Exception as exc:
            log.exception("unexpected error around message %s: handing it back", self.request.id)
            raise Reject(f"handed back after {type(exc).__name__}", requeue=True) from None

    @signals.worker_init.connect(weak=False)
    def _on_init(sender: Any = None, **_: Any) -> None:
        state["hostname"] = getattr(sender, "hostname", None)
        # Before the consumer connects: its pops go through this worker's transit list.
        enable_transit(app, settings, worker_identity(settings, state["hostname"]))
        # Build the runtime before anything is consumed: a worker that cannot run must not take
        # (and lose) a single message. Celery's signal dispatch swallows exceptions, so exit here.
        try:
            runtime()
        except Exception as exc:
            fail_start(exc)

    @signals.worker_ready.connect(weak=False)
    def _on_ready(sender: Any = None, **_: Any) -> None:
        runtime().attach_consumer(sender)

    @signals.task_received.connect(weak=False)
    def _on_received(request: Any = None, **_: Any) -> None:
        rt = current_runtime()
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if rt is not None and tag is not None:
            rt.held.add(request.id, str(tag))
            rt.metrics.held.set(len(rt.held))

    @signals.task_postrun.connect(weak=False)
    def _on_postrun(task_id: str | None = None, **_: Any) -> None:
        rt = current_runtime()
        if rt is not None and task_id:
            rt.held.discard(task_id)
            rt.metrics.held.set(len(rt.held))

    @signals.worker_shutting_down.connect(weak=False)
    def _on_shutting_down(**_: Any) -> None:
        rt = current_runtime()
        if rt is not None:
            rt.drain()

    @signals.worker_shutdown.connect(weak=False)
    def _on_shutdown(**_: Any) -> None:
        rt = current_runtime()
        if rt is not None:
            rt.close()
