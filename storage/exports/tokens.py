"""Committed rows → token-level training records: ``input_ids`` = prompt + output, ``loss_mask`` over the output.

The records of ``eagle3`` and ``specforge`` (and the first columns of ``hf``), built with numpy from the stored
ids (no Python loop over ids); ``merged_table`` is ``--merge-turns``: one record per ``--turns all``
conversation.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from storage.checks import flat_ids
from storage.exports.base import COLUMNS, need_reasoning_spans
from storage.schema import (
    CONVERSATION_ID,
    DATASET,
    FINISH_REASON,
    HAS_THINK_END,
    INPUT_IDS,
    OUTPUT_IDS,
    PROMPT_ID,
    REASONING_END,
    STEP_INDEX,
    TOKEN_IDS,
    TURN_COUNT,
    TURN_INDEX,
)

LOSS_MASK = pa.list_(pa.field("element", pa.int8(), nullable=False))
EAGLE3_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),  # the prompt_id
        pa.field(DATASET, pa.string(), nullable=False),
        pa.field("input_ids", TOKEN_IDS, nullable=False),  # prompt ids + output ids
        pa.field("loss_mask", LOSS_MASK, nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),  # input_ids[:prompt_len] is the prompt
        pa.field(FINISH_REASON, pa.string(), nullable=False),  # to drop truncated rows if wanted
    ]
)
#: The stored columns ``merged_table`` reads: a turn's conversation and place in it.
MERGE_COLUMNS = [*COLUMNS, CONVERSATION_ID, TURN_INDEX, TURN_COUNT, STEP_INDEX]
#: --merge-turns: a run of an earlier turn's output ids found in the last prompt counts when it is at least this
#: long (a lone token — a space, a common word — matches user text by chance).
MERGE_MIN_RUN = 2


#: Ids whose places :func:`eagle3_table` computes at once: its index arithmetic holds ~50 bytes an id (int64
#: positions and their temporaries), so a batch is filled a slice of rows at a time (tens of MB, not GBs).
_FILL_IDS = 1 << 20


def eagle3_table(table: pa.Table, exclude_reasoning: bool = False) -> pa.Table:
    """Committed rows → EAGLE-3 records, vectorized (no Python loop over ids)."""
    in_v, in_o = flat_ids(table[INPUT_IDS])
    out_v, out_o = flat_ids(table[OUTPUT_IDS])
    n_rows = table.num_rows
    prompt_len, output_len = np.diff(in_o), np.diff(out_o)
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(prompt_len + output_len, out=offsets[1:])
    ids = np.empty(offsets[-1], dtype=np.int32)
    mask = np.zeros(offsets[-1], dtype=np.int8)
    block_end = None
    if exclude_reasoning:
        need_reasoning_spans(table, "--exclude-reasoning")
        # The reasoning block runs from the output's start through </think> when emitted.
        block_end = table[REASONING_END].to_numpy() + table[HAS_THINK_END].to_numpy()
    lo = 0
    while lo < n_rows:
        # rows [lo, hi): at least one, at most _FILL_IDS ids unless one row alone is longer
        hi = max(lo + 1, int(np.searchsorted(offsets, offsets[lo] + _FILL_IDS, side="right")) - 1)
        hi = min(hi, n_rows)
        _fill(ids, mask, (in_v, in_o), (out_v, out_o), offsets, lo, hi, block_end)
        lo = hi
    off32 = pa.array(offsets.astype(np.int32))
    return pa.Table.from_arrays(
        [
            table[PROMPT_ID].combine_chunks(),
            table[DATASET].combine_chunks().cast(pa.string()),
            pa.ListArray.from_arrays(off32, pa.array(ids), type=TOKEN_IDS),
            pa.ListArray.from_arrays(off32, pa.array(mask), type=LOSS_MASK),
            pa.array(prompt_len.astype(np.int32)),
            table[FINISH_REASON].combine_chunks(),
        ],
        schema=EAGLE3_SCHEMA,
    )


def _fill(
    ids: np.ndarray,
    mask: np.ndarray,
    prompt: tuple[np.ndarray, np.ndarray],
    output: tuple[np.ndarray, np.ndarray],
    offsets: np.ndarray,
    lo: int,
    hi: int,
    block_end: np.ndarray | None,
) -> None:
    """Rows ``[lo, hi)`` of :func:`eagle3_table`: their prompt ids then output ids at ``offsets``, the mask 1 over
    the output (0 over the reasoning block when ``block_end`` is given)."""
    (in_v, in_o), (out_v, out_o) = prompt, output
    n = hi - lo
    start = offsets[lo:hi]
    prompt_len, output_len = np.diff(in_o[lo : hi + 1]), np.diff(out_o[lo : hi + 1])
    row_in = np.repeat(np.arange(n), prompt_len)
    ids[start[row_in] + np.arange(in_o[hi] - in_o[lo]) - (in_o[lo:hi] - in_o[lo])[row_in]] = in_v[in_o[lo] : in_o[hi]]
    del row_in
    row_out = np.repeat(np.arange(n), output_len)
    pos_out = np.arange(out_o[hi] - out_o[lo]) - (out_o[lo:hi] - out_o[lo])[row_out]
    dest_out = start[row_out] + prompt_len[row_out] + pos_out
    ids[dest_out] = out_v[out_o[lo] : out_o[hi]]
    mask[dest_out] = 1
    if block_end is not None:
        mask[dest_out[pos_out < block_end[lo:hi][row_out]]] = 0


def merged_table(table: pa.Table, exclude_reasoning: bool = False, skipped: dict[str, int] | None = None) -> pa.Table:
    """``--merge-turns``: the rows of a ``--turns all`` job → ONE EAGLE-3 record per conversation (``id`` = the
    conversation id): its last stored turn's prompt + output, the loss over that output (as :func:`eagle3_table`)
    AND over every earlier model-generated answer inside that prompt. Each earlier turn k's answer is looked
    for in the part of the last prompt that follows turn k's own prompt (its prefix) up to where turn k+1's
    prompt ends; the runs of turn k's stored ``output_ids`` that appear there verbatim (at least
    :data:`MERGE_MIN_RUN` ids, in order) get loss 1. Where the template re-rendered the answer differently —
    Kimi drops the reasoning of earlier turns, a decode/re-encode may split words otherwise — only the ids that
    match verbatim are trained on. ``exclude_reasoning`` leaves reasoning ids (through ``</think>``) at 0. Rows
    of no conversation (a single-turn job) are exported as by :func:`eagle3_table`; ``skipped["merged_turns"]``
    counts the turn rows folded into another turn's record."""
    # A turn's place is (turn, step): an agentic job's steps (step_index) are its model-emitted pieces in order.
    convs: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    single: list[int] = []
    conv_col = table[CONVERSATION_ID].to_pylist() if CONVERSATION_ID in table.column_names else [None] * len(table)
    turn_col = table[TURN_INDEX].to_pylist() if TURN_INDEX in table.column_names else [None] * len(table)
    step_col = table[STEP_INDEX].to_pylist() if STEP_INDEX in table.column_names else [None] * len(table)
    for i, (conv, turn, step) in enumerate(zip(conv_col, turn_col, step_col, strict=True)):
        if conv is None or turn is None:
            single.append(i)
        else:
            convs.setdefault(conv, {})[(turn, step or 0)] = {"i": i}
    parts = [eagle3_table(table.take(pa.array(single, pa.int64())), exclude_reasoning)] if single else []
    if not convs:
        return pa.concat_tables(parts) if parts else eagle3_table(table.slice(0, 0), exclude_reasoning)
    needed = [INPUT_IDS, OUTPUT_IDS, REASONING_END, HAS_THINK_END]
    if exclude_reasoning:
        need_reasoning_spans(table, "--exclude-reasoning")
    ids, datasets, finish = [], [], []
    masks, prompt_lens, names = [], [], []
    for conv, turns in convs.items():
        for t in turns.values():
            t.update({c: table[c][t["i"]].as_py() for c in needed})
        last = max(turns)
        prompt, output = turns[last][INPUT_IDS], turns[last][OUTPUT_IDS]
        mask = np.zeros(len(prompt) + len(output), dtype=np.int8)
        mask[len(prompt) :] = 1
        if exclude_reasoning:
            mask[len(prompt) : len(prompt) + _reasoning_block(turns[last])] = 0
        cursor = 0
        for k in sorted(t for t in turns if t < last):
            out_k = turns[k][OUTPUT_IDS]
            start = max(cursor, _common_prefix(turns[k][INPUT_IDS], prompt))
            following = turns.get((k[0], k[1] + 1)) or turns.get((k[0] + 1, 0))  # the next step, else turn
            end = _common_prefix(following[INPUT_IDS], prompt) if following else len(prompt)
            end = max(end, start)
            region = prompt[start:end]
            floor = _reasoning_block(turns[k]) if exclude_reasoning else 0
            matcher = difflib.SequenceMatcher(None, out_k, region, autojunk=False)
            for a, b, size in matcher.get_matching_blocks():
                if size < MERGE_MIN_RUN:
                    continue
                lo = max(a, floor)  # ids of out_k[a:a+size] at region[b:b+size]
                if lo < a + size:
                    mask[start + b + (lo - a) : start + b + size] = 1
                cursor = max(cursor, start + b + size)
        ids.append(np.asarray(prompt + output, dtype=np.int32))
        masks.append(mask)
        prompt_lens.append(len(prompt))
        names.append(conv)
        datasets.append(str(table[DATASET][turns[last]["i"]].as_py()))
        finish.append(table[FINISH_REASON][turns[last]["i"]].as_py())
        if skipped is not None and len(turns) > 1:
            skipped["merged_turns"] = skipped.get("merged_turns", 0) + len(turns) - 1
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    merged = pa.Table.from_arrays(
        [
            pa.array(names, pa.string()),
            pa.array(datasets, pa.string()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(ids)), type=TOKEN_IDS),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(masks)), type=LOSS_MASK),
            pa.array(prompt_lens, pa.int32()),
            pa.array(finish, table.schema.field(FINISH_REASON).type),
        ],
        schema=EAGLE3_SCHEMA,
    )
    return pa.concat_tables([*parts, merged])


def _reasoning_block(row: dict[str, Any]) -> int:
    """Output ids of the reasoning block: through ``</think>`` when emitted."""
    return int(row[REASONING_END]) + int(bool(row[HAS_THINK_END]))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else n
