"""Figures from per-request intervals and sampled counters: occupancy, makespan, tail, per-host finish.

Both sides of every comparison are reduced the same way: a list of (start, end) wall times per request
(the worker's from its Parquet rows — ``created_at`` minus ``latency_s`` — the pool client's from its
own records) and the times prompts became *done* (the worker's group commits from the job timeline,
the pool client's responses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.compute as pc
import redis

from storage.reader import raw_duplicates, read_committed
from thinkfleet.keys import Keys


def occupancy(starts: np.ndarray, ends: np.ndarray, bound: int, t_from: float, t_to: float) -> float:
    """Time-weighted mean of requests in flight over [t_from, t_to], divided by ``bound``."""
    if t_to <= t_from:
        return float("nan")
    overlap = np.clip(np.minimum(ends, t_to) - np.maximum(starts, t_from), 0, None)
    return float(overlap.sum() / ((t_to - t_from) * bound))


def first_full(starts: np.ndarray, ends: np.ndarray, level: int) -> float:
    """The first instant at which ``level`` requests were in flight (nan if never)."""
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones(len(starts)), -np.ones(len(ends))])
    order = np.lexsort((steps, times))  # at equal times, ends (-1) before starts (+1)
    count = np.cumsum(steps[order])
    hit = np.nonzero(count >= level)[0]
    return float(times[order][hit[0]]) if len(hit) else float("nan")


def inflight_curve(starts: np.ndarray, ends: np.ndarray, t0: float, step_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight sampled every ``step_s`` from ``t0`` (for plots)."""
    grid = np.arange(t0, float(ends.max()) + step_s, step_s)
    started = np.searchsorted(np.sort(starts), grid, side="right")
    ended = np.searchsorted(np.sort(ends), grid, side="right")
    return grid - t0, started - ended


def tail(done_times: Sequence[float] | np.ndarray, t0: float, share: float = 0.95) -> dict[str, float]:
    """Makespan and the time from ``share`` of prompts done to all done (absolute and / makespan)."""
    times = np.sort(np.asarray(done_times, dtype=float)) - t0
    k = max(0, math.ceil(share * len(times)) - 1)
    makespan = float(times[-1])
    return {
        "makespan_s": makespan,
        "t95_s": float(times[k]),
        "tail_s": makespan - float(times[k]),
        "tail_share": (makespan - float(times[k])) / makespan if makespan > 0 else float("nan"),
    }


def counter_at(samples: list[dict[str, Any]], key: str, t: float) -> float:
    """Linear interpolation of a sampled counter at time ``t``."""
    pts = [(s["t"], s[key]) for s in samples if key in s]
    ts = np.array([p[0] for p in pts])
    vs = np.array([p[1] for p in pts])
    return float(np.interp(t, ts, vs))


def metric_occupancy(samples: list[dict[str, Any]], key: str, bound: int, t_from: float, t_to: float) -> float:
    """Occupancy from the worker's own ``thinkfleet_inflight_seconds_total`` (Δ integral / (Δt × bound))."""
    return (counter_at(samples, key, t_to) - counter_at(samples, key, t_from)) / ((t_to - t_from) * bound)


# -- the worker side from Redis and Parquet -----------------------------------------------------------------
def commit_times(client: redis.Redis, keys: Keys, job: str) -> np.ndarray:
    """One entry per committed row: the time of its group commit (from the job timeline)."""
    out: list[float] = []
    for member, score in client.zrange(keys.timeline(job), 0, -1, withscores=True):
        rows = int(member.decode().split(":")[1])
        out.extend([score] * rows)
    return np.array(sorted(out))


def stored_requests(output_uri: str, job: str) -> dict[str, np.ndarray]:
    """Per stored row: start/end of its /generate call, its worker, its tokens (committed view)."""
    table = read_committed(
        output_uri, job, columns=["prompt_id", "worker", "created_at", "latency_s", "completion_tokens"]
    )
    end = pc.cast(table["created_at"], "int64").to_numpy() / 1e6  # timestamp[us, UTC] → s
    return {
        "prompt_id": np.array(table["prompt_id"].to_pylist()),
        "worker": np.array(table["worker"].to_pylist()),
        "start": end - table["latency_s"].to_numpy(),
        "end": end,
        "tokens": table["completion_tokens"].to_numpy(),
    }


def exactly_once(output_uri: str, job: str, expected: set[str]) -> dict[str, Any]:
    """Every prompt exactly once in the committed view, and no prompt stored twice in the raw parts."""
    ids = read_committed(output_uri, job, columns=["prompt_id"])["prompt_id"].to_pylist()
    dups = raw_duplicates(output_uri, job)
    return {
        "committed_rows": len(ids),
        "missing": len(expected - set(ids)),
        "unexpected": len(set(ids) - expected),
        "raw_duplicate_rows": dups.num_rows,
        "ok": len(ids) == len(expected) and set(ids) == expected and dups.num_rows == 0,
    }


def per_host_finish(hosts: np.ndarray, done: np.ndarray, t0: float) -> dict[str, float]:
    return {str(h): round(float(done[hosts == h].max() - t0), 3) for h in sorted(set(hosts.tolist()))}
