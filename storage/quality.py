"""Quality flags of a row — what a trainer wants to drop before training — decided from token ids and spans only.

Each flag is a pure function of a row's ``output_ids``, its spans (storage/spans.py) and whether its prompt opened
reasoning, computed once where the row is made (:func:`storage.schema.rows_to_table`) and stored as a column, so
every reader (``verify``, ``report``, the exports' ``--drop-flag``) counts the same rows. Text is never decoded:

- ``truncated``: the output did not end on a stop (``finish_reason`` length or abort). Not a column of its own:
  ``finish_reason`` already says it (:func:`storage.flags.table_flags` derives it).
- ``loop`` (``loop_period``): the output ends in a repeated cycle of ids. With ``body`` the output minus a trailing
  stop token, ``n`` its length and a period ``p`` in 1..:data:`LOOP_MAX_PERIOD`, the row loops with period ``p`` when
  its last ``L`` ids repeat with period ``p`` (``body[i] == body[i - p]`` over the last ``L - p`` ids) where ``L`` is
  the larger of :data:`LOOP_MIN_REPEATS` × ``p``, :data:`LOOP_MIN_IDS` and min(:data:`LOOP_FULL_IDS`,
  ⌈:data:`LOOP_MIN_SHARE` × ``n``⌉) — at least 4 whole cycles, at least 32 ids, and either a quarter of the output
  or 256 ids, whichever is fewer. ``loop_period`` is the smallest such ``p`` (null: no loop). A loop that the model
  escaped with a stop token counts too (the stop is not part of the body); one it escaped with other text does not.
- ``no_think_end``: a row that reasons — its prompt opened reasoning, or the model opened it itself (a ``<think>`` in
  its output; harmony: an ``analysis`` message) — whose reasoning was never closed by ``</think>`` (harmony:
  ``<|end|>``). Truncated inside its reasoning, or gone straight to a tool section, both count.
- ``empty_answer``: the reasoning (if any) was closed and nothing followed: no answer ids and no tool call.
- ``tool_call_unparsed``: a tool-call section that does not parse as ids: a call without its end marker
  (``<|tool_call_end|>``; harmony: ``<|call|>``), or a section begin (``<|tool_calls_section_begin|>``) with no call
  in it or without its section end.

``no_think_end`` and ``empty_answer`` are null where the row's reasoning spans are (a job run with
``--no-reasoning-spans``: its markers cannot tell).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.spans import Spans
from thinkfleet.tokens import SpanTokens

#: The longest repeated cycle looked for, in ids (issue 46: 1–64).
LOOP_MAX_PERIOD = 64
#: Whole cycles a loop must show: ``ab ab`` is a phrase, four of them in a row at the very end are a loop.
LOOP_MIN_REPEATS = 4
#: Fewest ids a loop covers: a short tail of repeated newlines is formatting, not degenerate output.
LOOP_MIN_IDS = 32
#: A repeated tail this long is a loop whatever the output's length …
LOOP_FULL_IDS = 256
#: … and so is one covering this share of a shorter output.
LOOP_MIN_SHARE = 0.25


def loop_period(body: np.ndarray) -> int:
    """The smallest period of the repeated cycle ``body`` (an output without its stop token) ends in, 0 for none."""
    n = len(body)
    floor = max(LOOP_MIN_IDS, min(LOOP_FULL_IDS, math.ceil(n * LOOP_MIN_SHARE)))
    for p in range(1, LOOP_MAX_PERIOD + 1):
        need = max(floor, LOOP_MIN_REPEATS * p)
        if need > n:
            break  # longer periods need even more ids
        tail = body[n - need :]
        if np.array_equal(tail[p:], tail[:-p]):
            return p
    return 0


@dataclass(frozen=True)
class FlagArrays:
    """The flags of a batch of rows, one entry per row (see the module docstring)."""

    loop_period: np.ndarray  # int32, 0 = no loop
    no_think_end: np.ndarray  # bool
    empty_answer: np.ndarray  # bool
    tool_call_unparsed: np.ndarray  # bool


def compute_flags(
    values: np.ndarray,
    offsets: np.ndarray,
    *,
    opens: np.ndarray,
    reasoning_start: np.ndarray,
    reasoning_end: np.ndarray,
    has_think_end: np.ndarray,
    answer_start: np.ndarray,
    answer_end: np.ndarray,
    tool_call_offsets: np.ndarray,
    tool_call_ends: np.ndarray,
    has_stop: np.ndarray,
    tokens: SpanTokens,
) -> FlagArrays:
    """Flags of many outputs stored flat (row ``i`` = ``values[offsets[i]:offsets[i + 1]]``) with their spans.

    ``opens``: the row's prompt opened reasoning (:func:`storage.spans.prompts_open_reasoning`); ``has_stop``: its
    last id is a stop token; ``tool_call_ends`` are row-local, listed per row by ``tool_call_offsets``."""
    offsets = np.asarray(offsets, dtype=np.int64)
    n_rows = len(offsets) - 1
    body_end = np.diff(offsets) - np.asarray(has_stop, dtype=np.int64)
    row_start = offsets[:-1]

    periods = np.zeros(n_rows, dtype=np.int32)
    for i in range(n_rows):
        periods[i] = loop_period(values[row_start[i] : row_start[i] + body_end[i]])

    # Which rows reason: the prompt opened it, the model opened it (a <think> in its output), or (harmony, no
    # think-start id) an analysis message was found.
    emitted = _rows_containing(values, offsets, body_end, tokens.think_start_id)
    if tokens.scheme == "harmony":
        emitted |= (reasoning_end > reasoning_start) | has_think_end
    reasons = np.asarray(opens, dtype=bool) | emitted
    no_think_end = reasons & ~has_think_end

    calls = np.diff(np.asarray(tool_call_offsets, dtype=np.int64))
    empty_answer = (answer_end <= answer_start) & (calls == 0) & ~no_think_end

    # A call is whole when its last id is the call's end marker.
    owner = np.repeat(np.arange(n_rows), calls)
    ends = np.asarray(tool_call_ends, dtype=np.int64)
    last_of_call = _ids_at(values, row_start[owner] + ends - 1)
    cut = last_of_call != (tokens.tool_call_end_id if tokens.tool_call_end_id is not None else -2)
    unparsed = np.bincount(owner[cut], minlength=n_rows) > 0
    if tokens.scheme != "harmony" and tokens.tool_section_begin_id is not None:
        begins = _rows_containing(values, offsets, body_end, tokens.tool_section_begin_id)
        closed = _rows_containing(values, offsets, body_end, tokens.tool_section_end_id)
        unparsed |= begins & ((calls == 0) | ~closed)
    return FlagArrays(periods, no_think_end, empty_answer, unparsed)


def _rows_containing(values: np.ndarray, offsets: np.ndarray, body_end: np.ndarray, token: int | None) -> np.ndarray:
    """Per row: ``token`` occurs in its body (its ids before ``body_end``)."""
    n_rows = len(offsets) - 1
    if token is None or not len(values):
        return np.zeros(n_rows, dtype=bool)
    at = np.flatnonzero(values == token)
    rows = np.searchsorted(offsets, at, side="right") - 1
    inside = at - offsets[rows] < body_end[rows]
    return np.bincount(rows[inside], minlength=n_rows) > 0


def _ids_at(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    out = np.full(len(positions), -1, dtype=np.int64)
    ok = (positions >= 0) & (positions < len(values))
    out[ok] = values[positions[ok]]
    return out


def row_flags(output_ids: list[int] | np.ndarray, spans: Spans, opens: bool, tokens: SpanTokens) -> dict[str, Any]:
    """One row's flag columns (``loop``, ``loop_period``, ``no_think_end``, ``empty_answer``, ``tool_call_unparsed``)
    from its ids and spans, as :func:`storage.schema.rows_to_table` stores them: what a worker puts in its row dict."""
    values = np.asarray(output_ids, dtype=np.int64)
    calls = spans.tool_call_spans
    flags = compute_flags(
        values,
        np.array([0, len(values)], dtype=np.int64),
        opens=np.array([opens]),
        reasoning_start=np.array([spans.reasoning_start]),
        reasoning_end=np.array([spans.reasoning_end]),
        has_think_end=np.array([spans.has_think_end]),
        answer_start=np.array([spans.answer_start]),
        answer_end=np.array([spans.answer_end]),
        tool_call_offsets=np.array([0, len(calls)]),
        tool_call_ends=np.array([end for _, end in calls], dtype=np.int64),
        has_stop=np.array([spans.stop_token is not None]),
        tokens=tokens,
    )
    period = int(flags.loop_period[0])
    recorded = tokens.reasoning_spans
    return {
        "loop": period > 0,
        "loop_period": period or None,
        "no_think_end": bool(flags.no_think_end[0]) if recorded else None,
        "empty_answer": bool(flags.empty_answer[0]) if recorded else None,
        "tool_call_unparsed": bool(flags.tool_call_unparsed[0]),
    }


def raised(columns: Mapping[str, Any], truncated: bool) -> tuple[str, ...]:
    """The names of the flags a row carries (``truncated`` first), from its flag columns (null ones: not raised)."""
    names = ("loop", "no_think_end", "empty_answer", "tool_call_unparsed")
    return (("truncated",) if truncated else ()) + tuple(name for name in names if columns.get(name))
