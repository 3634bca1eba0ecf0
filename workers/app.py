"""The worker's Celery app: the broker's one configuration (:mod:`thinkfleet.broker.celery_app`) with the
``thinkfleet.generate`` task and the worker's signal hooks registered (:mod:`workers.tasks`).

``celery -A workers.app worker`` (docker-compose), Flower and ``celery inspect`` read the module attribute
``app``: it is built on first read, from ``THINKFLEET_*`` in the environment. The ``worker`` console script
(workers/cli.py) builds it from its own Settings object first (:func:`use_settings`).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from thinkfleet.broker import celery_app
from thinkfleet.settings import Settings
from workers.tasks import register_tasks

_app: Celery | None = None


def make_app(settings: Settings | None = None, register: bool = True) -> Celery:
    """A configured Celery app with the worker's task registered (``register=False``: a publisher only)."""
    app = celery_app.make_app(settings)
    if register:
        register_tasks(app, app.thinkfleet_settings)  # type: ignore[attr-defined]
        # The worker runs its prompts on its event loop, not a thread each (workers/pool.py). Celery's
        # ``--pool`` left at its default takes the configured pool; an explicit ``--pool threads`` still works.
        app.conf.worker_pool = "workers.pool:LoopPool"
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
