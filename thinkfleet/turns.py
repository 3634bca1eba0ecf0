"""The turns of a ``--turns all`` job, as both sides see them: turn ids, a conversation's plan, a turn's history.

``producer submit`` plans each conversation (:func:`plan_conversation`) and enqueues its turn 0; a worker,
having stored turn i, builds turn i+1's history (:func:`turn_messages`) from the model's answers
(workers/turns.py); ``producer status``/``export`` read the same records. A turn's prompt id is
``{conversation}/t{i}`` (:func:`turn_id`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Iterable
from typing import Any

from thinkfleet.keys import Keys

#: ``{conversation}/t{i}``, and ``{conversation}/t{i}s{j}`` for step j > 0 of turn i of an agentic job
TURN_ID = re.compile(r"^(?P<conv>.+)/t(?P<turn>\d+)(?:s(?P<step>\d+))?$")


#: The job hash's field that says how a job regenerates turns: JSON {mode: "all" | "last", turns, …}.
TURNS_FIELD = "turns"


def turns_meta(raw: bytes | str | None) -> dict[str, Any]:
    """The job hash's ``turns`` field decoded; {} when absent or unreadable (a single-turn job)."""
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def regenerates_all_turns(meta: dict[str, Any]) -> bool:
    """A ``--turns all`` job (:func:`turns_meta` of its record)."""
    return meta.get("mode") == "all"


def conversations_key(keys: Keys, job: str) -> str:
    """HASH conversation id → JSON of the conversation (:meth:`thinkfleet.keys.Keys.conversations`)."""
    return keys.conversations(job)


def answers_key(keys: Keys, job: str) -> str:
    """HASH turn prompt id → JSON of the model's answer (:meth:`thinkfleet.keys.Keys.turn_answers`)."""
    return keys.turn_answers(job)


def turn_id(conversation: str, turn: int) -> str:
    return f"{conversation}/t{turn}"


def split_turn_id(prompt_id: str) -> tuple[str, int] | None:
    m = TURN_ID.match(prompt_id)
    return (m.group("conv"), int(m.group("turn"))) if m else None


def step_id(conversation: str, turn: int, step: int) -> str:
    """Step ``step`` of turn ``turn`` (an agentic job's call → result → … chain); step 0 is the turn's own id."""
    return turn_id(conversation, turn) if step == 0 else f"{conversation}/t{turn}s{step}"


def split_step_id(prompt_id: str) -> tuple[str, int, int] | None:
    """(conversation, turn, step) of a turn or step prompt id (step 0 for a plain turn id)."""
    m = TURN_ID.match(prompt_id)
    return (m.group("conv"), int(m.group("turn")), int(m.group("step") or 0)) if m else None


def of_conversations(prompt_ids: Iterable[str], conversations: Container[str], but: Container[str]) -> set[str]:
    """The turn and step prompt ids among ``prompt_ids`` whose conversation is one of ``conversations``, except those
    in ``but`` (a re-submit's stored turns not finished; an agentic job's steps no current chain reaches)."""
    out = set()
    for pid in prompt_ids:
        parts = split_step_id(pid)
        if parts is not None and parts[0] in conversations and pid not in but:
            out.add(pid)
    return out


def plan_conversation(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The turns of one source conversation (cut after its last user turn): the messages up to the first
    tool call, the index of each user message, and whether a tool call cut it. None: no user message.
    (An agentic job's plan keeps the tool calls: ``thinkfleet.tool_steps.plan_agentic``.)"""
    cut_at_tool = False
    kept: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool" or (m.get("role") == "assistant" and m.get("tool_calls")):
            cut_at_tool = True
            break
        kept.append(m)
    users = [i for i, m in enumerate(kept) if m.get("role") == "user"]
    if not users:
        return None
    kept = kept[: users[-1] + 1]
    return {"messages": kept, "users": users, "turn_count": len(users), "cut_at_tool": cut_at_tool}


#: Fields of an answer record (``answers_key``) that are no part of the assistant message: ``chain_end`` (no
#: turn follows: ``tool_call`` or ``error: …``; the row's own ``chain_end`` column holds it too, and is the truth:
#: thinkfleet/chain_end.py) and ``revision`` (the revision of the row it was decoded from;
#: missing = 0; a re-derived next turn is enqueued one revision above its own recorded answer), and ``signature``
#: (the deriving worker's, with a signing key: thinkfleet/signing.py).
#: An agentic job's records add ``next`` (the prompt its finalize enqueued), ``tool_results`` (the ``tool`` messages
#: fed back after this step's calls), ``tool_mismatch``, ``args_differ`` and ``tool_error`` (thinkfleet/tool_steps.py).
ANSWER_META = (
    "chain_end", "revision", "signature", "next", "tool_results", "tool_mismatch", "args_differ", "tool_error",
)  # fmt: skip


def answer_message(record: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of an answer record (its :data:`ANSWER_META` fields dropped)."""
    return {k: v for k, v in record.items() if k not in ANSWER_META}


def answer_revision(record: dict[str, Any] | None) -> int:
    """The revision an answer record was decoded from (0 when it says none)."""
    return int((record or {}).get("revision") or 0)


def beyond_chain_ends(prompt_ids: Iterable[str], chain_ends: Iterable[str]) -> set[str]:
    """The turn prompt ids that follow their conversation's earliest chain end (``chain_ends``: turn prompt
    ids whose answer ends the chain). Such a turn's row is *superseded*: a re-run of an earlier turn ended
    the chain before it, so it was derived from an answer that is no longer the conversation's."""
    # Places are (turn, step): an agentic job's steps …/t{i}s{j} order within their turn (plain turns are step 0).
    end: dict[str, tuple[int, int]] = {}
    for pid in chain_ends:
        parts = split_step_id(pid)
        if parts is not None:
            end[parts[0]] = min(end.get(parts[0], parts[1:]), parts[1:])
    out = set()
    for pid in prompt_ids:
        parts = split_step_id(pid)
        if parts is not None and parts[0] in end and parts[1:] > end[parts[0]]:
            out.add(pid)
    return out


def turn_messages(conversation: dict[str, Any], answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn ``len(answers)``'s prompt messages: the source history with the dataset's assistant messages of
    turns 0..len(answers)-1 replaced by the model's ``answers``."""
    msgs, users = conversation["messages"], conversation["users"]
    out = list(msgs[: users[0] + 1])
    for k, answer in enumerate(answers):
        out.append(answer)
        out.extend(m for m in msgs[users[k] + 1 : users[k + 1] + 1] if m.get("role") != "assistant")
    return out
