"""``producer verify`` of an agentic job (``tool_results`` set): every step's prompt is the template's rendering.

A step's prompt (workers/tool_steps.py) is the chat template's rendering of the conversation record with the answer
records of every earlier step in chain order — the walk from ``t0`` along ``next`` — each tool-calling answer
followed by the ``tool`` messages fed back after it (:func:`thinkfleet.tool_steps.step_messages`). This re-renders
each stored step from those records with the job's tokenizer and lists the steps whose stored ``input_ids`` differ
(``step_prompt_mismatch``: a worker rendered from something else, or a record changed since).

It needs the job's Redis state (the conversation and answer records) and its tokenizer on this machine, loaded from
local files without running its own code; without them nothing is checked and a note says why.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.compute as pc

from thinkfleet.settings import Settings
from thinkfleet.tool_steps import agentic, for_render, step_messages
from thinkfleet.turns import TURNS_FIELD, turn_id, turns_meta

#: Steps a history walk follows at most (a record cycle would otherwise never end).
MAX_WALK = 10_000


def step_prompt_mismatches(settings: Settings, job: str) -> tuple[list[str], str | None]:
    """(the stored steps whose prompt is not the rendering of their history, a note when not checked); ([], None)
    for a job that is not agentic."""
    import redis

    from storage.reader import read_committed
    from thinkfleet.state.job import JobRecord
    from thinkfleet.template import TokenizerError, load_tokenizer, render_ids

    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
        with client:
            if not agentic(turns_meta(client.hget(settings.keys.job(job), TURNS_FIELD))):
                return [], None
            record = JobRecord.load(client, settings.keys, job)
            convs = _hash(client, settings.keys.conversations(job))
            answers = _hash(client, settings.keys.turn_answers(job))
    except (redis.RedisError, OSError) as exc:
        return [], f"step prompts not re-rendered: Redis unreachable ({type(exc).__name__})"
    if record is None:
        return [], "step prompts not re-rendered: no job record"
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
        at = turn_id(conv_id, 0)
        while at and len(history) < MAX_WALK:
            ids = stored.get(at)
            if ids is not None and ids != render_ids(
                tok, for_render(step_messages(conv, history)), conv.get("tools"), kwargs
            ):
                bad.append(at)
            answer = answers.get(at)
            if answer is None:
                break
            history.append(answer)
            at = str(answer.get("next") or "")
    return sorted(bad), None


def _hash(client: Any, key: str) -> dict[str, dict[str, Any]]:
    return {k.decode(): json.loads(v) for k, v in client.hscan_iter(key, count=1000)}
