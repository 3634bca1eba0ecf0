"""Where the conversations of a ``--turns all`` job stand, from storage: the rule of :mod:`thinkfleet.chain_end`
applied to the committed rows — what ``producer verify`` checks and ``producer wait`` confirms before it says
"finished", so the two never disagree.

Each committed row of a conversation gives its link (its ``chain_end`` column; rows written before that column by
their Redis answer record, read only for them). A chain whose last stored row goes on to a successor that nobody
enqueued, stored or dead-lettered *stopped without a reason*: its successor is **owed**
(:func:`thinkfleet.chain_end.owed_successors`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage import layout, stream
from storage.schema import CHAIN_END, CONVERSATION_ID, PROMPT_ID, STEP_INDEX, TOOL_CALL_SPANS, TURN_COUNT, TURN_INDEX
from thinkfleet.chain_end import ChainLink, owed_successors, stored_link
from thinkfleet.settings import Settings

#: The columns a link is made of (besides the prompt id, and whether the row's output calls a tool).
CHAIN_COLUMNS = [CONVERSATION_ID, TURN_INDEX, TURN_COUNT, STEP_INDEX, CHAIN_END]
#: Answer records per HMGET (rows written before ``chain_end``).
_RECORD_CHUNK = 1000

#: Fetches the Redis answer records of these prompt ids (those it has).
RecordReader = Callable[[list[str]], dict[str, dict[str, Any]]]


def stored_links(
    winners: pa.Table, calls: Container[str], records: RecordReader | None = None
) -> tuple[set[str], dict[str, ChainLink]]:
    """(conversations, prompt id → link) of the committed rows of ``winners`` that belong to a conversation
    (:data:`CHAIN_COLUMNS` + prompt_id; a table without them: none). ``calls``: the prompt ids whose output calls a
    tool. ``records``: the answer records of rows without ``chain_end`` (written before it); None: none read."""
    if CONVERSATION_ID not in winners.column_names or winners[CONVERSATION_ID].null_count == winners.num_rows:
        return set(), {}
    table = winners.filter(pc.is_valid(winners[CONVERSATION_ID]))
    ends = (
        table[CHAIN_END].to_pylist() if CHAIN_END in table.column_names else [None] * table.num_rows
    )  # (a winners table planned before the column: every row judged by its record)
    steps = table[STEP_INDEX].to_pylist() if STEP_INDEX in table.column_names else [None] * table.num_rows
    pids, convs = table[PROMPT_ID].to_pylist(), table[CONVERSATION_ID].to_pylist()
    counts = table[TURN_COUNT].to_pylist()
    unrecorded = [pid for pid, end in zip(pids, ends, strict=True) if end is None]
    old = records(unrecorded) if records is not None and unrecorded else {}
    links = {}
    for pid, count, step, end in zip(pids, counts, steps, ends, strict=True):
        links[pid] = stored_link(pid, int(count or 0), step, pid in calls, end, old.get(pid))
    return set(convs), links


def calling_rows(table: pa.Table) -> set[str]:
    """The prompt ids of ``table`` (prompt_id, tool_call_spans) whose output calls a tool."""
    calls = pc.list_value_length(table[TOOL_CALL_SPANS]).to_numpy(zero_copy_only=False) > 0
    if not calls.any():
        return set()
    pids = table[PROMPT_ID].to_pylist()
    return {pids[i] for i in np.flatnonzero(calls).tolist()}


def redis_records(client: Any, key: str) -> RecordReader:
    """A :data:`RecordReader` over the answer-record hash ``key``."""

    def read(prompt_ids: list[str]) -> dict[str, dict[str, Any]]:
        out = {}
        for start in range(0, len(prompt_ids), _RECORD_CHUNK):
            chunk = prompt_ids[start : start + _RECORD_CHUNK]
            for pid, raw in zip(chunk, client.hmget(key, chunk), strict=True):
                if raw is None:
                    continue
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out[pid] = record
        return out

    return read


def owed_in_storage(settings: Settings, job: str, client: Any) -> dict[str, str]:
    """Conversation → the successor its stored chain stopped before, with nothing submitted, stored or
    dead-lettered for it (Redis ``client``: the job's prompts and dead letters). {} for a job without
    conversations, and when every chain is complete, ended with a reason, or has a prompt to run."""
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    keys = settings.keys
    # Keys only (pass 1 of the streaming read): a few columns a row, whatever the job's size.
    plan = stream.plan(loc, job, None, [*CHAIN_COLUMNS, TOOL_CALL_SPANS], memory_bytes=stream.memory_bytes_of(settings))
    winners = plan.winners
    if CONVERSATION_ID not in winners.column_names or winners[CONVERSATION_ID].null_count == winners.num_rows:
        return {}
    convs, links = stored_links(winners, calling_rows(winners), redis_records(client, keys.turn_answers(job)))
    return owed_successors(convs, links, _known(client, keys.prompts(job), keys.dead(job)))


def _known(client: Any, prompts: str, dead: str) -> Callable[[list[str]], Iterable[str]]:
    """The candidates Redis knows: submitted (the job's prompts hash: pending or done) or dead-lettered."""

    def present(prompt_ids: list[str]) -> list[str]:
        out = []
        for start in range(0, len(prompt_ids), _RECORD_CHUNK):
            chunk = prompt_ids[start : start + _RECORD_CHUNK]
            with client.pipeline(transaction=False) as p:
                p.hmget(prompts, chunk)
                p.hmget(dead, chunk)
                submitted, dead_letters = p.execute()
            out += [
                pid for pid, s, d in zip(chunk, submitted, dead_letters, strict=True) if s is not None or d is not None
            ]
        return out

    return present
