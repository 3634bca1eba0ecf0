"""Synthetic Kimi-shaped rows for storage's tests and benchmark (no model needed).

Ordinary tokens are Zipf-distributed over the tiktoken ranks (low ids are frequent, as in real text),
so compression behaves like it would on real outputs; lengths follow the seed run's heavy tail
(median 646, mean ~1,400, capped at 10,240).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np

from thinkfleet import kimi

#: Output lengths of the seed run: lognormal with median 646 and mean 1,416.
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CAP = 646, 1.253, 10_240
PROMPT_MEDIAN, PROMPT_SIGMA = 300, 0.8


def ordinary_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` non-special ids, Zipf-distributed over the base vocabulary."""
    return np.minimum(rng.zipf(1.15, size=n), kimi.FIRST_SPECIAL_ID - 1).astype(np.int32)


def kimi_prompt(rng: np.random.Generator, n_user: int, *, thinking: bool = True) -> list[int]:
    """A chat-templated prompt: system turn, user turn, generation prompt (``<think>`` if thinking)."""
    ids = [kimi.IM_SYSTEM, 1, kimi.IM_MIDDLE, *ordinary_ids(rng, 6).tolist(), kimi.IM_END]
    ids += [kimi.IM_USER, 2, kimi.IM_MIDDLE, *ordinary_ids(rng, n_user).tolist(), kimi.IM_END]
    ids += [kimi.IM_ASSISTANT, 3, kimi.IM_MIDDLE]
    ids += [kimi.THINK_START] if thinking else [kimi.THINK_START, kimi.THINK_END]
    return ids


def kimi_output(
    rng: np.random.Generator,
    reasoning: int,
    answer: int,
    *,
    think_end: bool = True,
    tool_calls: int = 0,
    stop: int | None = kimi.IM_END,
) -> list[int]:
    """``reasoning… </think> answer… [tool section] <|im_end|>`` as a generation would return it."""
    ids = ordinary_ids(rng, reasoning).tolist()
    if think_end:
        ids += [kimi.THINK_END, *ordinary_ids(rng, answer).tolist()]
    if tool_calls:
        ids.append(kimi.TOOL_CALLS_SECTION_BEGIN)
        for _ in range(tool_calls):
            ids += [kimi.TOOL_CALL_BEGIN, *ordinary_ids(rng, 3).tolist(), kimi.TOOL_CALL_ARGUMENT_BEGIN]
            ids += [*ordinary_ids(rng, 5).tolist(), kimi.TOOL_CALL_END]
        ids.append(kimi.TOOL_CALLS_SECTION_END)
    if stop is not None:
        ids.append(stop)
    return ids


def make_row(
    prompt_id: str,
    *,
    dataset: str = "ds",
    job: str = "job",
    input_ids: list[int] | np.ndarray | None = None,
    output_ids: list[int] | np.ndarray | None = None,
    seed: int = 0,
    **overrides: Any,
) -> dict[str, Any]:
    """One complete row dict as a worker builds it (spans left for storage to compute)."""
    rng = np.random.default_rng(seed)
    if input_ids is None:
        input_ids = kimi_prompt(rng, 20)
    if output_ids is None:
        output_ids = kimi_output(rng, 30, 10)
    row: dict[str, Any] = {
        "job": job,
        "dataset": dataset,
        "prompt_id": prompt_id,
        "row_index": int(prompt_id.rsplit("-", 1)[-1]) if prompt_id.rsplit("-", 1)[-1].isdigit() else 0,
        "input_ids": input_ids,
        "output_ids": output_ids,
        "finish_reason": {"type": "stop", "matched": kimi.IM_END},
        "cached_tokens": 0,
        "num_retractions": 0,
        "latency_s": 1.5,
        "worker": "w1",
        "worker_host": "host-a",
        "model": "kimi-k2.5",
        "weight_version": "default",
        "sampling_params": {"max_new_tokens": 10_240, "temperature": 1.0},
        "tokenizer_fingerprint": "tok-fp",
        "chat_template_hash": "tmpl-hash",
        "content_hash": f"h-{prompt_id}",
        "created_at": datetime.now(UTC),
    }
    row.update(overrides)
    return row


def synthetic_rows(
    n: int, *, seed: int = 0, job: str = "bench", dataset: str = "ds", as_numpy: bool = True
) -> list[dict[str, Any]]:
    """``n`` rows with the seed run's length distribution; ids as numpy arrays or lists."""
    rng = np.random.default_rng(seed)
    out_lens = np.minimum(rng.lognormal(np.log(OUTPUT_MEDIAN), OUTPUT_SIGMA, n).astype(int) + 2, OUTPUT_CAP)
    in_lens = rng.lognormal(np.log(PROMPT_MEDIAN), PROMPT_SIGMA, n).astype(int) + 1
    flat_out = ordinary_ids(rng, int(out_lens.sum()))
    flat_in = ordinary_ids(rng, int(in_lens.sum()))
    out_off = np.concatenate([[0], np.cumsum(out_lens)])
    in_off = np.concatenate([[0], np.cumsum(in_lens)])
    now = datetime.now(UTC)
    params = {"max_new_tokens": OUTPUT_CAP, "temperature": 1.0, "top_p": 0.95}
    rows = []
    for i in range(n):
        out = flat_out[out_off[i] : out_off[i + 1]].copy()
        # Most outputs close reasoning ~60% in and end with <|im_end|>; every 10th is truncated.
        if i % 10:
            out[int(len(out) * 0.6)] = kimi.THINK_END
            out[-1] = kimi.IM_END
        prompt = flat_in[in_off[i] : in_off[i + 1]].copy()
        prompt[-1] = kimi.THINK_START
        rows.append(
            {
                "job": job,
                "dataset": dataset,
                "prompt_id": f"{dataset}-{i:07d}",
                "row_index": i,
                "sample_index": 0,
                "revision": 0,
                "attempt": 1,
                "input_ids": prompt if as_numpy else prompt.tolist(),
                "output_ids": out if as_numpy else out.tolist(),
                "finish_reason": "stop" if i % 10 else "length",
                "finish_matched": str(kimi.IM_END) if i % 10 else None,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "reasoning_tokens": None,
                "sampling_seed": None,
                "num_retractions": 0,
                "latency_s": 12.5,
                "worker": "bench-worker",
                "worker_host": "bench-host",
                "model": "kimi-k2.5",
                "weight_version": "default",
                "sampling_params": params,
                "tokenizer_fingerprint": "fp",
                "chat_template_hash": "th",
                "content_hash": f"h{i}",
                "created_at": now,
            }
        )
    return rows
