"""``producer verify`` of an agentic job (``tool_results`` set): every step's prompt is the template's rendering.

A step's prompt (workers/tool_steps.py) is the chat template's rendering of the conversation record with the answer
records of every earlier step in chain order — the walk from ``t0`` along ``next`` — each tool-calling answer
followed by the ``tool`` messages fed back after it (:func:`thinkfleet.tool_steps.step_messages`). This re-renders
each stored step from those records with the job's tokenizer and lists the steps whose stored ``input_ids`` differ
(``step_prompt_mismatch``: a worker rendered from something else, or a record changed since).

It needs the job's Redis state (the conversation and answer records) and its tokenizer on this machine, loaded from
local files without running its own code; without them nothing is checked and a note says why.

A *stale* step is a row — or a prompt enqueued — of an agentic conversation that the walk from ``t0`` along the
answer records' ``next`` does not reach (:func:`unreachable_steps`): an earlier step was re-run since (``producer
retry --truncated``) and its new answer went on elsewhere — to the next turn instead of another step, or to an end —
so what the old answer derived is no conversation's history any more. Verify lists such steps as superseded (not
current, not an error) and the exports leave their rows out; a step past a chain end is one of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc

from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings
from thinkfleet.tool_steps import agentic, for_render, step_messages
from thinkfleet.turns import TURNS_FIELD, of_conversations, turn_id, turns_meta

#: Steps a history walk follows at most (a record cycle would otherwise never end).
MAX_WALK = 10_000


@dataclass
class StepCheck:
    """``producer verify``'s look at an agentic job's steps."""

    #: stored steps whose prompt is not the template's rendering of their history
    mismatches: list[str] = field(default_factory=list)
    #: steps (stored or enqueued) no current chain reaches: superseded (:func:`stale_steps`)
    stale: set[str] = field(default_factory=set)
    #: why the prompts were not re-rendered, when they were not
    note: str | None = None


def check_steps(settings: Settings, job: str, prompt_ids: Iterable[str] = ()) -> StepCheck:
    """The steps of ``job`` whose prompt is not the rendering of their history, and the ``prompt_ids`` that are
    stale; an empty check for a job that is not agentic. The records are read from Redis once for both."""
    import redis

    from thinkfleet.state.job import JobRecord

    try:
        client = sync_client(settings.redis_url, timeout_s=10)
        with client:
            if not agentic(turns_meta(client.hget(settings.keys.job(job), TURNS_FIELD))):
                return StepCheck()
            record = JobRecord.load(client, settings.keys, job)
            convs = _hash(client, settings.keys.conversations(job))
            answers = _hash(client, settings.keys.turn_answers(job))
    except (redis.RedisError, OSError) as exc:
        return StepCheck(note=f"step prompts not re-rendered: Redis unreachable ({type(exc).__name__})")
    check = StepCheck(stale=stale_steps(convs, answers, prompt_ids))
    if record is None:
        check.note = "step prompts not re-rendered: no job record"
    else:
        check.mismatches, check.note = _mismatches(settings, job, record, convs, answers)
    return check


def _mismatches(
    settings: Settings, job: str, record: Any, convs: dict[str, Any], answers: dict[str, dict[str, Any]]
) -> tuple[list[str], str | None]:
    from storage.reader import read_committed
    from thinkfleet.template import TokenizerError, load_tokenizer, render_ids

    try:
        tok = load_tokenizer(record.tokenizer, trust_remote_code=False)
    except TokenizerError as exc:
        return [], f"step prompts not re-rendered: the job's tokenizer does not load here ({str(exc).splitlines()[0]})"
    table = read_committed(settings.output_uri, job, columns=["prompt_id", "input_ids", "conversation_id"])
    table = table.filter(pc.is_valid(table["conversation_id"]))
    stored = dict(zip(table["prompt_id"].to_pylist(), table["input_ids"].to_pylist(), strict=True))
    kwargs = dict(record.chat_template_kwargs)
    bad: list[str] = []
    for conv_id, conv in convs.items():
        history: list[dict[str, Any]] = []
        for at in chains({conv_id: conv}, answers)[conv_id]:  # the current chain only: stale steps are superseded
            ids = stored.get(at)
            if ids is not None and ids != render_ids(
                tok, for_render(step_messages(conv, history)), conv.get("tools"), kwargs
            ):
                bad.append(at)
            answer = answers.get(at)
            if answer is None:
                break
            history.append(answer)
    return sorted(bad), None


def chains(convs: dict[str, Any], answers: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Per conversation, its current chain: the prompt ids the walk from ``t0`` along ``next`` reaches, in order
    (the last one may have no answer yet: enqueued or running)."""
    out: dict[str, list[str]] = {}
    for conv_id in convs:
        at, chain = turn_id(conv_id, 0), []
        while at and len(chain) < MAX_WALK and at not in chain:
            chain.append(at)
            at = str((answers.get(at) or {}).get("next") or "")
        out[conv_id] = chain
    return out


def stale_steps(convs: dict[str, Any], answers: dict[str, dict[str, Any]], prompt_ids: Iterable[str]) -> set[str]:
    """The ``prompt_ids`` of these conversations that no current chain reaches (see the module docstring)."""
    reached = {pid for chain in chains(convs, answers).values() for pid in chain}
    return of_conversations(prompt_ids, convs, reached)


def unreachable_steps(settings: Settings, job: str, prompt_ids: Iterable[str]) -> set[str]:
    """:func:`stale_steps` of an agentic job, its records read from Redis; empty for another job, or when Redis
    does not answer (the rows are then judged by their chain ends alone)."""
    import redis

    try:
        client = sync_client(settings.redis_url, timeout_s=10)
        with client:
            if not agentic(turns_meta(client.hget(settings.keys.job(job), TURNS_FIELD))):
                return set()
            convs = _hash(client, settings.keys.conversations(job))
            answers = _hash(client, settings.keys.turn_answers(job))
    except (redis.RedisError, OSError):
        return set()
    return stale_steps(convs, answers, prompt_ids)


def _hash(client: Any, key: str) -> dict[str, dict[str, Any]]:
    return {k.decode(): json.loads(v) for k, v in client.hscan_iter(key, count=1000)}
