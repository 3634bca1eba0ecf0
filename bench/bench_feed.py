"""Train while the fleet generates: how soon a committed row reaches a reader, and what the commit log costs Redis.

    .venv/bin/python -m bench.bench_feed                                   (≈ 2 min on the 2-core dev VM)
    .venv/bin/python -m bench.bench_feed --from-json bench/results/feed.json   # the section only

A private redis-server, the simulator (400× time scale, short outputs) and two workers run one job; two readers
follow it from before its first row: one in this process (``storage.feed.follow``, what the torch adapter reads)
and ``producer export --follow --format specforge`` as a process (default shards: 1000 rows, closed at most 5 s
after their first row or when the feed is idle for a poll of 1 s). Figures:

- *commit → feed*: from each row's commit (its log entry's id is the Redis time of the finalize that appended it,
  in ms) to the in-process reader holding it; *commit → closed shard*: to the follower's rename of the shard that
  holds it (the shard file's mtime) — p50, p99 and max over every row;
- *Redis bytes per committed row*: ``MEMORY USAGE`` of the log's keys (the stream, its record, the readers) over
  the job's rows — the in-process reader is registered and never commits, so the log is kept whole (the follower's
  commits alone would have trimmed it behind them) — beside the same for every other key under the run's key
  prefix (the job's state and the workers': what Redis holds without the log).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from bench.harness import RESULTS, code_version, write_json
from bench.report import code_stamp, table, update_section
from storage import feed
from storage.follow import ShardDir
from testing.fleet import WorkerProcess, job_progress_or_down, wait_until
from testing.harness import cli_env, fast_env, isolated_settings, make_prompts, simulator, submit_ids
from testing.redis_process import RedisProcess
from thinkfleet.settings import Settings

JSON = RESULTS / "feed.json"
JOB = "feed"
SIM = ("--time-scale", "400", "--length-median-tokens", "60", "--max-length-tokens", "200")
MAX_NEW_TOKENS = 256


class Reader(threading.Thread):
    """``storage.feed.follow`` in this process: when each row's event arrived (wall ms) and its commit (entry ms)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True)
        self.settings = settings
        self.delays_ms: list[float] = []
        self.stop = threading.Event()
        self.started = threading.Event()

    def run(self) -> None:
        self.started.set()
        # Registered and never committed: the log is kept whole for it, so its size after the job is every row's.
        for batch in feed.follow(self.settings, JOB, None, reader="bench-in-process", block_s=0.2):
            now_ms = time.time() * 1000
            if self.stop.is_set():
                return
            for event in batch.events if batch is not None else []:
                if event.seq:  # (a rebuilt row has no entry: none here, the reader starts before the job)
                    self.delays_ms.append(now_ms - feed.entry_id(event.seq)[0])


def shard_delays_ms(out: Path) -> list[float]:
    """Each row's commit (its entry's ms) to its shard's close (the file's mtime)."""
    shard_dir = ShardDir(str(out), "", "", "")
    delays = []
    for n in shard_dir.closed():
        closed_ms = next(out.glob(f"shard-{n:06d}.*")).stat().st_mtime * 1000
        delays += [closed_ms - feed.entry_id(seq)[0] for *_, seq in shard_dir.read_sidecar(n)["rows"] if seq]
    return delays


def redis_bytes(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """MEMORY USAGE of the log's keys and of every other key of the run's prefix."""
    keys = settings.keys
    log_keys = {keys.feed(JOB), keys.feed_log(JOB), keys.feed_readers(JOB)}
    log_bytes = other = 0
    for key in client.scan_iter(match=f"{settings.key_prefix}*", count=1000):
        used = int(client.memory_usage(key, samples=0) or 0)
        if key.decode() in log_keys:
            log_bytes += used
        else:
            other += used
    return {"log": log_bytes, "other": other, "entries": int(client.xlen(keys.feed(JOB)))}


def percentiles(values: list[float]) -> dict[str, float]:
    a = np.array(values or [0.0])
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def run(prompts: int, workdir: Path) -> dict[str, Any]:
    server = RedisProcess(workdir / "redis").start()
    settings = isolated_settings(server.url(), str(workdir / "out"))
    client = redis.Redis.from_url(server.url())
    out = workdir / "shards"
    try:
        with simulator(workdir, *SIM) as sim:
            workers = [
                WorkerProcess(f"w{i}", fast_env(settings, sim, max_inflight=16), workdir).start() for i in (1, 2)
            ]
            try:
                for w in workers:
                    w.wait_ready(client, settings.keys)
                reader = Reader(settings)
                reader.start()
                err = (workdir / "follow.err").open("w")
                follower = subprocess.Popen(
                    [sys.executable, "-m", "producer.cli", "export", JOB, "--follow", "--format", "specforge",
                     "--reader", "bench", "--out", str(out)],
                    env=cli_env(settings), stdout=subprocess.DEVNULL, stderr=err,
                )  # fmt: skip
                # Both wait on the log (XREAD BLOCK) before the first row commits.
                wait_until(lambda: _blocked_readers(client) >= 2, 120, what="both readers on the feed")
                started = time.monotonic()
                submit_ids(settings, JOB, make_prompts(prompts, seed=5), max_new_tokens=MAX_NEW_TOKENS)
                wait_until(lambda: job_progress_or_down(client, settings.keys, JOB)["done"] == prompts, 600)
                elapsed = time.monotonic() - started
                assert follower.wait(300) == 0, (workdir / "follow.err").read_text()
                reader.stop.set()
                bytes_ = redis_bytes(client, settings)
            finally:
                for w in workers:
                    w.terminate()
    finally:
        server.stop()
    summary = (workdir / "follow.err").read_text().strip().splitlines()[-1]
    return {
        "prompts": prompts,
        "job_s": elapsed,
        "feed_rows": len(reader.delays_ms),
        "feed_ms": percentiles(reader.delays_ms),
        "shard_rows": len(shard_delays_ms(out)),
        "shard_ms": percentiles(shard_delays_ms(out)),
        "shards": len(ShardDir(str(out), "", "", "").closed()),
        "redis": bytes_,
        "follower": summary,
    }


def _blocked_readers(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if c.get("cmd") in ("xread", "xreadgroup"))


def render(data: dict[str, Any]) -> None:
    r = data["run"]
    rows = r["prompts"]

    def ms(d: dict[str, float]) -> list[str]:
        return [f"{d['p50']:.0f} ms", f"{d['p99']:.0f} ms", f"{d['max']:.0f} ms"]

    log_per_row, other_per_row = r["redis"]["log"] / rows, r["redis"]["other"] / rows
    body = (
        "`.venv/bin/python -m bench.bench_feed` — " + (__doc__ or "").split("\n\n", 2)[2].strip() + "\n\n"
        f"{r['prompts']} prompts in {r['job_s']:.0f} s on 2 workers ({r['prompts'] / r['job_s']:.0f} rows/s).\n\n"
        + table(
            ["delay", "rows", "p50", "p99", "max"],
            [
                ["commit → feed (in-process reader)", r["feed_rows"], *ms(r["feed_ms"])],
                [
                    f"commit → closed shard (`export --follow`, {r['shards']} shards)",
                    r["shard_rows"],
                    *ms(r["shard_ms"]),
                ],
            ],
        )
        + "\n\n"
        + table(
            ["Redis, after the job", "bytes", "bytes per committed row"],
            [
                [
                    f"the commit log ({r['redis']['entries']} entries: stream, record, readers)",
                    r["redis"]["log"],
                    f"{log_per_row:.0f}",
                ],
                ["every other key (no-feed baseline)", r["redis"]["other"], f"{other_per_row:.0f}"],
            ],
        )
        + f"\n\nThe log adds {100 * log_per_row / max(1.0, other_per_row):.0f} % to the job's Redis memory; it is "
        "capped at `feed_max_len` entries (200,000 by default: docs/settings.md) and trimmed behind the slowest "
        "registered reader. The shard delay is mostly the closing rule (a shard closes when the feed is idle for a "
        "1 s poll, at 1000 rows, or 5 s after its first row: `--shard-seconds`); the feed itself hands a row over in "
        f"the time above.\n\nFollower: `{r['follower']}`.\n\n"
        f"{code_stamp(data.get('code'))} Raw figures: `bench/results/feed.json`."
    )
    print(body)
    update_section("bench_feed", "Train while generating: commit → feed delay and the log's Redis bytes", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--from-json", type=Path)
    args = parser.parse_args()
    if args.from_json:
        render(json.loads(args.from_json.read_text()))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-feed-") as tmp:
        data = {"run": run(args.prompts, Path(tmp)), "code": code_version()}
    write_json(JSON, data)
    render(data)


if __name__ == "__main__":
    main()
