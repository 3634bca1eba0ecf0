"""A synthetic job in storage as a fleet leaves it: many small parts, a few fenced rows, retries and duplicates.

Used by ``bench/bench_scale_storage.py`` (88k and 1M prompts) and by ``tests/test_storage_streaming.py`` (a few
hundred), so the test's golden outputs and the benchmark's old-vs-new comparison read the same kind of job. Rows go
through the real writer (:class:`storage.writer.PartWriter`, spans computed by storage) and everything is a pure
function of the arguments — part names, ``created_at``, ids — so two runs write byte-identical parts and the
commands' outputs can be compared by digest across code versions. Only APIs that exist before and after the
streaming change are used: the benchmark runs this module under the baseline tree too.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from storage import layout
from storage.manifest import write_submitted
from storage.writer import PartWriter
from thinkfleet import kimi

#: Output ids of a "short" row (reasoning + ``</think>`` + answer + stop): the floor the issue measured at 88k.
SHORT_REASONING, SHORT_ANSWER = 40, 12
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def prompt_ids(dataset: str, n: int) -> list[str]:
    return [f"{dataset}-{i:07d}" for i in range(n)]


def _ids(seed: int, n: int) -> np.ndarray:
    """``n`` Zipf-distributed ordinary ids, a pure function of ``seed``."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.15, size=n), kimi.FIRST_SPECIAL_ID - 1).astype(np.int32)


def _row(dataset: str, i: int, *, scale: int, revision: int = 0, epoch: int = 1, worker: str = "w0",
         created_s: float = 0.0, variant: int = 0) -> dict[str, Any]:  # fmt: skip
    """Row ``i`` of ``dataset``: a Kimi thinking prompt and output; ``variant`` changes the output ids (a fenced or
    retried row differs from the winner, so a wrong winner shows in every export)."""
    seed = (hash_int(dataset) * 1_000_003 + i * 17 + variant) % (1 << 32)
    reasoning, answer = SHORT_REASONING * scale + i % 7, SHORT_ANSWER * scale + i % 5
    user = _ids(seed, 20 + i % 11)
    prompt = np.concatenate([[kimi.IM_USER, 2, kimi.IM_MIDDLE], user, [kimi.IM_END, kimi.IM_ASSISTANT, 3,
                                                                       kimi.IM_MIDDLE, kimi.THINK_START]])  # fmt: skip
    body = _ids(seed + 1, reasoning + answer)
    truncated = i % 23 == 0
    if truncated:
        output = body
    else:
        output = np.concatenate([body[:reasoning], [kimi.THINK_END], body[reasoning:], [kimi.IM_END]])
    pid = f"{dataset}-{i:07d}"
    return {
        "prompt_id": pid,
        "row_index": i,
        "sample_index": 0,
        "revision": revision,
        "attempt": 1 + revision,
        "epoch": epoch,
        "input_ids": prompt.astype(np.int32),
        "output_ids": output.astype(np.int32),
        "finish_reason": "length" if truncated else "stop",
        "finish_matched": None if truncated else str(kimi.IM_END),
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output),
        "cached_tokens": 0,
        "num_retractions": 0,
        "latency_s": 1.0 + (i % 97) / 10,
        "worker": worker,
        "worker_host": "host-a",
        "model": "kimi-k2.5",
        "weight_version": "default",
        "sampling_params": {"max_new_tokens": 10_240, "temperature": 1.0},
        "tokenizer_fingerprint": "tok-fp",
        "chat_template_hash": "tmpl-hash",
        "content_hash": f"h-{pid}",
        "created_at": T0 + timedelta(seconds=created_s),
    }


def hash_int(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def job_rows(dataset: str, n: int, scale: int) -> Iterator[dict[str, Any]]:
    """Every stored row of ``dataset`` in commit order: the winners, and — as a fleet leaves them — a fenced row
    (a stale claim's, lower epoch) for every 50th prompt, a revision-0 row superseded by ``producer retry`` for
    every 70th, and an exact duplicate (same revision and epoch, a later ``created_at``) for every 997th."""
    for i in range(n):
        t = i * 0.05
        if i % 50 == 7:
            yield _row(dataset, i, scale=scale, epoch=1, worker="w-stale", created_s=t, variant=1)
            yield _row(dataset, i, scale=scale, epoch=2, worker=f"w{i % 4}", created_s=t + 1)
        elif i % 70 == 11:
            yield _row(dataset, i, scale=scale, revision=0, worker="w1", created_s=t, variant=2)
            yield _row(dataset, i, scale=scale, revision=1, epoch=3, worker=f"w{i % 4}", created_s=t + 2)
        else:
            yield _row(dataset, i, scale=scale, worker=f"w{i % 4}", created_s=t)
        if i % 997 == 500:
            yield _row(dataset, i, scale=scale, worker=f"w{(i + 1) % 4}", created_s=t + 3)


def write_job(
    output_uri: str,
    job: str,
    prompts: int,
    *,
    rows_per_part: int = 9,
    scale: int = 1,
    datasets: tuple[str, ...] = ("alpha", "beta"),
    shard: tuple[int, int] = (0, 1),
) -> int:
    """Write ``prompts`` prompts (split over ``datasets``) as parts of ``rows_per_part`` rows, and the submit
    manifest; ``shard`` = (k, n): only every n-th part from the k-th (for writing in parallel processes; shard 0
    writes the manifest). Returns the parts written."""
    writer = PartWriter(output_uri, "bench")
    loc = layout.locate(output_uri)
    per = [prompts // len(datasets) + (1 if d < prompts % len(datasets) else 0) for d in range(len(datasets))]
    parts = 0
    seq = 0
    for dataset, n in zip(datasets, per, strict=True):
        batch: list[dict[str, Any]] = []
        rows = job_rows(dataset, n, scale)
        while True:
            batch = [r for _, r in zip(range(rows_per_part), rows, strict=False)]
            if not batch:
                break
            if seq % shard[1] == shard[0]:
                name = f"{layout.PART_PREFIX}20260101T000000000000Z-bench-{seq:08d}{layout.PARQUET_SUFFIX}"
                path = posixpath.join(loc.dataset_dir(job, dataset), name)
                writer.write(job, dataset, batch, loc.uri(path))
                parts += 1
            seq += 1
        if shard[0] == 0:
            submitted = [
                {"prompt_id": pid, "dataset": dataset, "row_index": i, "content_hash": f"h-{pid}"}
                for i, pid in enumerate(prompt_ids(dataset, n))
            ]
            write_submitted(output_uri, job, submitted)
    return parts


def tree_digests(root: str) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path → digest)."""
    out = {}
    for base, _, files in os.walk(root):
        for name in sorted(files):
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(out.items()))
