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
import json
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
from storage.compact import compact_job
from storage.schema import EPOCH, PROMPT_ID, REVISION, SCHEMA
from storage.writer import PartWriter
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, submit_ids
from testing.rows import make_row
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import Fence, FinalRow, Ledger
from workers.committer import GroupCommitter

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


def test_rows_a_worker_commits_are_in_the_log_once_each_and_a_truncated_retry_arrives_as_replacements(
    redis_url: str, tmp_path: Path, sim: SimulatorProcess
) -> None:
    # Given a real worker whose log is capped at 45 entries, and a follower started before the job's first commit;
    # every row is cut at 8 tokens.
    n = 30
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    worker = WorkerProcess("w1", fast_env(settings, sim.url, max_inflight=8, feed_max_len=45), tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        follower = Follower(settings, "fj").start()
        # When the job runs to its end.
        submit_ids(settings, "fj", make_prompts(n, seed=47), max_new_tokens=8)
        wait_until(lambda: job_progress(client, keys, "fj")["done"] == n, WAIT_S, what="every row stored")
        follower.join()
        # Then the log holds one entry per committed row, naming the row's part and its index there.
        entries = _entries(client, keys, "fj")
        first = _committed(settings, "fj")
        assert sorted(f["prompt_id"] for _, f in entries) == sorted(first)
        for _, f in entries:
            assert first[f["prompt_id"]] == (int(f["revision"]), int(f["epoch"]))
            part = pq.read_table(f["part"], columns=[PROMPT_ID, EPOCH])
            assert part[PROMPT_ID][int(f["row"])].as_py() == f["prompt_id"]
            assert part[EPOCH][int(f["row"])].as_py() == int(f["epoch"])
            assert "replaces" not in f
        # And the follower got each of them once, in the log's order, with the rows themselves.
        events = follower.events
        assert [e.seq for e in events] == [i for i, _ in entries]
        assert all(e.replaces is None for e in events)
        table = follower.table
        assert table.schema == SCHEMA
        assert table[PROMPT_ID].to_pylist() == [e.prompt_id for e in events]
        assert table.sort_by(PROMPT_ID).equals(reader.read_committed(settings.output_uri, "fj").sort_by(PROMPT_ID))
        cursor = follower.batches[-1].cursor
        assert cursor == feed.Cursor(client.hget(keys.feed_log("fj"), "id").decode(), entries[-1][0])

        # When the operator re-runs the truncated rows as revision 1, and the follower goes on from its cursor.
        retry = producer_cli(
            settings, "retry", "fj", "--truncated", "--max-new-tokens", "16", "--json", in_process=True
        )
        assert retry.returncode == 0, retry.stderr
        rerun = set(json.loads(retry.stdout)["prompt_ids"])
        assert len(rerun) == n, "every row was cut at 8 tokens"
        revised = keys.committed_revisions("fj")  # written in the step that appends the row's entry
        wait_until(lambda: client.hlen(revised) == n, WAIT_S, what="every revision-1 row committed")
        again = Follower(settings, "fj", cursor).start()
        again.join()
    finally:
        worker.terminate()
    # Then each revision-1 row arrives once, naming the revision-0 row it replaces, in the log and in the feed.
    # (the cap cut the oldest entries, which the follower had passed: 45 to 49 of the 60 are left)
    assert 45 <= client.xlen(keys.feed("fj")) <= 49
    later = [(i, f) for i, f in _entries(client, keys, "fj") if f["revision"] == "1"]
    assert {f["prompt_id"]: f["replaces"] for _, f in later} == {p: f"0:{e}" for p, (_, e) in first.items()}
    now = _committed(settings, "fj")
    assert {e.prompt_id: (e.revision, e.epoch) for e in again.events} == now
    assert len(again.events) == n and all(r == 1 for r, _ in now.values())
    assert {e.prompt_id: e.replaces for e in again.events} == first
    # And a reader starting afresh gets the committed view alone: revision 1, nothing to replace.
    fresh = Follower(settings, "fj").start()
    fresh.join()
    assert {e.prompt_id: (e.revision, e.epoch, e.replaces) for e in fresh.events} == {
        p: (*row, None) for p, row in now.items()
    }
    assert fresh.table.sort_by(PROMPT_ID).equals(reader.read_committed(settings.output_uri, "fj").sort_by(PROMPT_ID))


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


class _Committer:
    """Rows stored and finalized as a worker does it — claim, one Parquet part per call, finalize naming each row's
    place — with the real PartWriter and Ledger, no worker process (the subject here is the log's reading side)."""

    def __init__(self, settings: Settings, job: str, feed_max_len: int = 200_000) -> None:
        self.settings, self.job = settings, job
        self.writer = PartWriter(settings.output_uri, "w1")
        self.feed_max_len = feed_max_len
        self.stored = 0
        # the job's record (a purged job's has gone: nothing of the log is written for it then)
        redis.Redis.from_url(settings.redis_url).hset(settings.keys.job(job), "name", json.dumps(job))

    def commit(self, n: int, finalize: bool = True, revise: list[str] | None = None) -> list[str]:
        """``n`` new rows in one part, finalized (or only written: :meth:`finalize_written` finalizes them); or with
        ``revise``, a revision-1 row of each of those prompts (as ``producer retry --truncated`` re-runs them)."""
        client = redis.Redis.from_url(self.settings.redis_url)
        if revise:
            pids, revision = revise, 1
            client.srem(self.settings.keys.done(self.job), *pids)  # re-queued: out of done, as requeue.lua does
        else:
            pids, revision = [f"p-{self.stored + i:05d}" for i in range(n)], 0
            self.stored += n

        async def run() -> None:
            ledger = self._ledger()
            epochs = [(await ledger.claim(self.job, pid, revision=revision)).epoch for pid in pids]
            rows = [
                make_row(p, job=self.job, epoch=e, revision=revision, seed=i)
                for i, (p, e) in enumerate(zip(pids, epochs, strict=True))
            ]
            part = self.writer.write(self.job, "ds", rows)
            self.written = [
                FinalRow(p, 10, True, False, epoch=e, revision=revision, part=part, row_index=i)
                for i, (p, e) in enumerate(zip(pids, epochs, strict=True))
            ]
            if finalize:
                assert (await ledger.finalize(self.job, "ds", self.written, 100, 0.95)).new == len(pids)
            await ledger.r.aclose()

        asyncio.run(run())
        return pids

    def finalize_written(self) -> None:
        async def run() -> None:
            ledger = self._ledger()
            for row in self.written:  # under the claims the writing run held
                ledger.held[(self.job, row.prompt_id)] = Fence(str(row.epoch))
            assert (await ledger.finalize(self.job, "ds", self.written, 100, 0.95)).new == len(self.written)
            await ledger.r.aclose()

        asyncio.run(run())

    def _ledger(self) -> Ledger:
        client = aioredis.from_url(self.settings.redis_url)
        return Ledger(client, self.settings.keys, "w1", feed_max_len=self.feed_max_len)


def _drain(settings: Settings, job: str, cursor: feed.Cursor | None, batches: int | None = None, **kwargs: object):
    """follow() until it is idle (or ``batches`` batches with events were taken): the batches taken."""
    out: list[feed.FeedBatch] = []
    for batch in feed.follow(settings, job, cursor, block_s=0.1, **kwargs):  # type: ignore[arg-type]
        if batch is None:
            break
        out.append(batch)
        if batches is not None and sum(1 for b in out if b.events) >= batches:
            break
    return out


def _held(batches: list[feed.FeedBatch]) -> dict[str, tuple[int, int]]:
    return {e.prompt_id: (e.revision, e.epoch) for b in batches for e in b.events}


def _log_id(settings: Settings, job: str) -> str:
    return redis.Redis.from_url(settings.redis_url).hget(settings.keys.feed_log(job), "id").decode()


def test_follow_from_a_cursor_resumes_exactly_after_it(redis_url: str, tmp_path: Path) -> None:
    # Given 40 rows committed in 4 parts, read from the log's start 7 rows at a time, stopped after 3 batches.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    job = _Committer(settings, "rc")
    for _ in range(4):
        job.commit(10)
    start = feed.Cursor(_log_id(settings, "rc"), feed.START)
    head = _drain(settings, "rc", start, batches=3, max_rows=7)
    # When a new follow() starts from the last batch's cursor (through its JSON, as a caller keeps it).
    cursor = feed.Cursor.from_json(head[-1].cursor.to_json())
    tail = _drain(settings, "rc", cursor, max_rows=7)
    # Then the two together are the log, in its order, each entry once; and so are the rows.
    order = [i.decode() for i, _ in redis.Redis.from_url(redis_url).xrange(settings.keys.feed("rc"))]
    assert [e.seq for b in head + tail for e in b.events] == order
    assert [e.seq for b in head for e in b.events] == order[:21]
    ids = [p for b in head + tail for p in b.table[PROMPT_ID].to_pylist()]
    assert ids == [f"p-{i:05d}" for i in range(40)]
    # And the rows are the stored ones, byte for byte.
    view = reader.read_committed(settings.output_uri, "rc")
    assert pa.concat_tables([b.table for b in head + tail]).equals(view)


def test_a_reader_whose_log_was_lost_is_rebuilt_from_storage_less_what_it_holds(redis_url: str, tmp_path: Path) -> None:
    # Given a reader that took 15 of 30 committed rows from the log.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    keys = settings.keys
    client = redis.Redis.from_url(redis_url)
    job = _Committer(settings, "rl")
    job.commit(10)
    job.commit(10)
    job.commit(10)
    old = _log_id(settings, "rl")
    head = _drain(settings, "rl", feed.Cursor(old, feed.START), batches=3, max_rows=5)
    held = _held(head)
    assert len(held) == 15
    # When the log is lost (its keys deleted, as a Redis that restarted empty lost them) and 10 more rows commit.
    client.delete(keys.feed("rl"), keys.feed_log("rl"))
    job.commit(10)
    assert _log_id(settings, "rl") != old, "a new incarnation of the log"
    # Then follow() from the reader's cursor, told what it holds, gives every other committed row once.
    rest = _drain(settings, "rl", head[-1].cursor, given=lambda: held, max_rows=8)
    got = [e.prompt_id for b in rest for e in b.events]
    assert len(got) == len(set(got)) == 25
    assert set(got) | set(held) == {f"p-{i:05d}" for i in range(40)} and not set(got) & set(held)
    assert all(e.seq == "" for b in rest for e in b.events), "rebuilt from storage"
    # And its last cursor names the new log: a later row comes from the log, once.
    assert rest[-1].cursor.log == _log_id(settings, "rl")
    job.commit(3)
    more = _drain(settings, "rl", rest[-1].cursor)
    assert [e.prompt_id for b in more for e in b.events] == ["p-00040", "p-00041", "p-00042"]


def test_a_reader_ahead_of_the_log_is_rebuilt(redis_url: str, tmp_path: Path) -> None:
    # Given a reader that took 12 of 20 rows, and a Redis rolled back behind its cursor (a snapshot restored: the
    # log's last entry is below the reader's position).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    job = _Committer(settings, "rr")
    job.commit(20)
    log_id = _log_id(settings, "rr")
    head = _drain(settings, "rr", feed.Cursor(log_id, feed.START), batches=3, max_rows=4)
    held = _held(head)
    ahead = feed.Cursor(log_id, "99999999999999-0")
    # When it goes on from a position the log never reached, telling what it holds.
    rest = _drain(settings, "rr", ahead, given=lambda: held)
    # Then it is rebuilt from storage: the other 8 rows, once each, and its cursor is the log's end.
    assert sorted(e.prompt_id for b in rest for e in b.events) == sorted(
        set(f"p-{i:05d}" for i in range(20)) - set(held)
    )
    last = redis.Redis.from_url(redis_url).xrevrange(settings.keys.feed("rr"), count=1)[0][0].decode()
    assert rest[-1].cursor == feed.Cursor(log_id, last)


def test_a_reader_trimmed_away_is_rebuilt_and_trimming_waits_for_the_slowest_reader(
    redis_url: str, tmp_path: Path
) -> None:
    # Given 30 committed rows and two registered readers: slow took 10, fast took 25.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    keys = settings.keys
    client = redis.Redis.from_url(redis_url)
    job = _Committer(settings, "rt")
    job.commit(30)
    start = feed.Cursor(_log_id(settings, "rt"), feed.START)
    slow = _drain(settings, "rt", start, batches=2, max_rows=5, reader="slow")
    fast = _drain(settings, "rt", start, batches=5, max_rows=5, reader="fast")
    order = [i.decode() for i, _ in client.xrange(keys.feed("rt"))]
    # When both commit their positions.
    feed.commit(settings, "rt", "fast", fast[-1].cursor)
    assert client.xlen(keys.feed("rt")) == 30, "slow registered at the start: nothing goes"
    feed.commit(settings, "rt", "slow", slow[-1].cursor)
    # Then the log keeps every entry the slowest reader has not passed (its own last one too).
    assert [i.decode() for i, _ in client.xrange(keys.feed("rt"))] == order[9:]
    # When slow goes away and fast commits again: the log is trimmed past where slow stood.
    assert feed.forget(settings, "rt", "slow")
    feed.commit(settings, "rt", "fast", fast[-1].cursor)
    assert [i.decode() for i, _ in client.xrange(keys.feed("rt"))] == order[24:]
    # Then slow, back with its cursor and what it holds, is rebuilt from storage: every other row once.
    held = _held(slow)
    rest = _drain(settings, "rt", slow[-1].cursor, given=lambda: held, reader="slow")
    got = [e.prompt_id for b in rest for e in b.events]
    assert sorted(got) == sorted(set(f"p-{i:05d}" for i in range(30)) - set(held))
    assert rest[-1].cursor == feed.Cursor(start.log, order[-1])


def test_a_job_nobody_reads_keeps_its_log_under_the_cap(redis_url: str, tmp_path: Path) -> None:
    # Given a job whose log is capped at 50 entries, and no reader.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job = _Committer(settings, "cap", feed_max_len=50)
    # When 400 rows commit.
    for _ in range(8):
        job.commit(50)
    # Then the log holds about the cap (it is cut back to it past a tenth more), and names what it trimmed.
    length = client.xlen(settings.keys.feed("cap"))
    assert 50 <= length <= 55, length
    first = client.xrange(settings.keys.feed("cap"), count=1)[0][0]
    trimmed = client.hget(settings.keys.feed_log("cap"), "trimmed")
    assert feed.entry_id(trimmed.decode()) < feed.entry_id(first.decode())
    # And a reader from the log's start is rebuilt from storage: no row missing, none twice.
    got = [e.prompt_id for b in _drain(settings, "cap", feed.Cursor(_log_id(settings, "cap"))) for e in b.events]
    assert sorted(got) == [f"p-{i:05d}" for i in range(400)]


def test_finalize_orphan_names_the_rows_place_in_its_part(redis_url: str, tmp_path: Path) -> None:
    # Given a part of 3 rows written by a run that died before its finalize.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    writer = PartWriter(settings.output_uri, "w1")

    async def run() -> None:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, settings.keys, "w2")
        epoch = (await ledger.claim("or", "p-1")).epoch
        rows = [make_row(p, job="or", epoch=epoch if p == "p-1" else 1) for p in ("p-0", "p-1", "p-2")]
        part = writer.write("or", "ds", rows)
        committer = GroupCommitter(writer, ledger, 10, 0.05, 100, 0.95, lambda *a: None)
        # When the recovering run finalizes p-1 from it.
        done = await committer.finalize_orphan("or", "ds", part, FinalRow("p-1", 10, True, False, epoch=epoch))
        assert done.new == 1
        await client.aclose()

    asyncio.run(run())
    # Then its log entry names the part and the row's index in it.
    [(_, entry)] = _entries(redis.Redis.from_url(redis_url), settings.keys, "or")
    assert entry["row"] == "1" and entry["part"].endswith(".parquet")
    assert pq.read_table(entry["part"])[PROMPT_ID][1].as_py() == "p-1"


def test_purge_deletes_the_log_and_its_readers(redis_url: str, tmp_path: Path) -> None:
    # Given a job with a log and a registered reader.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    job = _Committer(settings, "pg")
    submit = submit_ids(settings, "pg", make_prompts(2, seed=3), max_new_tokens=8)  # a job record purge can find
    assert submit.name == "pg"
    job.commit(5)
    feed.commit(settings, "pg", "trainer", feed.Cursor(_log_id(settings, "pg"), feed.START))
    keys = settings.keys
    client = redis.Redis.from_url(redis_url)
    assert client.exists(keys.feed("pg"), keys.feed_log("pg"), keys.feed_readers("pg")) == 3
    # When the job is purged.
    purged = producer_cli(settings, "purge", "pg", "--force", in_process=True)
    assert purged.returncode == 0, purged.stderr
    # Then none of the log's keys is left, and a reader's late commit brings none back.
    log_keys = (keys.feed("pg"), keys.feed_log("pg"), keys.feed_readers("pg"), keys.committed_revisions("pg"))
    assert client.exists(*log_keys) == 0
    feed.commit(settings, "pg", "trainer", feed.Cursor("gone", "1-0"))
    assert client.exists(*log_keys) == 0


def test_a_rebuild_gives_finalized_rows_and_those_refilled_from_storage_never_a_row_not_finalized_yet(
    redis_url: str, tmp_path: Path
) -> None:
    # Given 10 finalized rows, 5 of them done with no finalize recorded (producer submit refilled them from storage
    # after a Redis loss), and 4 rows written whose finalize has not come yet.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    keys = settings.keys
    client = redis.Redis.from_url(redis_url)
    job = _Committer(settings, "rb")
    finalized = job.commit(10)
    client.hdel(keys.committed_epochs("rb"), *finalized[:5])
    pending = job.commit(4, finalize=False)
    # When a reader starts afresh (rebuilt from storage).
    rebuilt = _drain(settings, "rb", None)
    # Then it gets the 10 done rows, not the 4 in flight.
    assert sorted(e.prompt_id for b in rebuilt for e in b.events) == finalized
    # And the 4 arrive from the log once finalized, once each.
    job.finalize_written()
    later = _drain(settings, "rb", rebuilt[-1].cursor)
    assert [e.prompt_id for b in later for e in b.events] == pending


def test_rows_whose_parts_were_compacted_come_from_the_committed_view_and_a_superseded_one_not_at_all(
    redis_url: str, tmp_path: Path
) -> None:
    # Given 10 rows, 3 of them re-run as revision 1, and the job compacted (its parts replaced by one file holding
    # the committed view: the 3 revision-0 rows are gone from storage).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    job = _Committer(settings, "cp")
    pids = job.commit(10)
    job.commit(0, revise=pids[:3])
    compact_job(settings, "cp")
    named = {f["part"] for _, f in _entries(redis.Redis.from_url(redis_url), settings.keys, "cp")}
    assert len(named) == 2 and not any(Path(p).exists() for p in named), "both parts replaced"
    # When a reader goes through the log from its start.
    batches = _drain(settings, "cp", feed.Cursor(_log_id(settings, "cp")), max_rows=4)
    events = [e for b in batches for e in b.events]
    # Then it gets the committed view, each row once, and the revision-1 rows name the revision-0 rows they replace.
    view = reader.read_committed(settings.output_uri, "cp")
    assert sorted((e.prompt_id, e.revision) for e in events) == sorted(
        zip(view[PROMPT_ID].to_pylist(), view[REVISION].to_pylist(), strict=True)
    )
    assert {e.prompt_id for e in events if e.replaces is not None} == set(pids[:3])
    assert pa.concat_tables([b.table for b in batches]).sort_by(PROMPT_ID).equals(view.sort_by(PROMPT_ID))
