"""Run a simulator from tests, benchmarks and demos, and know its URL.

- ``with run_simulator(time_scale=1000) as url:`` — in this process, on its own event loop in a daemon
  thread, on a free loopback port. Options are :meth:`SimConfig.from_flat` names.
- :class:`SimulatorThread` — the same, with the :class:`~sglang_sim.simulator.Simulator` object at hand.
- ``with run_simulator_process("--time-scale", "1000") as proc:`` — the ``sglang-sim`` CLI as a
  subprocess, for tests that kill it (``proc.kill()``) or restart it (``proc.start()`` again).

Both imitate the deployed SGLang release unless given ``sglang_version=`` / ``--sglang-version``, and
answer health checks after ``health_min_s`` (1 s, like SGLang); tests that poll health often pass a
smaller ``health_min_s``. With ``load_s`` the port opens only after that long: ``start(wait=False)``
returns before it does (the port is chosen up front), for tests that watch a server load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from aiohttp import web

from sglang_sim.config import SimConfig
from sglang_sim.generate import SIM_KEY
from sglang_sim.server import create_app
from sglang_sim.simulator import Simulator

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, host: str = "127.0.0.1", timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


class SimulatorThread:
    """A simulator served by a private event loop in a daemon thread."""

    def __init__(self, config: SimConfig | None = None, *, port: int = 0, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("pass either a SimConfig or flat options, not both")
        self.config = config or SimConfig.from_flat(**options)
        self.port = port  # 0: a free one
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._app: web.Application | None = None
        self._opening: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.server.host}:{self.port}"

    @property
    def sim(self) -> Simulator:
        assert self._app is not None, "not started"
        return self._app[SIM_KEY]

    def start(self, timeout_s: float = 15.0, wait: bool = True) -> SimulatorThread:
        """Serve; returns once the port is open (``wait=False``: at once, the port still loading)."""
        ready = threading.Event()
        running = threading.Event()
        failure: list[BaseException] = []
        if not wait and self.port == 0:
            self.port = free_port()

        def opened(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                failure.append(task.exception())  # type: ignore[arg-type]
                assert self._loop is not None
                self._loop.stop()
            ready.set()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._opening = loop.create_task(self._open())
            self._opening.add_done_callback(opened)
            loop.call_soon(running.set)
            loop.run_forever()
            if not self._opening.done():
                self._opening.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(self._opening)
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=serve, name="sglang-sim", daemon=True)
        self._thread.start()
        if not (ready if wait else running).wait(timeout_s + (self.config.server.load_s if wait else 0.0)):
            raise TimeoutError("simulator did not start")
        if failure:
            raise failure[0]
        return self

    async def _open(self) -> None:
        if self.config.server.load_s > 0:
            await asyncio.sleep(self.config.server.load_s)  # "loading weights": nothing listens yet
        self._app = create_app(self.config)
        self._runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.server.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.config.server.port = self.port

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def call(self, fn: Callable[[Simulator], T], timeout_s: float = 10.0) -> T:
        """Run ``fn(sim)`` on the simulator's loop (its state is not thread-safe) and return the result."""
        assert self._loop is not None

        async def run() -> T:
            return fn(self.sim)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._loop = None

    def __enter__(self) -> SimulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def run_simulator(config: SimConfig | None = None, *, port: int = 0, **options: Any) -> Iterator[str]:
    """A simulator in a background thread; yields its base URL (``http://127.0.0.1:PORT``)."""
    with SimulatorThread(config, port=port, **options) as thread:
        yield thread.url


class SimulatorProcess:
    """``sglang-sim`` in a subprocess on a fixed port (so a restart comes back at the same URL)."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.port = port or free_port()
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        # A file, not a pipe: a full pipe would block the server's logging (and so the server).
        handle, self.log_path = tempfile.mkstemp(prefix="sglang-sim-", suffix=".log")
        os.close(handle)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0, wait: bool = True) -> SimulatorProcess:
        """Spawn; returns once the port is open (``wait=False``: at once, e.g. to watch ``--load-s``). The bound is
        generous: a simulator loading a real tokenizer on a loaded 2-core box took over 20 s to open its port."""
        command = [sys.executable, "-m", "sglang_sim.cli", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        if not wait:
            return self
        try:
            wait_for_port(self.port, timeout_s=timeout_s)
        except TimeoutError:
            self.kill()
            raise RuntimeError(f"sglang-sim did not start: {self.log()[-2000:]}") from None
        return self

    def log(self) -> str:
        """Everything the process logged so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as log:
            return log.read()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> SimulatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


@contextmanager
def run_simulator_process(*args: str, port: int | None = None) -> Iterator[SimulatorProcess]:
    """``sglang-sim --port PORT *args`` as a subprocess; yields the running :class:`SimulatorProcess`."""
    with SimulatorProcess(*args, port=port) as proc:
        yield proc
