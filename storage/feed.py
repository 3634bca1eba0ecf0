"""The feed: each committed row of a running job, once, in the order Redis committed them — for a trainer that reads
while the fleet generates (``producer export --follow``, storage/follow.py).

Where the order comes from: ``finalize`` (thinkfleet/state/lua/finalize.lua) appends one entry to the job's commit
log (``Keys.feed``, a Redis stream) for every row it moves into done, in the same atomic step — the prompt, the
row's revision and epoch, the part's URI and the row's index in it, and for a later row of a prompt (``producer
retry --truncated``) the ``revision:epoch`` of the row it replaces. A fenced or superseded row is never finalized,
so it is never in the log. The row itself is read from the part the entry names (the committed view when that part
was compacted away).

Where a reader stands: a :class:`Cursor` — the log's incarnation and the last entry given. The caller keeps it with
its output and, once that output is durable, records it with :func:`commit`, which trims the log behind the
slowest registered reader (``Keys.feed_readers``); ``feed_max_len`` caps the log whoever reads it.

When the log cannot say what came after a cursor — the log was lost (Redis restarted empty, a FLUSH: a new
incarnation), trimmed past it, or rolled back behind it (a restored snapshot) — or the reader starts with no cursor,
the reader is *rebuilt* from storage: the committed view (storage/stream.py, bounded memory) less what ``given()``
says the caller already holds, each row that differs as a replacement, then the live log from where it stood
before the view was read (a row committed meanwhile arrives once: within one :func:`follow` call nothing is given
twice at the same or a lower (revision, epoch)). While Redis still knows which row of a prompt it finalized
(``committed_epochs``), the rebuild gives only that row (or, for a prompt ``producer submit`` marked done again from
storage after a Redis loss, the stored one): a row written but not finalized yet arrives with its log entry.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import redis

from storage import layout, listing, quarantine, reader, stream
from storage.schema import EPOCH, PROMPT_ID, REVISION, SCHEMA
from thinkfleet.redis_client import SOCKET_TIMEOUT_S, sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.scripts import lua

log = logging.getLogger("thinkfleet.feed")

#: A cursor's ``seq`` before the first entry.
START = "0-0"
#: A cursor's ``log`` for "the log that comes next, from its start" (a rebuild found no log: none was written since).
NEXT_LOG = ""
#: A cursor's ``log`` that names no log (the middle of a rebuild): a reader restarted with it is rebuilt again.
REBUILDING = "rebuilding"
#: Rows of the committed view :func:`follow` reads at once in a rebuild (then handed on ``max_rows`` at a time).
REBUILD_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Cursor:
    log: str  # the log's incarnation id (a new one when the log was lost and started again)
    seq: str = START  # last entry given ("0-0" = none)

    def to_json(self) -> str:
        return json.dumps({"log": self.log, "seq": self.seq})

    @classmethod
    def from_json(cls, text: str) -> Cursor:
        doc = json.loads(text)
        return cls(str(doc["log"]), str(doc.get("seq") or START))


@dataclass(frozen=True)
class FeedEvent:
    seq: str  # the log entry's id (Redis stream id "ms-n"); "" for a row a rebuild read from storage
    prompt_id: str
    revision: int
    epoch: int
    replaces: tuple[int, int] | None  # (revision, epoch) of the row of this prompt given before, else None


@dataclass
class FeedBatch:
    events: list[FeedEvent]  # in log order (a rebuild's: prompt_id order)
    table: pa.Table  # the rows, storage.schema.SCHEMA columns, one per event, same order
    cursor: Cursor  # the position after this batch (give it to commit() once the output is durable)


class FeedError(RuntimeError):
    """The log names a row that storage holds nowhere (its part gone or damaged, and not in the committed view)."""


def entry_id(seq: str) -> tuple[int, int]:
    """A stream id ``ms-n`` as a pair that orders like the stream does."""
    ms, _, n = seq.partition("-")
    return int(ms or 0), int(n or 0)


def _client(settings: Settings, block_s: float = 0.0) -> redis.Redis:
    """A client whose reads outwait a blocking read of ``block_s``."""
    return sync_client(settings.redis_url, timeout_s=max(SOCKET_TIMEOUT_S, block_s + SOCKET_TIMEOUT_S))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class _Look:
    """One atomic read of the log: its incarnation, how far it was trimmed and written, and the entries after a
    position."""

    log: str | None  # None: no log (never written, or lost)
    trimmed: str  # the highest id trimmed away ("0-0": none)
    last: str  # the highest id ever written
    entries: list[tuple[str, dict[str, str]]]

    def stale(self, pos: Cursor | None) -> bool:
        """Can the log not say what came after ``pos``? (None: a reader with no cursor is always rebuilt.)"""
        if pos is None or pos.log == REBUILDING:
            return True
        if pos.log == NEXT_LOG:  # the log that came next, from its start: stale only if it lost entries already
            return self.log is not None and entry_id(self.trimmed) > (0, 0)
        if self.log != pos.log:
            return True
        return entry_id(self.trimmed) > entry_id(pos.seq) or entry_id(pos.seq) > entry_id(self.last)


def _look(r: redis.Redis, settings: Settings, job: str, after: str, count: int) -> _Look:
    keys = settings.keys
    with r.pipeline(transaction=True) as p:
        p.hgetall(keys.feed_log(job))
        p.xinfo_stream(keys.feed(job))
        p.xrange(keys.feed(job), min=f"({after}" if after != START else "-", count=count)
        record, info, entries = p.execute(raise_on_error=False)
    for result in (record, entries):
        if isinstance(result, Exception):
            raise result
    if isinstance(info, Exception):  # no stream: nothing written since the log (if any) was lost
        info = {}
    record = {_text(k): _text(v) for k, v in record.items()}
    return _Look(
        record.get("id"),
        record.get("trimmed", START),
        _text(info.get("last-generated-id") or START),
        [(_text(i), {_text(k): _text(v) for k, v in fields.items()}) for i, fields in entries],
    )


def follow(
    settings: Settings,
    job: str,
    cursor: Cursor | None = None,
    *,
    reader: str | None = None,
    given: Callable[[], Mapping[str, tuple[int, int]]] | None = None,
    max_rows: int = 512,
    block_s: float = 1.0,
) -> Iterator[FeedBatch | None]:
    """Yields batches of committed rows after `cursor` (None = from the start), and None each time the log has
    nothing new for block_s (so the caller can check its end conditions: job finished, idle time). A reader whose
    cursor is from another incarnation of the log, or was trimmed away, is rebuilt from storage: the committed view
    minus what `given()` says it already holds (prompt_id -> (revision, epoch)), as replacement events where the
    committed row differs, then the live log from its current end. `reader` registers the name so trimming waits
    for it (its position is what commit() recorded).

    A batch may hold no events: the end of a rebuild that found nothing new moves the cursor. Redis errors are
    raised (start again from the last cursor)."""
    r = _client(settings, block_s)
    keys = settings.keys
    # What the caller holds: given() at the start, then every row yielded here. A log entry at or below it is not
    # given again (a finalize Redis lost and a worker made again appends its row twice).
    held: dict[str, tuple[int, int]] = {pid: (int(a), int(b)) for pid, (a, b) in (given() if given else {}).items()}
    authoritative = given is not None  # `held` knows what the caller had before (else the log's `replaces` tells)
    try:
        if reader:
            _position(r, settings, job, reader, cursor or Cursor(NEXT_LOG), "register")
        pos = cursor
        parts = _Parts(settings, job)
        while True:
            look = _look(r, settings, job, pos.seq if pos is not None and pos.log != REBUILDING else START, max_rows)
            if look.stale(pos):
                pos = yield from _rebuild(r, settings, job, pos, held, max_rows)
                authoritative = True
                continue
            assert pos is not None
            if pos.log == NEXT_LOG and look.log is not None:
                pos = Cursor(look.log, pos.seq)
            if not look.entries:
                # wait for an entry after pos (XREAD BLOCK waits for the stream to be made too), then read it atomically
                got = r.xread({keys.feed(job): pos.seq}, count=1, block=max(1, int(block_s * 1000)))
                if not got:
                    yield None
                continue
            batch = _live_batch(look.entries, pos.log, parts, held, authoritative)
            pos = batch.cursor
            if batch.events:
                yield batch
    finally:
        r.close()


@dataclass(frozen=True)
class _Entry:
    """One log entry, read."""

    seq: str
    prompt_id: str
    revision: int
    epoch: int
    replaces: tuple[int, int] | None  # what the log says the row replaces
    part: str
    row: int  # -1: not known

    @property
    def key(self) -> tuple[int, int]:
        return self.revision, self.epoch

    @classmethod
    def of(cls, seq: str, f: dict[str, str]) -> _Entry:
        rev_was, _, epoch_was = f.get("replaces", "").partition(":")
        replaces = (int(rev_was), int(epoch_was)) if epoch_was else None
        row = int(f["row"]) if f.get("row") else -1
        return cls(
            seq, f["prompt_id"], int(f.get("revision") or 0), int(f.get("epoch") or 0), replaces, f.get("part", ""), row
        )


def _live_batch(
    entries: list[tuple[str, dict[str, str]]],
    incarnation: str,
    parts: _Parts,
    held: dict[str, tuple[int, int]],
    authoritative: bool,
) -> FeedBatch:
    # the entries not given yet (a row given already, or one of a prompt given at a higher (revision, epoch), is not)
    fresh: list[_Entry] = []
    seen: dict[str, tuple[int, int]] = {}
    for seq, f in entries:
        e = _Entry.of(seq, f)
        before = seen.get(e.prompt_id) or held.get(e.prompt_id)
        if before is None or e.key > before:
            fresh.append(e)
            seen[e.prompt_id] = e.key
    kept, table = parts.rows(fresh)
    events: list[FeedEvent] = []
    for e in kept:
        before = held.get(e.prompt_id)
        replaces = before if before is not None or authoritative else e.replaces
        events.append(FeedEvent(e.seq, e.prompt_id, e.revision, e.epoch, replaces))
        held[e.prompt_id] = e.key
    return FeedBatch(events, table, Cursor(incarnation, entries[-1][0]))


class _Parts:
    """Reads the rows log entries name from their parts (the last part read is kept: a group commit's rows come
    together), falling back to the committed view for a part compacted away."""

    def __init__(self, settings: Settings, job: str) -> None:
        self.settings = settings
        self.job = job
        self.loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
        self._cached: tuple[str, pa.Table | None] | None = None

    def _part(self, uri: str) -> pa.Table | None:
        """The part's rows, or None when it is gone (compacted) or damaged (quarantined by the read)."""
        if self._cached is not None and self._cached[0] == uri:
            return self._cached[1]
        table: pa.Table | None = None
        if uri:
            try:
                table = quarantine.read_checked(self.loc, self.loc.path(uri))
            except (quarantine.PartVanished, FileNotFoundError):
                table = None
        self._cached = (uri, table)
        return table

    def rows(self, entries: list[_Entry]) -> tuple[list[_Entry], pa.Table]:
        """The entries whose rows storage holds, and those rows in their order. An entry whose part is gone and whose
        row the committed view no longer holds because a later row of its prompt won there (a compaction keeps only
        the winners) is left out: that later row's entry comes after it."""
        found: list[tuple[pa.Table, int] | None] = []
        for e in entries:
            part = self._part(e.part)
            n = _find(part, e, e.row) if part is not None else None
            found.append(None if n is None else (part, n))  # type: ignore[arg-type]
        if any(f is None for f in found):
            view = self._committed([e.prompt_id for e, f in zip(entries, found, strict=True) if f is None])
            for i, e in enumerate(entries):
                if found[i] is None:
                    found[i] = self._in_view(view, e)
        kept = [e for e, f in zip(entries, found, strict=True) if f is not None]
        # runs of rows from one table, taken at once
        runs: list[pa.Table] = []
        run_table: pa.Table | None = None
        run_rows: list[int] = []
        for f in found:
            if f is None:
                continue
            if run_table is not f[0] and run_rows:
                runs.append(run_table.take(run_rows))  # type: ignore[union-attr]
                run_rows = []
            run_table = f[0]
            run_rows.append(f[1])
        if run_rows:
            runs.append(run_table.take(run_rows))  # type: ignore[union-attr]
        if not runs:
            return kept, SCHEMA.empty_table()
        return kept, pa.concat_tables([t.select(SCHEMA.names).cast(SCHEMA) for t in runs])

    def _in_view(self, view: pa.Table, e: _Entry) -> tuple[pa.Table, int] | None:
        n = _find(view, e, -1)
        if n is not None:
            return view, n
        rows = pc.indices_nonzero(pc.equal(view[PROMPT_ID], e.prompt_id)).to_pylist()
        if rows and (int(view[REVISION][rows[0]].as_py() or 0), int(view[EPOCH][rows[0]].as_py() or 0)) > e.key:
            return None  # superseded since, and compacted away
        raise FeedError(
            f"{self.job}/{e.prompt_id} (revision {e.revision}, epoch {e.epoch}) is committed in part {e.part!r} row "
            f"{e.row}, which storage does not hold, nor the committed view: run `producer verify {self.job}`"
        )

    def _committed(self, prompt_ids: list[str]) -> pa.Table:
        view = reader.read_committed(self.settings.output_uri, self.job, s3_endpoint_url=self.settings.s3_endpoint_url)
        return view.filter(pc.is_in(view[PROMPT_ID], value_set=pa.array(prompt_ids, pa.string())))


def _find(table: pa.Table, event: _Entry, row: int) -> int | None:
    """The index of ``event``'s row in ``table`` (``row`` first, when it is that row), else None."""

    def at(n: int) -> bool:
        return (
            table[PROMPT_ID][n].as_py() == event.prompt_id
            and int(table[REVISION][n].as_py() or 0) == event.revision
            and int(table[EPOCH][n].as_py() or 0) == event.epoch
        )

    if 0 <= row < table.num_rows and at(row):
        return row
    for n in pc.indices_nonzero(pc.equal(table[PROMPT_ID], event.prompt_id)).to_pylist():
        if at(n):
            return int(n)
    return None


def _rebuild(
    r: redis.Redis,
    settings: Settings,
    job: str,
    pos: Cursor | None,
    held: dict[str, tuple[int, int]],
    max_rows: int,
) -> Iterator[FeedBatch]:
    """The committed view less what is held, as batches; returns the cursor the live log goes on from (its end
    before the view was read: a row committed meanwhile is in the log after it, and given once)."""
    keys = settings.keys
    end = _look(r, settings, job, START, 1)
    resume = Cursor(end.log, end.last) if end.log is not None else Cursor(NEXT_LOG, START)
    # Until the last batch, the caller's cursor stays one that is rebuilt again (what it wrote meanwhile is given()).
    waiting = Cursor(REBUILDING, START)
    known = bool(r.exists(keys.committed_epochs(job)))  # Redis still knows which row of each prompt it finalized
    log.info("feed of %s: rebuilding from storage (cursor %s, log now %s)", job, pos, end.log)
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    pending: tuple[list[FeedEvent], pa.Table] | None = None
    started = time.monotonic()
    given_n = 0
    if _has_storage(settings, job):
        for table in stream.committed_batches(
            loc, job, SCHEMA.names, memory_bytes=stream.memory_bytes_of(settings), batch_bytes=REBUILD_BATCH_BYTES
        ):
            table = _keep(r, settings, job, table, held, known)
            for start in range(0, table.num_rows, max_rows):
                chunk = table.slice(start, max_rows)
                events = _rebuilt_events(chunk, held)
                if pending is not None:
                    yield FeedBatch(pending[0], pending[1], waiting)
                pending = (events, chunk.select(SCHEMA.names).cast(SCHEMA))
                given_n += len(events)
    log.info("feed of %s: rebuilt %d row(s) from storage in %.1f s", job, given_n, time.monotonic() - started)
    if pending is not None:
        yield FeedBatch(pending[0], pending[1], resume)
    else:
        yield FeedBatch([], SCHEMA.empty_table(), resume)
    return resume


def _has_storage(settings: Settings, job: str) -> bool:
    return listing.job_has_storage(settings.output_uri, job, settings.s3_endpoint_url)


def _keep(
    r: redis.Redis, settings: Settings, job: str, table: pa.Table, held: dict[str, tuple[int, int]], known: bool
) -> pa.Table:
    """Of a batch of the committed view: the rows the caller does not hold at that (revision, epoch) or above, and
    (while Redis ``known``s which row of each prompt it finalized) only the row it finalized — or, for a prompt done
    with no finalize recorded (``producer submit`` refilled it from storage after a Redis loss), the stored one. A row
    written and not finalized yet comes with its log entry."""
    pids = table[PROMPT_ID].to_pylist()
    revs = [int(v or 0) for v in table[REVISION].to_pylist()]
    eps = [int(v or 0) for v in table[EPOCH].to_pylist()]
    recorded: list[Any] = [None] * len(pids)
    done: list[Any] = [True] * len(pids)
    if known and pids:
        with r.pipeline(transaction=False) as p:
            p.hmget(settings.keys.committed_epochs(job), pids)
            p.smismember(settings.keys.done(job), pids)
            recorded, done = p.execute()
    mask = []
    for pid, rev, ep, rec, is_done in zip(pids, revs, eps, recorded, done, strict=True):
        before = held.get(pid)
        fresh = before is None or (rev, ep) > before
        finalized = int(rec) == ep if rec is not None else bool(is_done)
        mask.append(fresh and finalized)
    return table.filter(pa.array(mask, pa.bool_()))


def _rebuilt_events(chunk: pa.Table, held: dict[str, tuple[int, int]]) -> list[FeedEvent]:
    events = []
    for pid, rev, ep in zip(
        chunk[PROMPT_ID].to_pylist(), chunk[REVISION].to_pylist(), chunk[EPOCH].to_pylist(), strict=True
    ):
        row = (int(rev or 0), int(ep or 0))
        events.append(FeedEvent("", pid, row[0], row[1], held.get(pid)))
        held[pid] = row
    return events


def commit(settings: Settings, job: str, reader: str, cursor: Cursor) -> None:
    """Record `reader`'s position in Redis (after the caller made its output durable) and trim the log behind the
    slowest registered reader."""
    with _client(settings) as r:
        _position(r, settings, job, reader, cursor, "commit")


def _position(r: redis.Redis, settings: Settings, job: str, reader: str, cursor: Cursor, mode: str) -> int:
    """feed_commit.lua: register ``reader`` at ``cursor`` (mode ``register``: only when it is not registered yet), or
    record it there and trim the log behind the slowest reader (``commit``). Returns the entries trimmed."""
    keys = settings.keys
    script = r.register_script(lua("feed_commit"))
    return int(
        script(
            keys=[keys.feed_readers(job), keys.feed(job), keys.feed_log(job), keys.job(job)],
            args=[reader, cursor.log, cursor.seq, mode],
        )
    )


def forget(settings: Settings, job: str, reader: str) -> bool:
    """Unregister `reader` (it reads no more): the log is no longer kept for it. True when it was registered."""
    with _client(settings) as r:
        return bool(r.hdel(settings.keys.feed_readers(job), reader))


def finished(settings: Settings, job: str) -> bool:
    """producer wait's end condition for the job (re-use producer's own function; do not re-derive it): every prompt
    stored or dead-lettered by the counters (``StatusReader.read``'s ``finished``), and for a ``--turns all`` job no
    stored chain stopped before a turn nobody enqueued (``confirm_chains``, as ``wait`` asks storage)."""
    from producer.status import StatusReader, confirm_chains

    with _client(settings) as client:
        st = StatusReader(client, settings, job).read()
        if not st.get("finished"):
            return False
        return not (st.get("conversations") and confirm_chains(settings, job, client))
