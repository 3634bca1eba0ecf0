"""Token exports build a batch's records a slice of rows at a time (issue 24: the index arithmetic of a whole
batch held ~10x its ids); the records are the ones a whole-batch build gave."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.exports import tokens
from storage.schema import (
    DATASET,
    FINISH_REASON,
    HAS_THINK_END,
    INPUT_IDS,
    OUTPUT_IDS,
    PROMPT_ID,
    REASONING_END,
    TOKEN_IDS,
)


def _rows(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 1000, rng.integers(0, 9)).tolist() for _ in range(n)]
    outputs = [rng.integers(0, 1000, rng.integers(0, 12)).tolist() for _ in range(n)]
    ends = [int(rng.integers(0, len(o) + 1)) for o in outputs]
    return pa.table(
        {
            PROMPT_ID: [f"p{i}" for i in range(n)],
            DATASET: ["alpha"] * n,
            INPUT_IDS: pa.array(prompts, TOKEN_IDS),
            OUTPUT_IDS: pa.array(outputs, TOKEN_IDS),
            REASONING_END: pa.array(ends, pa.int32()),
            HAS_THINK_END: pa.array([e < len(o) for e, o in zip(ends, outputs, strict=True)], pa.bool_()),
            FINISH_REASON: ["stop"] * n,
        }
    )


def _expected(table: pa.Table, exclude_reasoning: bool) -> list[dict]:
    """The records row by row, as a reader of the format states them."""
    out = []
    for row in table.to_pylist():
        prompt, output = row[INPUT_IDS], row[OUTPUT_IDS]
        mask = [0] * len(prompt) + [1] * len(output)
        if exclude_reasoning:
            for k in range(min(len(output), row[REASONING_END] + row[HAS_THINK_END])):
                mask[len(prompt) + k] = 0
        out.append(
            {
                "id": row[PROMPT_ID],
                DATASET: row[DATASET],
                "input_ids": prompt + output,
                "loss_mask": mask,
                "prompt_len": len(prompt),
                FINISH_REASON: row[FINISH_REASON],
            }
        )
    return out


@pytest.mark.parametrize("fill_ids", [1, 7, 50, 1 << 20])
@pytest.mark.parametrize("exclude_reasoning", [False, True])
def test_records_are_the_same_whatever_the_slice(monkeypatch, fill_ids: int, exclude_reasoning: bool) -> None:
    table = _rows(60, seed=fill_ids)
    monkeypatch.setattr(tokens, "_FILL_IDS", fill_ids)
    # a batch cut out of a larger table (its ids share the parent's buffers) too
    for batch in (table, table.slice(13, 29)):
        got = tokens.eagle3_table(batch, exclude_reasoning)
        assert got.schema == tokens.EAGLE3_SCHEMA
        assert got.to_pylist() == _expected(batch, exclude_reasoning)
