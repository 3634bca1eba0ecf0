"""The commit log and its feed (storage/feed.py, issue 47): real Redis, real Parquet, real worker processes where the
point is the committer.

- rows a real worker commits are in the log once each, in finalize order, each naming its part and row; a live
  follower gets exactly the committed view, once each;
- a fenced row is never in the log; a ``retry --truncated`` revision arrives naming the row it replaces;
- follow() from a cursor resumes exactly after it; a reader whose log was lost or trimmed away is rebuilt from
  storage with ``given``, no row missing or repeated;
- the log is trimmed behind the slowest registered reader, and capped when nobody reads it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import redis.asyncio as aioredis

from sglang_sim.testing import SimulatorProcess
from storage import feed, reader
from storage.schema import EPOCH, PROMPT_ID, REVISION, SCHEMA
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, submit_ids
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import FinalRow, Ledger

#: Generous: the box is often 100 % busy.
WAIT_S = 180


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimulatorProcess]:
    server = SimulatorProcess("--time-scale", "400")
    server.log_path = str(tmp_path / "sim.log")
    server.start()
    yield server
    server.kill()


def _entries(client: redis.Redis, keys: Keys, job: str) -> list[tuple[str, dict[str, str]]]:
    return [
        (i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in client.xrange(keys.feed(job), "-", "+")
    ]


def _committed(settings: Settings, job: str) -> dict[str, tuple[int, int]]:
    view = reader.read_committed(settings.output_uri, job, columns=[PROMPT_ID, REVISION, EPOCH])
    return {
        p: (int(r or 0), int(e or 0))
        for p, r, e in zip(
            view[PROMPT_ID].to_pylist(), view[REVISION].to_pylist(), view[EPOCH].to_pylist(), strict=True
        )
    }


class Follower:
    """follow() in a thread until the job is finished (feed.finished) and the log is drained."""

    def __init__(self, settings: Settings, job: str, cursor: feed.Cursor | None = None, **kwargs: object) -> None:
        self.settings, self.job, self.cursor, self.kwargs = settings, job, cursor, kwargs
        self.batches: list[feed.FeedBatch] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            done_seen = False
            for batch in feed.follow(self.settings, self.job, self.cursor, block_s=0.2, **self.kwargs):  # type: ignore[arg-type]
                if batch is not None:
                    self.batches.append(batch)
                    continue
                if done_seen or self.stop.is_set():
                    return
                done_seen = feed.finished(self.settings, self.job)
        except BaseException as exc:  # the test thread reports it
            self.error = exc

    def start(self) -> Follower:
        self.thread.start()
        return self

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the follower did not end once the job was finished"
        if self.error is not None:
            raise self.error

    @property
    def events(self) -> list[feed.FeedEvent]:
        return [e for b in self.batches for e in b.events]

    @property
    def table(self) -> pa.Table:
        tables = [b.table for b in self.batches if b.table.num_rows]
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def test_rows_a_worker_commits_are_in_the_log_once_each_and_a_live_follower_gets_the_committed_view(
    redis_url: str, tmp_path: Path, sim: SimulatorProcess
) -> None:
    # Given a real worker and a follower started before the job's first commit.
    n = 40
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    worker = WorkerProcess("w1", fast_env(settings, sim.url, max_inflight=8), tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        follower = Follower(settings, "fj").start()
        # When the job runs to its end.
        submit_ids(settings, "fj", make_prompts(n, seed=47), max_new_tokens=32)
        wait_until(lambda: job_progress(client, keys, "fj")["done"] == n, WAIT_S, what="every row stored")
        follower.join()
    finally:
        worker.terminate()
    # Then the log holds one entry per committed row, naming the row's part and its index there.
    entries = _entries(client, keys, "fj")
    committed = _committed(settings, "fj")
    assert sorted(f["prompt_id"] for _, f in entries) == sorted(committed)
    for _, f in entries:
        assert committed[f["prompt_id"]] == (int(f["revision"]), int(f["epoch"]))
        part = pq.read_table(f["part"], columns=[PROMPT_ID, EPOCH])
        assert part[PROMPT_ID][int(f["row"])].as_py() == f["prompt_id"]
        assert part[EPOCH][int(f["row"])].as_py() == int(f["epoch"])
        assert "replaces" not in f
    # And the follower got each of them once, in the log's order, with the rows themselves.
    events = follower.events
    assert [e.seq for e in events] == [i for i, _ in entries]
    table = follower.table
    assert table.schema == SCHEMA
    assert table[PROMPT_ID].to_pylist() == [e.prompt_id for e in events]
    view = reader.read_committed(settings.output_uri, "fj").sort_by(PROMPT_ID)
    assert table.sort_by(PROMPT_ID).equals(view)
    assert follower.batches[-1].cursor == feed.Cursor(client.hget(keys.feed_log("fj"), "id").decode(), entries[-1][0])


def test_a_fenced_row_is_never_in_the_log(redis_url: str, tmp_path: Path) -> None:
    # Given worker a's claim of p1 taken over by worker b (a was paused past its lease: no heartbeat).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    keys = settings.keys

    async def scenario() -> tuple[int, dict[str, str], dict[str, str]]:
        client = aioredis.from_url(redis_url)
        await client.set(keys.heartbeat("b"), "1")
        a, b = Ledger(client, keys, "a"), Ledger(client, keys, "b")
        first = await a.claim("fz", "p1")
        second = await b.claim("fz", "p1")
        assert second.state == "stale"
        # When both finalize: the zombie first (fenced by b's claim), then b, then the zombie again (fenced by done).
        early = FinalRow("p1", 5, True, False, epoch=first.epoch, part="file:///x/part-a.parquet", row_index=0)
        before = (await a.finalize("fz", "ds", [early], 100, 0.95)).fenced
        row = FinalRow("p1", 5, True, False, epoch=second.epoch, part="file:///x/part-b.parquet", row_index=3)
        assert (await b.finalize("fz", "ds", [row], 100, 0.95)).new == 1
        after = (await a.finalize("fz", "ds", [early], 100, 0.95)).fenced
        await client.aclose()
        return second.epoch, before, after

    epoch, before, after = asyncio.run(scenario())
    assert "p1" in before and "p1" in after
    # Then the log holds b's row alone, where b wrote it.
    entries = _entries(redis.Redis.from_url(redis_url), keys, "fz")
    assert [f for _, f in entries] == [
        {"prompt_id": "p1", "revision": "0", "epoch": str(epoch), "part": "file:///x/part-b.parquet", "row": "3"}
    ]
