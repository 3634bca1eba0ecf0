"""A hand-back (``Reject`` with requeue: the server restarting, a storage gate closed) is normal operation: Celery's
own trace logs it in one line, not with the Reject's traceback (workers/tasks.py ``OneLineHandBack``); a task's
real failure keeps its traceback."""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import Callable

from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Reject

import workers.tasks  # noqa: F401 — installs the filter on Celery's trace logger, as a worker does


def _trace(fn: Callable[[], None]) -> str:
    """What Celery's real tracer logs (celery.app.trace) when ``fn`` runs as a task."""
    app = Celery("hand-back-log", set_as_current=False)
    task = app.task(name=f"t.{fn.__name__}")(fn)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    trace_log = logging.getLogger("celery.app.trace")
    trace_log.addHandler(handler)
    try:
        tid = str(uuid.uuid4())
        build_tracer(task.name, task, app=app, store_errors=False)(tid, (), {}, {"id": tid, "delivery_info": {}})
    finally:
        trace_log.removeHandler(handler)
    return out.getvalue()


def test_a_hand_back_logs_one_line_and_a_real_failure_its_traceback() -> None:
    def handed_back() -> None:
        raise Reject("handed back", requeue=True)

    def failed() -> None:
        raise RuntimeError("a bug of ours")

    said = _trace(handed_back)
    assert said.strip().count("\n") == 0 and "handed back" in said and "Traceback" not in said, said
    said = _trace(failed)
    assert "Traceback" in said and "a bug of ours" in said, said
