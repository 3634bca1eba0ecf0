"""A fleet shared by the tests of one module: one simulator and its workers, each test running its own job on it.

Why: on the 2-core CI box a Celery worker costs ≈ 4.5 CPU-s to start and stop and a simulator ≈ 1, while the two
idle cost ≈ 0.03 CPU-s a second together; a file whose tests each started their own paid that per test. With
``--dist loadfile`` a module's tests run in one pytest process, so a ``scope="module"`` fixture starts it once.

The fleet lives on the session's redis-server (DB 0) under a key prefix and queue of its own
(:func:`testing.harness.isolated_settings`), so it shares nothing with another module's fleet; its tests tell
their work apart by job id. Load-proof: a test that kills, stops or reconfigures a worker or the simulator keeps a
fleet of its own (:func:`fleet` as a context manager inside the test); :meth:`Fleet.ready` restarts a worker that
died under an earlier test, so no test depends on the ones before it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from testing.fleet import WorkerProcess
from testing.harness import fast_env, isolated_settings, simulator
from thinkfleet.settings import Settings


@dataclass
class Fleet:
    """A running simulator (``sim``: its URL) and workers serving ``settings``' queue."""

    settings: Settings
    client: redis.Redis
    sim: str
    workers: list[WorkerProcess]
    logs: Path

    def ready(self) -> Fleet:
        """The fleet with every worker up: one that died under an earlier test is started again (and its first
        heartbeat awaited), so a test never inherits another's damage."""
        for worker in self.workers:
            if not worker.alive():
                worker.start()
                worker.wait_ready(self.client, self.settings.keys)
        return self


@contextmanager
def fleet(
    redis_url: str,
    tmp: Path,
    sim_args: Sequence[str],
    workers: Sequence[str] = ("w1",),
    settings: dict[str, object] | None = None,
    **worker_settings: object,
) -> Iterator[Fleet]:
    """A simulator started with ``sim_args`` and one worker per name (``fast_env`` plus ``worker_settings``), on
    ``redis_url`` under a fresh key prefix and queue (``settings``: further :class:`Settings` fields, for the
    tests' own view — give the workers the ones they must share through ``worker_settings`` too)."""
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    own = isolated_settings(redis_url, str(tmp / "out"), **(settings or {}))
    client = redis.Redis.from_url(redis_url)
    try:
        with simulator(logs, *sim_args) as sim:
            env = fast_env(own, sim, **worker_settings)
            procs = [WorkerProcess(name, env, logs) for name in workers]
            try:
                for proc in procs:  # all start at once; then each first heartbeat is awaited
                    proc.start()
                for proc in procs:
                    proc.wait_ready(client, own.keys)
                yield Fleet(own, client, sim, procs, logs)
            finally:
                for proc in procs:
                    proc.terminate()
    finally:
        client.close()


class FleetPool:
    """Fleets started on first use, one per name, until :meth:`close` (a module fixture's teardown): for a module
    whose tests need a few kinds of simulator (model families, SGLang releases).

    At most ``keep`` are running: asking for another stops the one used longest ago (a fleet asked for again later
    starts afresh). An idle fleet is not free (≈ 0.05 CPU-s a second under load, for the whole time any other
    test runs), so a module orders its tests by the fleet they use, and the tests with fleets of their own first.
    """

    def __init__(self, redis_url: str, tmp: Path, keep: int = 1) -> None:
        self.redis_url = redis_url
        self.tmp = tmp
        self.keep = keep
        self._running: dict[str, tuple[Fleet, ExitStack]] = {}  # oldest use first
        self._args: dict[str, tuple[object, ...]] = {}
        self._starts = 0

    def get(self, name: str, sim_args: Sequence[str], **kwargs: object) -> Fleet:
        """The fleet called ``name``, started with these arguments (see :func:`fleet`) unless it is running; the
        same name must always come with the same arguments."""
        args = (tuple(sim_args), sorted(kwargs.items()))
        if self._args.setdefault(name, args) != args:
            raise ValueError(f"fleet {name!r} was started with {self._args[name]}, not {args}")
        if name in self._running:
            self._running[name] = self._running.pop(name)  # the most recently used now
        else:
            while len(self._running) >= self.keep:
                _, stack = self._running.pop(next(iter(self._running)))
                stack.close()
            self._starts += 1  # a directory per start: a restarted fleet's output holds no earlier job's parts
            stack = ExitStack()
            started = fleet(self.redis_url, self.tmp / f"{name}-{self._starts}", sim_args, **kwargs)  # type: ignore[arg-type]
            self._running[name] = (stack.enter_context(started), stack)
        return self._running[name][0].ready()

    def close(self) -> None:
        while self._running:
            _, (_, stack) = self._running.popitem()
            stack.close()
