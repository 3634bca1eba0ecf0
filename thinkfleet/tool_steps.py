"""Agentic conversations: a turn regenerated through its tool calls, step by step (``tool_results`` set).

A ``--turns all`` job with ``tool_results: replay`` keeps each dataset conversation whole (no ``cut_at_tool``).
Turn i of the conversation is now a chain of *steps*: step 0 is the turn's own prompt (``{conv}/t{i}``); when the
model's answer of step j calls tools, the results are fed back and step j+1 (``{conv}/t{i}s{j+1}``) is the same
turn continued — call → result → call → result → answer — up to the job's ``max_tool_steps``. A step whose answer
calls no tool ends the turn, and the next user turn follows as before.

Where the results come from (``replay``): the dataset's recorded ``tool`` messages of the same step — the ones that
follow the dataset's j-th tool-calling assistant message of that turn (:func:`recorded_steps`) — matched to the
model's calls by position and function name (:func:`replay_results`). The arguments may differ (the model computed
its own): the step's answer record says so (``args_differ``) and so does its row (``tool_args_differ``).
A mismatch (another function, another number of calls, a call where the dataset has none, none where it has
one) ends the chain (``chain_end: tool_mismatch``, the default) or, with ``tool_mismatch: keep_recorded``, feeds
the recorded results anyway, paired by position — as far as there are results to feed: a call with no recorded
result at all still ends the chain, and an answer without a call where the dataset called one ends its turn
there (nothing to attach the results to).

The answer record of a step holds the messages fed back (``tool_results``, each marked ``"source": "recorded"``)
and the prompt its finalize enqueued (``next``), so the history of any step is a walk from ``{conv}/t0`` along
``next`` (:func:`step_messages` builds the messages from it): everything from stored data, as the chaining of
plain turns (workers/turns.py) needs for its exactly-once recovery.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from thinkfleet.turns import answer_message

#: ``tool_results`` values: replay the dataset's results (or, later, call the job's executor).
TOOL_RESULT_MODES = ("replay", "executor")
#: ``tool_mismatch`` values.
MISMATCH_POLICIES = ("chain_end", "keep_recorded")
#: Steps one turn may take (tool-calling answers fed back) unless the job says otherwise.
DEFAULT_MAX_TOOL_STEPS = 8

#: ``chain_end`` values of an agentic job's answer records (besides ``tool_call`` and ``error: …``).
END_MISMATCH, END_MAX_STEPS, END_CUT, END_TOOL_ERROR = "tool_mismatch", "max_tool_steps", "tool_call_cut", "tool_error"


def agentic(meta: dict[str, Any]) -> bool:
    """The job's ``turns`` record says tool results are fed back (an agentic ``--turns all`` job)."""
    return meta.get("tool_results") in TOOL_RESULT_MODES


def plan_agentic(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An agentic conversation's plan: the messages up to the last recorded tool result of its last turn (its
    final answer dropped: it is regenerated), the user message indices, and per turn its recorded ``steps``."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    end = users[-1] + 1
    for i in range(users[-1] + 1, len(messages)):
        if messages[i].get("role") == "tool":
            end = i + 1
    kept = list(messages[:end])
    return {
        "messages": kept,
        "users": users,
        "turn_count": len(users),
        "cut_at_tool": False,
        "steps": recorded_steps(messages, users),
    }


def recorded_steps(messages: Sequence[dict[str, Any]], users: Sequence[int]) -> list[list[dict[str, Any]]]:
    """Per turn, the dataset's tool steps: ``{"calls": [tool_calls entries], "results": [tool messages]}`` for
    each tool-calling assistant message between the turn's user message and the next one, in order."""
    out: list[list[dict[str, Any]]] = []
    for k, start in enumerate(users):
        stop = users[k + 1] if k + 1 < len(users) else len(messages)
        steps: list[dict[str, Any]] = []
        for m in messages[start + 1 : stop]:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                steps.append({"calls": list(m["tool_calls"]), "results": []})
            elif m.get("role") == "tool" and steps:
                steps[-1]["results"].append(m)
        out.append(steps)
    return out


@dataclass(frozen=True)
class Replay:
    """What replaying one step's results decided."""

    results: list[dict[str, Any]] | None  # the tool messages to feed back; None: no step follows in this turn
    mismatch: str = ""  # what differs from the dataset ("" = nothing)
    args_differ: bool | None = None  # None: no call was matched
    ends_chain: bool = False  # the chain ends here (chain_end: tool_mismatch)


def _name(call: dict[str, Any]) -> str:
    return str((call.get("function") or {}).get("name") or call.get("name") or "")


def _args(call: dict[str, Any]) -> Any:
    raw = (call.get("function") or {}).get("arguments", call.get("arguments"))
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def replay_results(
    conversation: dict[str, Any], turn: int, step: int, calls: Sequence[dict[str, Any]], policy: str = "chain_end"
) -> Replay:
    """Step ``step`` of turn ``turn``: the dataset's recorded results for the model's ``calls`` (see the module
    docstring for the mismatch rules)."""
    steps = conversation.get("steps") or []
    recorded = steps[turn][step] if turn < len(steps) and step < len(steps[turn]) else None
    keep = policy == "keep_recorded"
    if not calls:
        if recorded is None:
            return Replay(None)
        mismatch = f"no call where the dataset calls {[_name(c) for c in recorded['calls']]}"
        return Replay(None, mismatch, ends_chain=not keep)
    names = [_name(c) for c in calls]
    if recorded is None:
        return Replay(None, f"calls {names} where the dataset has none", ends_chain=True)
    want = [_name(c) for c in recorded["calls"]]
    results = recorded["results"]
    mismatch = ""
    if names != want:
        mismatch = f"calls {names} where the dataset calls {want}"
    elif len(results) != len(calls):
        mismatch = f"{len(calls)} calls, {len(results)} recorded results"
    if (mismatch and not keep) or len(results) < len(calls):
        return Replay(None, mismatch or f"no recorded result for call {len(results)}", ends_chain=True)
    paired = min(len(calls), len(recorded["calls"]))
    differ = any(_args(calls[i]) != _args(recorded["calls"][i]) for i in range(paired))
    # The dataset's tool message as recorded (its own keys: a template may render its name), answering the model's
    # call by the model's call id (the template pairs them).
    fed = [
        {**results[i], "tool_call_id": call.get("id") or f"call_{i}", "source": "recorded"}
        for i, call in enumerate(calls)
    ]
    return Replay(fed, mismatch, differ)


def step_messages(conversation: dict[str, Any], history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt messages of the step that follows ``history`` (the answer records of every earlier step of the
    conversation, in chain order): the dataset's user and system messages, the model's answers in place of the
    dataset's assistant messages, each tool-calling answer followed by the results fed back after it."""
    msgs, users = conversation["messages"], conversation["users"]
    out = list(msgs[: users[0] + 1])
    turn = 0
    for record in history:
        out.append(answer_message(record))
        fed = record.get("tool_results")
        if fed:
            out.extend(fed)
            continue
        # The turn ended with this answer: the dataset's next messages (not its assistant or tool ones) follow.
        stop = users[turn + 1] + 1 if turn + 1 < len(users) else len(msgs)
        out.extend(m for m in msgs[users[turn] + 1 : stop] if m.get("role") not in ("assistant", "tool"))
        turn += 1
    return out


def for_render(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template renders them (the export-only ``source`` mark dropped)."""
    return [{k: v for k, v in m.items() if k != "source"} if m.get("role") == "tool" else dict(m) for m in messages]
