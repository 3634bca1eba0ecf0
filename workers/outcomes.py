"""How a message ends when it is not stored: dead-lettered (counted, logged, the whole message kept) or recorded in
the fleet-wide malformed list (a message no job can own).

Every refusal of the pipeline (workers/pipeline.py), its admission (workers/admission.py) and its request checks
(workers/limits.py) ends here, so that a dead letter is always the same three acts — the ledger's record, the
``dead`` counter under its error class, one log line naming the prompt — and none of them is forgotten in one of the
many places a prompt can be refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import Ledger
from workers import events as task_events
from workers.attempts import HandBack
from workers.metrics import WorkerMetrics

log = logging.getLogger("thinkfleet.worker")


def crash_summary(exc: BaseException) -> str:
    """``Class: last line of the traceback`` — what a poison dead letter and the crash log keep."""
    name = type(exc).__name__
    lines = traceback.format_exception_only(type(exc), exc)
    last = (lines[-1] if lines else "").strip().splitlines()
    text = last[-1] if last else name
    qualified = f"{type(exc).__module__}.{type(exc).__qualname__}"
    if text.startswith(qualified):  # exceptions outside builtins print their module path
        text = name + text[len(qualified) :]
    return text if text.startswith(name) else f"{name}: {text}"


class Outcomes:
    """The non-stored endings of a message, each recorded, counted and logged in one call."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, ledger: Ledger, metrics: WorkerMetrics) -> None:
        self.settings = settings
        self.redis = redis
        self.ledger = ledger
        self.metrics = metrics

    async def dead(
        self,
        task: PromptTask,
        error_class: str,
        message: str,
        attempts: int = 0,
        answer: dict[str, Any] | None = None,
        level: int = logging.ERROR,
    ) -> str:
        """Dead-letter ``task`` (``producer retry`` resends it whole): the ``dead`` outcome."""
        if answer is None:
            await self.ledger.dead_letter(task, error_class, message, attempts)
        else:  # bad_output keeps what the server answered
            await self.ledger.dead_letter(task, error_class, message, attempts, answer=answer)
        self.metrics.dead.labels(error_class).inc()
        task_events.note_refusal(f"{error_class}: {message}")  # Flower's FAILURE row names it
        log.log(level, "dead-lettered %s/%s: %s: %s", task.job, task.prompt_id, error_class, message)
        return "dead"

    async def poison(self, task: PromptTask, error: str, record: dict[str, Any]) -> str:
        """A prompt whose deliveries crashed or died with their worker too often: ``poison:<Class>``."""
        error_class = f"poison:{error.split(':', 1)[0].strip() or 'WorkerLost'}"
        x, k = int(record.get("x", 0)), int(record.get("k", 0))
        message = f"{x} deliveries raised, {k} died with their worker; last: {error}"
        return await self.dead(task, error_class, message, x + k)

    async def malformed(self, message_id: str | None, error: str, args: Any) -> None:
        """Record a message in the fleet-wide malformed list (its reason and body kept, bounded), or hand it back
        when Redis cannot take the record (it is never acked unrecorded)."""
        record: dict[str, Any] = {"message_id": message_id, "error": error, "at": time.time()}
        try:
            record["args"] = repr(args)[:4000]
        except Exception:
            record["args"] = "<unrepresentable>"
        try:
            await asyncio.wait_for(self.push_malformed(json.dumps(record)), 60)
        except Exception as err:
            log.error("could not record message %s in the malformed list, handing it back: %s", message_id, err)
            raise HandBack() from err

    async def push_malformed(self, record: str) -> None:
        key = self.settings.keys.malformed
        async with self.redis.pipeline(transaction=True) as p:
            p.lpush(key, record)
            p.ltrim(key, 0, 9999)
            await p.execute()
