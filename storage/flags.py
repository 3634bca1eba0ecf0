"""The quality flags of stored rows, as every reader counts and filters them (``verify``, ``report``, ``status``,
the exports' ``--drop-flag``).

A row of schema 12 or later carries its flags (storage/quality.py decided them when the row was made); a row of an
older part reads them back null, and they are computed here from the same ids by the same rules — so a job whose
parts span versions is counted and filtered alike. ``truncated`` is no column: ``finish_reason`` says it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa

from storage.checks import flat_ids
from storage.quality import compute_flags
from storage.schema import (
    EMPTY_ANSWER,
    FINISH_REASON,
    INPUT_IDS,
    LOOP,
    NO_THINK_END,
    OUTPUT_IDS,
    TOOL_CALL_UNPARSED,
)
from storage.spans import compute_spans_batch, prompts_open_reasoning
from thinkfleet.tokens import SpanTokens

TRUNCATED = "truncated"
#: Every flag a row can carry, in the order reports list them.
FLAG_NAMES = (TRUNCATED, LOOP, NO_THINK_END, EMPTY_ANSWER, TOOL_CALL_UNPARSED)
#: The columns :func:`table_flags` reads (the ids only for rows of parts older than the flag columns).
FLAG_READ_COLUMNS = [FINISH_REASON, LOOP, NO_THINK_END, EMPTY_ANSWER, TOOL_CALL_UNPARSED, INPUT_IDS, OUTPUT_IDS]


def parse_flags(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"loop,empty_answer"`` → the flag names, checked: an unknown name is an error that lists the known ones."""
    if spec is None:
        return ()
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in FLAG_NAMES]
    if unknown:
        raise ValueError(f"unknown quality flag {', '.join(unknown)}: one of {', '.join(FLAG_NAMES)}")
    return tuple(dict.fromkeys(names))


def table_flags(table: pa.Table, tokens: SpanTokens) -> dict[str, np.ndarray]:
    """Per flag, a bool per row of ``table`` (a null flag — reasoning spans not recorded — reads False).

    ``table`` needs :data:`FLAG_READ_COLUMNS`; rows whose flags are stored never touch their ids."""
    n = table.num_rows
    finish = table[FINISH_REASON].to_numpy(zero_copy_only=False)
    out: dict[str, np.ndarray] = {TRUNCATED: finish != "stop"}
    stored = {name: table[name] if name in table.column_names else pa.nulls(n, pa.bool_()) for name in FLAG_NAMES[1:]}
    missing = ~stored[LOOP].is_valid().to_numpy(zero_copy_only=False)
    for name, column in stored.items():
        out[name] = column.fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    if missing.any():
        computed = _computed(table.filter(pa.array(missing)), tokens)
        for name, values in computed.items():
            out[name][missing] = values
    return out


def count_flags(flags: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Rows carrying each flag."""
    return {name: int(np.count_nonzero(flags[name])) for name in FLAG_NAMES}


def _computed(table: pa.Table, tokens: SpanTokens) -> dict[str, np.ndarray]:
    """The flags of rows written before they were stored, from their ids (the rules rows_to_table applies)."""
    values, offsets = flat_ids(table[OUTPUT_IDS])
    in_values, in_offsets = flat_ids(table[INPUT_IDS])
    opens = prompts_open_reasoning(in_values, in_offsets, tokens)
    s = compute_spans_batch(values, offsets, opens, tokens)
    flags = compute_flags(
        values,
        offsets,
        opens=opens,
        reasoning_start=s.reasoning_start,
        reasoning_end=s.reasoning_end,
        has_think_end=s.has_think_end,
        answer_start=s.answer_start,
        answer_end=s.answer_end,
        tool_call_offsets=s.tool_call_offsets,
        tool_call_ends=s.tool_call_ends,
        has_stop=s.stop_token >= 0,
        tokens=tokens,
    )
    recorded = tokens.reasoning_spans
    return {
        LOOP: flags.loop_period > 0,
        NO_THINK_END: flags.no_think_end & recorded,
        EMPTY_ANSWER: flags.empty_answer & recorded,
        TOOL_CALL_UNPARSED: flags.tool_call_unparsed,
    }
