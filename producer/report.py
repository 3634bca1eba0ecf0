"""What a submit tells its user: counts per dataset, prompt lengths, Redis estimate, projected wall time."""

from __future__ import annotations

import statistics
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.inputs import Problem

#: Problems printed in a failure message (the count is exact).
SHOWN_PROBLEMS = 20
#: Redis bytes per queued message beyond its JSON (list entry + node share), and per prompt in the two
#: prompt hashes beyond its key/value bytes; calibrated with INFO memory by bench/bench_producer.py.
LIST_ENTRY_OVERHEAD_B = 12
HASH_ENTRY_OVERHEAD_B = 60


@dataclass
class DatasetReport:
    rows: int = 0
    prompts: int = 0  # valid messages of this submission (samples counted)
    enqueued: int = 0
    already_done: int = 0
    already_queued: int = 0  # queued or running
    dead: int = 0
    skipped: int = 0
    prompt_tokens: int = 0


@dataclass
class SubmitReport:
    job: str
    dry_run: bool
    datasets: dict[str, DatasetReport]
    enqueued: int
    prompt_tokens_enqueued: int
    lengths: dict[str, float]
    estimated_redis_bytes: int
    projected_wall_s: float
    warnings: list[str]
    problems: list[Problem]  # skipped with --skip-invalid
    changed: int
    elapsed_s: float
    tokenizer_fingerprint: str
    prompt_ends_with_think_start: bool
    #: --turns all: conversations whose stored turns the workers finalize again, from their parts (a re-submit
    #: after a purge or a lost Redis: producer/chains.py); their first such turn is counted in ``enqueued``.
    resumed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "dry_run": self.dry_run,
            "enqueued": self.enqueued,
            "prompt_tokens_enqueued": self.prompt_tokens_enqueued,
            "datasets": {k: vars(v) for k, v in self.datasets.items()},
            "prompt_length": self.lengths,
            "estimated_redis_bytes": self.estimated_redis_bytes,
            "projected_wall_s": round(self.projected_wall_s, 1),
            "warnings": self.warnings,
            "skipped": [{"location": p.location, "reason": p.reason} for p in self.problems],
            "changed": self.changed,
            "elapsed_s": round(self.elapsed_s, 3),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "prompt_ends_with_think_start": self.prompt_ends_with_think_start,
            "resumed": self.resumed,
        }


def problem_summary(problems: list[Problem]) -> str:
    lines = [f"{len(problems)} problem(s); nothing was enqueued:"]
    lines += [f"  {p}" for p in problems[:SHOWN_PROBLEMS]]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"  … and {len(problems) - SHOWN_PROBLEMS} more")
    lines.append("  → fix these rows, or pass --skip-invalid to skip them (they are recorded in the job record)")
    return "\n".join(lines)


def length_stats(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {"count": 0}
    ordered = sorted(lengths)
    return {
        "count": len(ordered),
        "min": ordered[0],
        "median": statistics.median(ordered),
        "mean": round(statistics.fmean(ordered), 1),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


def packed_length_stats(lengths: array) -> dict[str, float]:
    """:func:`length_stats` of a packed array, without a Python int per prompt."""
    if not lengths:
        return length_stats([])
    a = np.sort(np.frombuffer(lengths, dtype=np.uint32))
    return {
        "count": int(a.size),
        "min": int(a[0]),
        "median": float(np.median(a)) if a.size % 2 == 0 else int(a[a.size // 2]),
        "mean": round(float(a.mean()), 1),
        "p99": int(a[min(a.size - 1, int(0.99 * a.size))]),
        "max": int(a[-1]),
    }


def think_warnings(thinking: bool, think_start_id: int | None, not_ending: int, example: str | None) -> list[str]:
    """Loud warnings when thinking is on but prompts do not open the reasoning block (the seed's trap)."""
    if not thinking:
        return []
    if think_start_id is None:
        return [
            "thinking is on but the tokenizer has no <think> token: reasoning spans cannot be found; "
            "pass --think-start-id/--think-end-id"
        ]
    if not_ending:
        return [
            f"thinking is on but {not_ending} prompt(s) do not end with <think> (id {think_start_id}, optionally "
            f"followed by a newline), "
            f"e.g. {example}: this chat template does not open the reasoning block (K2-Thinking style?) — "
            "outputs will start with <think> and reasoning_start will not be 0; check the tokenizer and "
            "--chat-template-kwargs"
        ]
    return []


def estimate_redis_bytes(message_bytes: int, messages: int) -> int:
    """The queue lists, from the exact message sizes (the dry run builds every message); the prompt hashes are
    counted by the collector as it writes them (``Collector.hash_bytes``)."""
    return message_bytes + LIST_ENTRY_OVERHEAD_B * messages


def projected_wall_s(prompts: int, mean_output_tokens: float, hosts: int, server_tok_s: float) -> float:
    """Decode-bound wall time: every answer's tokens ÷ the fleet's output tokens/s."""
    return prompts * mean_output_tokens / max(1e-9, hosts * server_tok_s)
