"""The operator nemesis (tests/test_reliability_operator_nemesis.py) on an agentic job run step by step
with the example executor (``--tool-results executor``): the CI seed's schedule, in a file of
its own so that the suite's processes share the nemesis runs."""

from __future__ import annotations

from pathlib import Path

from tests.test_reliability_operator_nemesis import CI_SEED, OPERATIONS, run_operators, tok_dir

__all__ = ["tok_dir"]  # the module's tokenizer fixture, shared


def test_operator_nemesis_agentic_executor_short_fixed_seed(tmp_path: Path, tok_dir: Path) -> None:
    # The operator's commands as CLI processes, a second or more each (the other two runs type them in the test's
    # process). Typed in this process, pause, purge + re-submit, compact and the rollback came within about four
    # seconds, and a chain was stranded in 2 of 5 runs: a tool-calling step stored just before Redis was rolled back
    # was finalized again from storage ("fenced: … the executor is not called") and its next step was never enqueued
    # (wait exit 3, e.g. alpha/c6/t1s1). That is the workers' finding to fix, not this test's to hide with another
    # schedule; until then this run keeps the spacing it has passed with.
    run_operators(
        tmp_path, tok_dir, CI_SEED, units=8, operations=len(OPERATIONS), turns=2, agentic=True, processes=True
    )
