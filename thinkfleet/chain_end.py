"""How a conversation's chain goes on or ends: one rule for the worker, ``verify``, ``status`` and ``wait``.

A ``--turns all`` conversation is a chain of prompts — turn 0, then each turn's steps (an agentic job's
``…/t{i}s{j}``), then the next turn — each derived by the finalize of the one before (workers/turns.py). Every
stored row of it ends in exactly one recorded way, in its ``chain_end`` column (storage/schema.py), decided by the
worker before the row is written:

- :data:`CONTINUES` (``""``): the chain goes on — the row's finalize enqueued its successor (:func:`successor`:
  the next step when an agentic answer calls tools, else the next turn);
- :data:`COMPLETE`: the conversation's last answer;
- a reason: the chain ends here — ``tool_call`` (a plain job's answer calls a tool), ``tool_mismatch``,
  ``max_tool_steps``, ``tool_call_cut``, ``tool_error`` (thinkfleet/tool_steps.py), ``render_error: …`` (the
  job's chat template refused the next turn's history: workers/turns.py ``RenderFailed``), ``error: …`` (the next
  turn could not be derived here: no record, a tokenizer mismatch).

So storage alone says where every chain stands, across a purge or the loss of Redis (whose answer records keep a
copy: their ``chain_end``, and an agentic record's ``next``). A chain is walked from its turn 0 along the stored
rows (:func:`walk`); it stands at one of: its end (complete, or a reason), a successor that is pending or
dead-lettered (a dead turn ends it too, in the dead letters), or a successor that is **owed**: nothing enqueued,
stored or dead-lettered it — the chain *stopped without a reason*. :func:`owed_successors` is the rule: ``producer
verify`` fails on an owed successor (MISSING TURNS), and ``producer status`` / ``wait`` never call such a job
finished.

Rows written before the column (null) are judged from Redis' answer record of the prompt (:func:`record_link`),
else from their calls as ``producer verify`` always did (:func:`stored_link`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from thinkfleet.turns import split_step_id, step_id, turn_id

#: ``chain_end`` of a row whose chain goes on.
CONTINUES = ""
#: ``chain_end`` of a conversation's last answer.
COMPLETE = "complete"
#: The kind of reason (``render_error: <why>``) of a chain whose next turn the job's template or the message encoding
#: refused: that conversation ends, never the worker's commit stream.
END_RENDER_ERROR = "render_error"
#: The reason of a row written before ``chain_end`` whose answer calls a tool and whose record is gone.
END_UNRECORDED_CALL = "tool_call"
#: Links a walk follows at most (a record cycle would otherwise never end).
MAX_WALK = 10_000


@dataclass(frozen=True, slots=True)  # (one per stored turn row when a job's chains are walked: kept small)
class ChainLink:
    """Does this stored row end its chain, and why: ``end`` is :data:`CONTINUES`, :data:`COMPLETE` or the reason;
    ``following`` is the successor a continuing row derived ("" when it ends)."""

    prompt_id: str
    end: str
    following: str = ""

    @property
    def ends(self) -> bool:
        return self.end != CONTINUES


def successor(prompt_id: str, turn_count: int, agentic: bool, calls: bool) -> str:
    """The prompt a continuing row's finalize derives: an agentic step whose answer calls tools goes on to the next
    step of its turn, any other answer to the next turn ("" after the last turn: the conversation is complete)."""
    parts = split_step_id(prompt_id)
    if parts is None:
        return ""
    conv, turn, step = parts
    if agentic and calls:
        return step_id(conv, turn, step + 1)
    return turn_id(conv, turn + 1) if turn + 1 < turn_count else ""


def end_of(following: str, reason: str | None) -> str:
    """The ``chain_end`` of a finalized row: :data:`CONTINUES` when it derived ``following``, else its ``reason``
    (the answer record's ``chain_end``), else :data:`COMPLETE`."""
    if following:
        return CONTINUES
    return reason or COMPLETE


def stored_link(
    prompt_id: str,
    turn_count: int,
    step_index: int | None,
    calls: bool,
    chain_end: str | None,
    record: Mapping[str, Any] | None = None,
) -> ChainLink:
    """The link of a stored row: its ``chain_end`` column; for a row written before it (null), its Redis answer
    ``record`` (:func:`record_link`), else its calls (one that calls a tool ended the chain, as verify judged
    before the column; an agentic step's calls cannot be told from its row alone)."""
    agentic = step_index is not None
    if chain_end is not None:
        following = successor(prompt_id, turn_count, agentic, calls) if chain_end == CONTINUES else ""
        return ChainLink(prompt_id, chain_end, following)
    if record is not None:
        return record_link(prompt_id, turn_count, record, agentic)
    if calls:
        return ChainLink(prompt_id, END_UNRECORDED_CALL)
    following = successor(prompt_id, turn_count, agentic, False)
    return ChainLink(prompt_id, end_of(following, None), following)


def record_link(prompt_id: str, turn_count: int, record: Mapping[str, Any], agentic: bool) -> ChainLink:
    """The link of a Redis answer record (what the row's finalize recorded): its ``chain_end``, else its
    successor (``next``)."""
    reason = record.get("chain_end")
    if reason:
        return ChainLink(prompt_id, str(reason))
    # An agentic record names what it enqueued; a plain turn goes on to the next turn unless it was the last.
    following = str(record.get("next") or "") if agentic else successor(prompt_id, turn_count, False, False)
    return ChainLink(prompt_id, end_of(following, None), following)


def walk(conversation: str, links: Mapping[str, ChainLink]) -> tuple[list[str], str]:
    """The conversation's current chain: the prompt ids from its turn 0 along each link's successor, as long as
    they have links; and where it stands after them — the successor of its last link when that one goes on ("" when
    the chain ended, or no turn 0 is known)."""
    at, chain = turn_id(conversation, 0), []
    while at in links and len(chain) < MAX_WALK and at not in chain:
        chain.append(at)
        link = links[at]
        if link.ends:
            return chain, ""
        at = link.following
    return chain, at if chain else ""


def owed_successors(
    conversations: Iterable[str], links: Mapping[str, ChainLink], present: Container[str] | Callable[[list[str]], Any]
) -> dict[str, str]:
    """Conversation → the successor its chain stopped before: the chain's last link goes on, and its successor is
    not ``present`` (submitted — pending or done —, stored or dead-lettered: the caller's sets). ``present`` may be
    a function that takes the candidate ids and returns those present (a few Redis look-ups instead of a set of
    every prompt). Empty: every chain is complete, ended with a reason, or still has a prompt to run."""
    waiting = {}
    for conv in conversations:
        _, next_id = walk(conv, links)
        if next_id:
            waiting[conv] = next_id
    if not waiting:
        return {}
    if callable(present):
        found = set(present(sorted(waiting.values())))
    else:
        found = {p for p in waiting.values() if p in present}
    return {conv: pid for conv, pid in waiting.items() if pid not in found}
