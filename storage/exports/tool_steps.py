"""The text formats' view of an agentic job (``tool_results`` set): each step's record with the tool messages fed back.

A step's prompt was rendered (workers/tool_steps.py) from the conversation record and the answer records of every
earlier step, in chain order (the walk from ``t0`` along ``next``), each tool-calling answer followed by the
``tool`` messages fed back after it (``tool_results``, marked ``"source": "recorded"`` — or ``"executed"``). The
``messages``/``conversations`` record of a step is that history, then the step's own answer
(:func:`thinkfleet.tool_steps.step_messages`): exactly the messages its prompt was rendered from. Like the
conversation records, the answer records come from Redis: export while the job's Redis state is there.

A step no current chain reaches is *stale* (:func:`stale_steps`, storage/verify_steps.py: an earlier step was re-run
and went on elsewhere): every format leaves its row out, counted as ``superseded``, as ``producer verify`` lists it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

from thinkfleet.redis_client import sync_client
from thinkfleet.tool_steps import step_messages
from thinkfleet.turns import split_step_id, turn_id

#: Steps a history walk follows at most (a record cycle would otherwise never end).
MAX_WALK = 10_000


class Conversations(Protocol):
    settings: Any
    job: str

    def get(self, conv: str | None) -> dict[str, Any] | None: ...


def stale_steps(settings: Any, job: str, prompt_ids: Iterable[str]) -> set[str]:
    """The ``prompt_ids`` of an agentic job's conversations that the walk from ``t0`` along ``next`` does not reach
    (an empty set for another job, or without its Redis state)."""
    from storage.verify_steps import unreachable_steps

    ids = list(prompt_ids)
    # No turn rows (a single-turn job): nothing to ask Redis, which a token export otherwise never needs.
    return unreachable_steps(settings, job, ids) if ids else set()


def is_step(prompt_id: str) -> bool:
    """A step after the first of an agentic turn (``…/t{i}s{j}``, j > 0): not in the submit manifest."""
    parts = split_step_id(prompt_id)
    return parts is not None and parts[2] > 0


def agentic_histories(
    rows: list[dict[str, Any]], convs: Conversations, exclude_reasoning: bool
) -> tuple[dict[str, tuple[list[dict[str, Any]], Any]], list[dict[str, Any]]]:
    """(prompt id → (source messages, tools) for every step after a conversation's first of an agentic job's
    ``rows``, the other rows). A step whose walk finds an earlier record missing gets no history (skipped)."""
    out: dict[str, tuple[list[dict[str, Any]], Any]] = {}
    rest: list[dict[str, Any]] = []
    answers: _Answers | None = None
    for row in rows:
        conv_id = row.get("conversation_id")
        conv = convs.get(conv_id) if conv_id is not None else None
        if conv is None or "steps" not in conv:
            rest.append(row)
            continue
        pid = row["prompt_id"]
        if pid == turn_id(conv_id, 0):
            rest.append(row)  # the first prompt: the manifest's source conversation
            continue
        answers = answers or _Answers(convs)
        history = answers.walk(conv_id, pid)
        if history is None:
            continue
        if exclude_reasoning:
            history = [{k: v for k, v in r.items() if k != "reasoning_content"} for r in history]
        out[pid] = (step_messages(conv, history), conv.get("tools"))
    return out, rest


class _Answers:
    """The job's answer records (``Keys.turn_answers``), read once from Redis."""

    def __init__(self, convs: Conversations) -> None:
        import redis

        key = convs.settings.keys.turn_answers(convs.job)
        self.records: dict[str, dict[str, Any]] = {}
        try:
            client = sync_client(convs.settings.redis_url, timeout_s=10)
            with client:
                self.records = {k.decode(): json.loads(v) for k, v in client.hscan_iter(key, count=1000)}
        except (redis.RedisError, OSError):
            self.records = {}

    def walk(self, conv_id: str, pid: str) -> list[dict[str, Any]] | None:
        out: list[dict[str, Any]] = []
        at = turn_id(conv_id, 0)
        while at != pid:
            record = self.records.get(at)
            if record is None or len(out) >= MAX_WALK:
                return None
            out.append(record)
            at = str(record.get("next") or "")
            if not at:
                return None
        return out
