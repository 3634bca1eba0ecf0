"""The operator nemesis (tests/test_reliability_operator_nemesis.py) on ``--turns all`` conversations,
every request its own answer: the CI seed's schedule, in a file of
its own so that the suite's processes share the nemesis runs."""

from __future__ import annotations

from pathlib import Path

from tests.test_reliability_operator_nemesis import CI_SEED, OPERATIONS, run_operators, tok_dir

__all__ = ["tok_dir"]  # the module's tokenizer fixture, shared


def test_operator_nemesis_turns_all_short_fixed_seed(tmp_path: Path, tok_dir: Path) -> None:
    run_operators(tmp_path, tok_dir, CI_SEED, units=12, operations=len(OPERATIONS), turns=3)
