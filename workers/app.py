"""The worker's Celery app: the broker's one configuration (:mod:`thinkfleet.broker.celery_app`) with the
``thinkfleet.generate`` task and the worker's signal hooks registered (:mod:`workers.tasks`).

``celery -A workers.app worker`` (docker-compose), Flower and ``celery inspect`` read the module attribute
``app``: it is built on first read, from ``THINKFLEET_*`` in the environment. The ``worker`` console script
(workers/cli.py) builds it from its own Settings object first (:func:`use_settings`).
"""

from __future__ import annotations

from typing import Any

from celery import Celery, bootsteps

from thinkfleet.broker import celery_app
from thinkfleet.settings import Settings
from workers.runtime import current_runtime
from workers.tasks import register_tasks

_app: Celery | None = None
#: Seconds between two looks at the in-flight bound by :class:`PrefetchFollowsBound`.
PREFETCH_CHECK_S = 1.0


def prefetch_for(bound: int, settings: Settings) -> int:
    """Messages a worker reserves for an in-flight bound: the bound plus ``Settings.commit_headroom`` — the
    messages whose rows wait for their group commit (the committer flushes early at 3/4 of it, so a headroom
    sized on the bound instead would hold the request slots with finished rows: measured, 22 running of a
    bound of 66, 0.38 of the throughput)."""
    return bound + settings.commit_headroom


class PrefetchFollowsBound(bootsteps.StartStopStep):
    """Celery's prefetch follows the in-flight bound (``inflight_mode=auto``), not its cap.

    ``worker_concurrency`` (the prefetch) is sized once, from the cap ``max_inflight`` (512 by default: 640
    messages). With the bound at ~110, ~400 prompts would wait in this worker's memory for a request slot:
    leased, renewed, unavailable to every other host (at a job's tail one host works through them while the
    others idle) and restored only after the visibility timeout if it dies. So the prefetch is
    ``prefetch_for(bound)`` (~240 there), checked every PREFETCH_CHECK_S on Celery's consumer thread (where
    kombu's QoS may be set); a lower prefetch takes effect as held messages are acked, nothing is handed back."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        self._timer = c.timer.call_repeatedly(PREFETCH_CHECK_S, self.follow, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def follow(self, c: Any) -> None:
        rt = current_runtime()
        qos = getattr(c, "qos", None)
        if rt is None or getattr(rt, "adaptive", None) is None or qos is None:
            return  # fixed bound (the prefetch already is its own), or not started yet
        want = min(prefetch_for(rt.attempts.semaphore.limit, rt.settings), c.initial_prefetch_count or 10**9)
        if qos.value != want:
            # The value the consumer loop keeps (QoS.set alone would be undone: the loop re-applies ``value``
            # whenever it differs from what was set), then applied now: this is the consumer's thread.
            if want < qos.value:
                qos.decrement_eventually(qos.value - want)
            else:
                qos.increment_eventually(want - qos.value)
            qos.update()


def make_app(settings: Settings | None = None, register: bool = True) -> Celery:
    """A configured Celery app with the worker's task registered (``register=False``: a publisher only)."""
    app = celery_app.make_app(settings)
    if register:
        register_tasks(app, app.thinkfleet_settings)  # type: ignore[attr-defined]
        # The worker runs its prompts on its event loop, not a thread each (workers/pool.py). Celery's
        # ``--pool`` left at its default takes the configured pool; an explicit ``--pool threads`` still works.
        app.conf.worker_pool = "workers.pool:LoopPool"
        app.steps["consumer"].add(PrefetchFollowsBound)
    return app


def use_settings(settings: Settings) -> Celery:
    """Build this module's ``app`` from ``settings`` (before anything has read it) and return it."""
    global _app
    if _app is not None:
        raise RuntimeError("workers.app.app is already built: set its settings before reading it")
    _app = make_app(settings)
    return _app


def __getattr__(name: str) -> Any:
    # PEP 562: ``app`` is built when first read, so the worker script can hand over its settings first.
    global _app
    if name == "app":
        if _app is None:
            _app = make_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
