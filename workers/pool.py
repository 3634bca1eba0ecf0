"""A Celery pool without a thread per message: each prompt runs on the worker's event loop.

Celery's thread pool gives every message a thread that blocks until the event loop has handled the
prompt (workers/loop.py): per message a thread wake-up, two cross-thread hand-offs and the GIL passed
back and forth — with ``max_inflight`` plus headroom threads mostly asleep. :class:`LoopPool` starts the
prompt on the loop straight from Celery's consumer instead (:meth:`WorkerRuntime.ahandle`) and, once it
has an outcome, runs Celery's own trace on one of a few threads: the ``task_prerun``/``task_postrun``
signals, the task function — which returns the outcome already computed (:meth:`WorkerRuntime.take_outcome`)
— and the ack, or the requeue of a handed-back prompt, exactly as with the thread pool. The concurrency
stays Celery's prefetch bound (``worker_concurrency``); it no longer costs a thread per held message.

So Celery's trace cannot tell when the work started nor how long it took: the prompt's asyncio task carries its
delivery's clock (workers/events.py), which marks the task STARTED when its request goes to the server and gives
the ending event its runtime, up to the moment the outcome was known here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from celery.concurrency.base import BasePool, apply_target

from thinkfleet.broker.bodies import BodyReader
from workers import events as task_events
from workers.runtime import current_runtime

log = logging.getLogger("thinkfleet.worker")

#: Threads that run Celery's trace (signals, the task function's return, the ack) after a prompt ends.
TRACE_THREADS = 4
#: How long a stopping pool waits for prompts still running, beyond the drain's grace (they end stored,
#: dead-lettered or handed back by then; a message left unacked is restored by the visibility timeout).
STOP_EXTRA_S = 30.0


class _Done:
    """What ``on_apply`` returns to Celery (it only keeps it)."""

    def __init__(self, future: Future[Any]) -> None:
        self.f = future

    def get(self, timeout: float | None = None) -> Any:
        return self.f.result(timeout)

    def wait(self, timeout: float | None = None) -> None:
        wait([self.f], timeout)


class LoopPool(BasePool):
    """``worker_pool = "workers.pool:LoopPool"``: see the module docstring."""

    body_can_be_buffer = False
    signal_safe = False
    is_green = False
    task_join_will_block = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tracer = ThreadPoolExecutor(max_workers=TRACE_THREADS, thread_name_prefix="thinkfleet-trace")
        self._running: set[Any] = set()  # prompts started on the loop whose trace has not finished
        # Only the content types the app accepts (msgpack, json): never a pickle, here as in the trace.
        self._bodies = BodyReader(self.app.conf.accept_content)

    def on_stop(self) -> None:
        # Celery stops the pool after its consumer: prompts still running end within the drain's grace.
        rt = current_runtime()
        grace = rt.settings.shutdown_grace_s if rt is not None else 0.0
        deadline = time.monotonic() + grace + STOP_EXTRA_S
        while self._running and time.monotonic() < deadline:
            time.sleep(0.1)
        self._tracer.shutdown(wait=True)
        super().on_stop()

    def on_terminate(self) -> None:
        self._tracer.shutdown(wait=False, cancel_futures=True)

    def on_apply(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        **_: Any,
    ) -> _Done:
        rt = current_runtime()
        task_args = _task_args(args, self._bodies) if rt is not None else None
        if rt is None or task_args is None:
            # No runtime yet, or a body we cannot read: Celery's trace does it all (and hands it back).
            return _Done(self._tracer.submit(apply_target, target, args, kwargs, callback, accept_callback))
        if accept_callback is not None:
            accept_callback(os.getpid(), time.monotonic())
        task_id = str(args[1])  # type: ignore[index]
        clock = task_events.take(task_id)  # its request's on_accepted started it, just now on this thread
        traced: Future[Any] = Future()
        token = object()
        self._running.add(token)

        def trace(prompt: asyncio.Task[str]) -> None:
            rt.keep_outcome(task_id, prompt)  # the task function returns (or raises) its result
            try:
                traced.set_result(apply_target(target, args, kwargs, callback, None))
            except BaseException as exc:
                traced.set_exception(exc)
            finally:
                self._running.discard(token)

        def ended(prompt: asyncio.Task[str]) -> None:  # on the loop, the moment the outcome is known
            clock.done = time.monotonic()
            self._tracer.submit(trace, prompt)

        def start() -> None:  # on the loop: a task, no concurrent future chained to it
            # In a context holding the delivery's clock: its first request marks it STARTED (workers/events.py).
            prompt = loop.create_task(rt.ahandle(task_args, task_id), context=task_events.context_for(clock))
            prompt.add_done_callback(ended)

        loop = rt.loop.loop
        loop.call_soon_threadsafe(start)
        return _Done(traced)

    def _get_info(self) -> dict[str, Any]:
        info = super()._get_info()
        info.update({"max-concurrency": self.limit, "running": len(self._running)})
        return info


def _task_args(args: tuple[Any, ...] | None, bodies: BodyReader) -> tuple[Any, ...] | None:
    """The task's positional args from Celery's trace arguments ``(name, id, request, body, content_type,
    content_encoding)`` (message protocol 2: the body is ``(args, kwargs, embed)``); None if unreadable."""
    try:
        _name, _id, _request, body, content_type, content_encoding = args[:6]  # type: ignore[index]
        return bodies.task_args(body, content_type, content_encoding)
    except Exception as exc:
        log.warning("could not read a task body before its trace (%s): the trace handles it", exc)
        return None
