"""Train while the fleet generates, through everything at once: a follower's rolling shards of a 600-prompt job
equal ``producer export``'s committed view, row for row, after a worker SIGKILL, a Redis restart, a
``retry --truncated`` and two SIGKILLs of the follower itself.

Real processes: a private redis-server with AOF (so it may be killed and restarted), the simulator at a high time
scale with short outputs (a 48-token budget cuts some: the retry's rows), two ``worker`` processes and the follower
(``producer export --follow``, started three times). The producer's own commands (retry, export) run in this
process: they are not what is tested. The delay from the job's first commit to its first closed shard is recorded
(printed, and a ``first_row_delay_s`` property), never asserted.
"""

from __future__ import annotations

import json
import os
from datetime import UTC
from pathlib import Path

import pyarrow.compute as pc
import pytest
import redis
from test_follow import applied_lines, closed, export_lines, given_twice, start_follower

from storage.follow import ShardDir
from storage.reader import read_committed
from storage.schema import CREATED_AT
from testing.fleet import WorkerProcess, job_progress_or_down, stuck_report, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, register_ids, simulator
from testing.services import RedisServer
from thinkfleet.broker.celery_app import send_tasks
from thinkfleet.settings import Settings

JOB = "follow-fleet"
N = 600
#: Held back until after the retry, so the job cannot finish (and the follower end) before the retry's rows come.
HELD = 100
SIM = ("--time-scale", "400", "--length-median-tokens", "40", "--max-length-tokens", "160")

pytestmark = pytest.mark.timeout(900)


def test_follower_output_equals_the_committed_view_through_kills_restarts_and_a_retry(
    tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    # Given a Redis with AOF, two workers on a fast simulator and a 600-prompt job whose last 100 are held back.
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    out = tmp_path / "shards"
    how = ("--reader", "trainer", "--shard-rows", "50", "--shard-seconds", "0.5")
    followers = []

    def done() -> int:
        return job_progress_or_down(client, keys, JOB)["done"]

    try:
        with simulator(tmp_path, *SIM) as sim:
            env = fast_env(settings, sim, max_inflight=8)
            workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]

            def stuck() -> str:
                return stuck_report(client, settings, JOB, workers)

            try:
                for w in workers:
                    w.wait_ready(client, keys)
                _, tasks = register_ids(settings, JOB, make_prompts(N, seed=21, length=32), max_new_tokens=48)
                # The follower first, reading the feed before the first row commits.
                followers.append(start_follower(settings, JOB, out, *how, name="1"))
                wait_until(lambda: _reading(client), 120, what="the follower waiting on the feed")
                send_tasks(settings, tasks[: N - HELD])
                # When a worker is SIGKILLed mid-job,
                wait_until(lambda: done() >= 100, 300, what="100 rows", explain=stuck)
                workers[0].kill()
                # the follower is SIGKILLed and started again,
                wait_until(lambda: done() >= 200 and closed(out) >= 2, 300, what="200 rows", explain=stuck)
                followers[-1].kill()
                followers.append(start_follower(settings, JOB, out, *how, name="2"))
                # Redis is SIGKILLed and restarted from its AOF,
                wait_until(lambda: done() >= 300, 300, what="300 rows", explain=stuck)
                server.stop(kill=True)
                server.start()
                # the truncated rows are re-run with a larger budget,
                wait_until(lambda: done() >= N - HELD, 300, what=f"{N - HELD} rows", explain=stuck)
                retry = producer_cli(
                    settings, "retry", JOB, "--truncated", "--max-new-tokens", "200", "--json", in_process=True
                )
                assert retry.returncode == 0, retry.stderr
                rerun = set(json.loads(retry.stdout)["prompt_ids"])
                assert rerun, "a 48-token budget cut some outputs"
                # the follower is SIGKILLed again once replacements reached its shards, and started again,
                wait_until(lambda: _replacements(out) > 0, 300, what="a replacement in a shard", explain=stuck)
                followers[-1].kill()
                followers.append(start_follower(settings, JOB, out, *how, name="3"))
                # and the held-back prompts are published.
                send_tasks(settings, tasks[N - HELD :])
                summary = followers[-1].finish(timeout_s=600)
            finally:
                for w in workers:
                    w.terminate()
                for f in followers:
                    if f.proc.poll() is None:
                        f.kill()
    finally:
        server.stop()
    # Then the last follower ended because the job finished; its output, the replacements applied, is the committed
    # view of the same format row for row; no feed event is in two shards; every re-run prompt was replaced.
    assert "ended: job finished" in summary, summary
    assert not given_twice(out)
    lines = applied_lines(out)
    assert len(lines) == N
    assert lines == export_lines(settings, JOB, tmp_path)
    shard_dir = ShardDir(str(out), "", "", "")
    replaced = {r["id"] for n in shard_dir.closed() for r in shard_dir.read_sidecar(n)["replaces"]}
    assert replaced == rerun
    assert not [e for e in os.listdir(out) if e.startswith(".")], "a hidden leftover stayed"
    delay = _first_row_delay_s(settings, out)
    record_property("first_row_delay_s", delay)
    print(f"\nfirst commit -> first closed shard: {delay:.2f} s; {len(shard_dir.closed())} shards; {summary}")


def _reading(client: redis.Redis) -> bool:
    """A connection of this Redis blocked reading a stream: the follower waits on the feed."""
    return any(c.get("cmd") in ("xread", "xreadgroup") for c in client.client_list())


def _replacements(out: Path) -> int:
    shard_dir = ShardDir(str(out), "", "", "")
    return sum(len(shard_dir.read_sidecar(n)["replaces"]) for n in shard_dir.closed()) if closed(out) else 0


def _first_row_delay_s(settings: Settings, out: Path) -> float:
    """From the job's first row made (the earliest ``created_at``) to the first shard's close (its mtime)."""
    table = read_committed(settings.output_uri, JOB, columns=[CREATED_AT])
    first = pc.min(table[CREATED_AT]).as_py()  # a naive datetime in UTC
    first_s = first.replace(tzinfo=UTC).timestamp()
    shard = next(out.glob("shard-000001.*"))
    return round(shard.stat().st_mtime - first_s, 3)
