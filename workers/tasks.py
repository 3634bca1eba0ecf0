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

from celery import Celery, signals
from celery.exceptions import Reject
from celery.worker.consumer import Consumer
from celery.worker.request import Request

from thinkfleet.broker.guard import CompressionRefused, refuse_compression
from thinkfleet.broker.transit import enable_transit
from thinkfleet.message import TASK_NAME
from thinkfleet.settings import Settings
from workers.runtime import HandBack, RuntimeStartError, current_runtime, get_runtime

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
#: Seconds Celery task events (received, succeeded) wait in the buffer, so that one PUBLISH carries many.
EVENT_FLUSH_S = 1.0


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
    published in batches (:data:`EVENT_FLUSH_S`) instead of one publish per loop turn."""

    _events_due = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_compression()  # before any message is received
        super().__init__(*args, **kwargs)

    def on_send_event_buffered(self) -> None:
        # Celery flushes the task-event buffer on the next loop turn: at our rate that is a PUBLISH per
        # event. One flush per EVENT_FLUSH_S instead (the buffer also flushes itself at 24 events).
        # (Events are sent from pool threads too: the timer is only touched on the consumer's own loop.)
        hub = self.hub
        if hub is not None and not self._events_due:
            hub.call_soon(self._flush_events_later)

    def _flush_events_later(self) -> None:
        if not self._events_due:
            self._events_due = True
            self.hub.call_later(EVENT_FLUSH_S, self._flush_buffered_events)

    def _flush_buffered_events(self) -> None:
        self._events_due = False
        self._flush_events()

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        if isinstance(exc, CompressionRefused):
            record_refused("compressed_message", message, str(exc))
        super().on_decode_error(message, exc)  # logs it and acks: the message leaves the queue


class QuietRequest(Request):
    """Celery's request without its ``task-started`` event: Flower's task list needs received and
    succeeded (or failed); started comes a moment after received here, and cost a third of the events."""

    def send_event(self, type: str, **fields: Any) -> None:
        if type != "task-started":
            super().send_event(type, **fields)


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
            return rt.handle(args, self.request.id)
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
