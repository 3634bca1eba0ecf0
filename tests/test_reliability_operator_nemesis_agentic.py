"""The operator nemesis (tests/test_reliability_operator_nemesis.py) on an agentic job run step by step
with the example executor (``--tool-results executor``): the CI seed's schedule, in a file of
its own so that the suite's processes share the nemesis runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_reliability_operator_nemesis import CI_SEED, OPERATIONS, run_operators, tok_dir

__all__ = ["tok_dir"]  # the module's tokenizer fixture, shared


@pytest.mark.xfail(
    strict=False,
    reason="KNOWN DEFECT, open (found 2026-12-07, about 1 run in 5): under this schedule (a Redis rollback and a "
    "purge + re-submit among its commands), producer status counts 1-2 more steps done than the committed view "
    "holds (they are superseded there); nothing lost, duplicated or altered, verify OK. Kept running here so a "
    "fix shows as XPASS; remove this mark with the fix.",
)
def test_operator_nemesis_agentic_executor_short_fixed_seed(tmp_path: Path, tok_dir: Path) -> None:
    # The operator's commands typed in the test's process, as the other two runs do: they come within a few seconds
    # of each other. That once stranded a chain in 2 of 5 runs (a tool-calling step finalized again from storage
    # after the rollback had its executor record refused as fenced: tests/test_reliability_rollback_steps.py).
    run_operators(tmp_path, tok_dir, CI_SEED, units=8, operations=len(OPERATIONS), turns=2, agentic=True)
