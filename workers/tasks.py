"""The Celery task and the signal hooks that tie a worker process to its WorkerRuntime."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from celery import Celery, signals
from celery.exceptions import Reject

from thinkfleet.message import TASK_NAME
from thinkfleet.settings import Settings
from workers.runtime import HandBack, RuntimeStartError, current_runtime, get_runtime
from workers.transit import enable_transit

log = logging.getLogger("thinkfleet.worker")

#: Exit status of a worker whose runtime could not be built (sysexits' EX_CONFIG).
START_FAILED_EXIT = 78


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

    @app.task(name=TASK_NAME, bind=True, acks_late=True, ignore_result=True)
    def generate(self: Any, *args: Any) -> str:
        # The only exits: an outcome (acked: stored, dead-lettered, malformed recorded) or Reject with
        # requeue (handed back). Celery acks a task that raises anything else, which would drop it.
        try:
            rt = current_runtime()
            if rt is None:  # worker_init builds it before consuming; never acked without one
                log.error("message %s arrived before the worker runtime exists: handing it back", self.request.id)
                raise HandBack()
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
