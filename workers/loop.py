"""One asyncio event loop per worker process, run in its own thread.

Celery's thread-pool workers hand coroutines to it and block on the result (the pattern of
dramatiq/asyncio.py): every request of the process shares one aiohttp session and one semaphore.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    def __init__(self, name: str = "thinkfleet-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def start(self) -> EventLoopThread:
        self._thread.start()
        self._started.wait()
        return self

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it from the calling (worker) thread."""
        return self.submit(coro).result(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
