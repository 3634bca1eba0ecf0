"""The Celery task and the signal hooks that tie a worker process to its WorkerRuntime."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from celery import Celery, signals
from celery.exceptions import Reject

from thinkfleet.message import TASK_NAME, PromptTask
from thinkfleet.settings import Settings
from workers.runtime import HandBack, current_runtime, get_runtime
from workers.transit import enable_transit

log = logging.getLogger("thinkfleet.worker")


def worker_identity(settings: Settings, celery_hostname: str | None) -> str:
    """--name / THINKFLEET_WORKER_NAME, else Celery's -n when given, else hostname-pid."""
    if settings.worker_name:
        return settings.worker_name
    if celery_hostname and not celery_hostname.startswith("celery@"):
        return celery_hostname.replace("@", "-")
    return f"{socket.gethostname()}-{os.getpid()}"


def register_tasks(app: Celery, settings: Settings) -> None:
    state: dict[str, Any] = {"hostname": None}

    def runtime() -> Any:
        return get_runtime(settings, worker_identity(settings, state["hostname"]))

    @app.task(name=TASK_NAME, bind=True, acks_late=True, ignore_result=True)
    def generate(self: Any, *args: Any) -> str:
        try:
            task = PromptTask.from_args(args)
        except (TypeError, ValueError) as exc:
            # A hand-pushed or corrupt message: log it, count it, drop it (acked) — never crash.
            log.error("malformed %s message %s dropped: %s", TASK_NAME, self.request.id, exc)
            rt = current_runtime()
            if rt is not None:
                rt.metrics.errors.labels("malformed_message").inc()
            return "malformed"
        try:
            return runtime().process(task)
        except HandBack:
            raise Reject("handed back", requeue=True) from None

    @signals.worker_init.connect(weak=False)
    def _on_init(sender: Any = None, **_: Any) -> None:
        state["hostname"] = getattr(sender, "hostname", None)
        # Before the consumer connects: its pops go through this worker's transit list.
        enable_transit(app, settings, worker_identity(settings, state["hostname"]))

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
