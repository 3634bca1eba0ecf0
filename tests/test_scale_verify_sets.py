"""verify's prompt sets are Arrow arrays (issue 24: a million prompts in Python sets and dicts cost GBs); their
answers are the Python sets' answers, in Python's order — the report's lists are the same bytes."""

from __future__ import annotations

import random

import pyarrow as pa

from storage import verify, verify_report
from storage.schema import CONTENT_HASH, DATASET, PROMPT_ID

# Ids whose order differs between naive orderings: non-ASCII, a prefix of another, digits after letters.
ALPHABET = ["a", "b", "Z", "0", "9", "-", "/", "é", "ß", "中", "\U0001f600"]


def _ids(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(n)]


def test_set_answers_and_order_are_pythons() -> None:
    rng = random.Random(24)
    for _ in range(20):
        a, b = _ids(rng, 300), _ids(rng, 200)
        assert verify._sorted_list(verify._ids(a)) == sorted(set(a))
        assert verify._sorted_list(verify._minus(verify._ids(a), verify._ids(b))) == sorted(set(a) - set(b))
        assert verify._sorted_list(verify._minus(verify._ids([]), verify._ids(b))) == []


def test_stale_and_per_dataset_match_the_dict_answers() -> None:
    # Given submitted hashes, committed rows (some with another hash, an empty one, none, or never submitted)
    rng = random.Random(7)
    pids = sorted(set(_ids(rng, 400)) - {""})
    submitted = {p: rng.choice(["h1", "h2", ""]) for p in pids if rng.random() < 0.8}
    stored = {p: rng.choice(["h1", "h2", "", None]) for p in pids if rng.random() < 0.7}
    dataset_of = {p: rng.choice(["alpha", "beta", "", None]) for p in submitted}
    winners = pa.table(
        {
            PROMPT_ID: pa.array(list(stored), pa.string()),
            CONTENT_HASH: pa.array(list(stored.values()), pa.string()),
            DATASET: pa.array([dataset_of.get(p, "alpha") for p in stored], pa.string()),
        }
    )
    sub = pa.table([list(submitted), list(submitted.values())], schema=verify._SUBMITTED)
    datasets = pa.table([list(dataset_of), list(dataset_of.values())], schema=verify._DATASET_OF)
    # Then stale is the dict comprehension verify ran before
    expected = sorted(p for p, h in stored.items() if h and submitted.get(p) and submitted[p] != h)
    assert verify._stale(winners, sub) == expected
    # And the per-dataset counts are the bump-by-bump counts
    report = verify_report.VerifyReport(job="j", submitted_source="redis")
    report.missing = sorted(set(submitted) - set(stored))
    report.permanent_failures = report.missing[::3]
    want: dict[str, dict[str, int]] = {}

    def bump(name: str | None, key: str) -> None:
        want.setdefault(name or "?", {"submitted": 0, "committed": 0, "missing": 0, "dead": 0})[key] += 1

    for p in dataset_of:
        bump(dataset_of[p], "submitted")
    for p in stored:
        bump(dataset_of.get(p, "alpha"), "committed")
    for p in report.missing:
        bump(dataset_of.get(p), "missing")
    for p in report.permanent_failures:
        bump(dataset_of.get(p), "dead")
    assert verify._per_dataset(report, datasets, winners) == dict(sorted(want.items()))


def test_submitted_hashes_are_looked_up_only_for_placeholder_rows() -> None:
    sub = pa.table([["p1", "p2", "p3"], ["a" * 16, "h-p2", "b" * 16]], schema=verify._SUBMITTED)
    table = pa.table({PROMPT_ID: ["p1", "p2", "p3", "p4"], CONTENT_HASH: ["c" * 16, "h-p2", None, "x"]})
    assert verify._submitted_hashes(table, sub) == {"p2": "h-p2", "p3": "b" * 16}
    real = pa.table({PROMPT_ID: ["p1"], CONTENT_HASH: ["c" * 16]})
    assert verify._submitted_hashes(real, sub) == {}
