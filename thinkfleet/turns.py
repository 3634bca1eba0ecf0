"""The turns of a ``--turns all`` job, as both sides see them: turn ids, a conversation's plan, a turn's history.

``producer submit`` plans each conversation (:func:`plan_conversation`) and enqueues its turn 0; a worker,
having stored turn i, builds turn i+1's history (:func:`turn_messages`) from the model's answers
(workers/turns.py); ``producer status``/``export`` read the same records. A turn's prompt id is
``{conversation}/t{i}`` (:func:`turn_id`).
"""

from __future__ import annotations

import re
from typing import Any

from thinkfleet.keys import Keys

#: ``{conversation}/t{i}``
TURN_ID = re.compile(r"^(?P<conv>.+)/t(?P<turn>\d+)$")


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


def plan_conversation(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The turns of one source conversation (cut after its last user turn): the messages up to the first
    tool call, the index of each user message, and whether a tool call cut it. None: no user message."""
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


def turn_messages(conversation: dict[str, Any], answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn ``len(answers)``'s prompt messages: the source history with the dataset's assistant messages of
    turns 0..len(answers)-1 replaced by the model's ``answers``."""
    msgs, users = conversation["messages"], conversation["users"]
    out = list(msgs[: users[0] + 1])
    for k, answer in enumerate(answers):
        out.append(answer)
        out.extend(m for m in msgs[users[k] + 1 : users[k + 1] + 1] if m.get("role") != "assistant")
    return out
