"""``producer export JOB --follow``: a running job's committed rows as rolling shards, each closed atomically.

The rows come from the job's feed (:mod:`storage.feed`: each committed row once, in log order) and are written by
the same exporters ``export`` uses (:mod:`storage.exports`), one shard at a time, into the ``--out`` directory:

- ``shard-000001.jsonl`` (``.parquet`` for eagle3, a ``save_to_disk`` directory for hf) — the format's rows;
- ``_follow/000001.json`` — the shard's sidecar: the feed cursor after it, every event it holds
  (``[prompt_id, revision, epoch, seq]``, also those a filter left out of the file) and its REPLACEMENTS
  (``{"id", "revision", "epoch", "replaces": [revision, epoch]}``: this prompt's row in an earlier shard is
  superseded; its current row, if it passed the filters, is in this shard).

A shard is written under a hidden name (``.partial-shard-…``), its sidecar is written (temp + rename), and only
then is the shard renamed to its name: a trainer globbing ``shard-*`` sees closed shards only, and the highest
closed shard's sidecar is the cursor. Killed at any instant, a restart removes a hidden leftover and a sidecar
whose shard was never renamed, and reads on from that cursor: no row lost, none repeated. Where the log cannot
go on from it (lost with its Redis, or trimmed), :func:`storage.feed.follow` rebuilds from storage, less what the
sidecars say is held (:meth:`ShardDir.given`). After each shard is durable its cursor is committed for the
``--reader`` (so the log is trimmed behind it).

Applying the output (:func:`current_ids`; docs/exports.md "Training while generating"): read the shards in order;
a shard's ``replaces`` drops that prompt's rows from EARLIER shards. Within one shard a prompt has one row.

It ends when the job is finished (``producer wait``'s condition, :func:`storage.feed.finished`) and the log is
drained, or after ``until_idle_s`` with nothing new. What it does not do: ``--merge-turns`` (a conversation's
turns arrive apart), an S3 ``--out`` (no atomic rename there), and the text formats of a ``--turns all`` job
write a later turn only when its earlier turns are in the same shard (they arrive apart too).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import redis

from storage import layout
from storage.exports.base import ExportError, ExportFormat, ExportOptions, ExportResult, Rows
from storage.schema import DATASET, PROMPT_ID, SCHEMA
from thinkfleet.settings import Settings

log = logging.getLogger(__name__)

#: What a sidecar says it is.
SIDECAR_KIND = "thinkfleet.export.follow/1"
#: The sidecars' directory inside ``--out`` (a leading ``_`` keeps it out of dataset readers of the directory).
STATE_DIR = "_follow"
#: Digits of the shard number: ``shard-000001``.
SHARD_DIGITS = 6
#: Rows per shard when ``--shard-rows`` is not given.
DEFAULT_SHARD_ROWS = 1000
#: A shard is closed at most this long after its first row arrived (``--shard-seconds``), so a trainer sees rows
#: soon on a slow job; also whenever the feed is idle for a poll.
DEFAULT_SHARD_S = 5.0
#: How long one poll of the feed waits for new entries before it reports idle (the end conditions are checked then).
POLL_S = 1.0
#: Most rows the feed hands over at once (never more than a shard's rows).
FEED_BATCH_ROWS = 512
#: How long the follower rides through a Redis that does not answer (a restart, a failover) before it gives up,
#: exiting non-zero; what it wrote stays, and a restart reads on from there.
REDIS_DOWN_MAX_S = 300.0
REDIS_RETRY_S = 1.0

_SHARD = re.compile(rf"^shard-(\d{{{SHARD_DIGITS}}})")
_SIDECAR = re.compile(rf"^(\d{{{SHARD_DIGITS}}})\.json$")
#: Hidden leftovers of a shard or sidecar being written when the process died.
_LEFTOVER = re.compile(rf"^\.+(partial-shard-|shard-|\d{{{SHARD_DIGITS}}}\.json\.tmp)")

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


@dataclass
class FollowResult:
    out: str
    format: str
    job: str
    rows: int = 0  # rows written into shards (after the filters)
    events: int = 0  # committed rows the feed gave (rows + those the filters left out)
    shards: int = 0  # shards closed by this run
    replacements: int = 0
    resumed_from: int = 0  # the highest shard found closed at start (0: a fresh directory)
    ended: str = ""  # "job finished" | "idle Ns"
    skipped: dict[str, int] = field(default_factory=dict)
    longest: int = 0
    over_max_length: int = 0
    max_length: int | None = None
    first_row_s: float | None = None  # seconds from start to the first shard closed by this run

    def summary(self) -> str:
        left = "".join(f", left out {n} ({k.replace('_', ' ')})" for k, n in self.skipped.items() if n)
        long = f", {self.over_max_length} rows > {self.max_length} tokens" if self.over_max_length else ""
        resumed = f", resumed after shard {self.resumed_from}" if self.resumed_from else ""
        return (
            f"followed {self.job}: {self.rows} rows ({self.format}) in {self.shards} new shards to {self.out}"
            f"{resumed}, {self.replacements} replacements{left}{long}; ended: {self.ended}"
        )


# -- the rows of one shard, through the exporters' filters -----------------------------------------------------
class ShardRows(Rows):
    """:class:`~storage.exports.base.Rows` over one shard's table instead of the committed view: the same filters
    (flags, reasoning length, datasets), dataset by dataset in log order within each."""

    def __init__(
        self, settings: Settings, job: str, table: pa.Table, options: ExportOptions, skipped: dict[str, int]
    ) -> None:
        super().__init__(
            settings, job, options.datasets, options.drop_truncated, options.min_reasoning_tokens, skipped,
            options.drop_flags,
        )  # fmt: skip
        self.table = table

    def names(self) -> list[str]:
        present = list(dict.fromkeys(self.table[DATASET].to_pylist()))
        return [d for d in present if d in self.datasets] if self.datasets else present

    def superseded(self) -> set[str]:
        # Turn rows past a chain end are known only with the whole job: a feed gives rows as they commit.
        return set()

    def committed(self, columns: list[str], datasets: list[str], **how: object) -> Iterator[pa.Table]:
        read = columns + [c for c in self._filter_columns() if c not in columns]
        mine = self.table.filter(pc.is_in(self.table[DATASET], pa.array(datasets, pa.string())))
        yield mine.select(read)


def last_per_prompt(table: pa.Table) -> pa.Table:
    """One row per prompt: a later revision given in the same shard replaces the earlier one there."""
    ids = table[PROMPT_ID].to_pylist()
    last = {pid: i for i, pid in enumerate(ids)}
    if len(last) == len(ids):
        return table
    return table.take(pa.array(sorted(last.values()), pa.int64()))


# -- the output directory -----------------------------------------------------------------------------------
class ShardDir:
    """``--out``: closed shards, their sidecars, and what a restart finds there."""

    def __init__(self, root: str, job: str, fmt: str, suffix: str) -> None:
        self.root, self.job, self.format, self.suffix = os.path.abspath(root), job, fmt, suffix
        self.state = os.path.join(self.root, STATE_DIR)

    def name(self, n: int) -> str:
        return f"shard-{n:0{SHARD_DIGITS}d}{self.suffix}"

    def sidecar_path(self, n: int) -> str:
        return os.path.join(self.state, f"{n:0{SHARD_DIGITS}d}.json")

    def recover(self) -> tuple[int, dict[str, Any] | None]:
        """Clean what a killed run left half-written; (the highest closed shard, its sidecar) — (0, None) when none.

        A shard is closed once renamed to its name; its sidecar was written before, so a sidecar without its shard
        is a close that did not finish: removed, and its rows are read again."""
        os.makedirs(self.state, exist_ok=True)
        for folder in (self.root, self.state):
            for entry in os.listdir(folder):
                if _LEFTOVER.match(entry):
                    _remove(os.path.join(folder, entry))
        closed = {int(m.group(1)) for e in os.listdir(self.root) if (m := _SHARD.match(e))}
        last, doc = 0, None
        for entry in sorted(os.listdir(self.state)):
            m = _SIDECAR.match(entry)
            if not m:
                continue
            n = int(m.group(1))
            if n not in closed:
                os.unlink(os.path.join(self.state, entry))
                continue
            side = self.read_sidecar(n)
            if side.get("job") != self.job or side.get("format") != self.format:
                raise ExportError(
                    f"--out {self.root} holds a follow of job {side.get('job')!r} in format {side.get('format')!r}, "
                    f"not {self.job!r} in {self.format!r}: choose another --out (or remove that one)"
                )
            if n > last:
                last, doc = n, side
        return last, doc

    def read_sidecar(self, n: int) -> dict[str, Any]:
        with open(self.sidecar_path(n), encoding="utf-8") as f:
            return json.load(f)

    def given(self) -> dict[str, tuple[int, int]]:
        """prompt_id → (revision, epoch) of the latest row the closed shards hold (given to the feed on a rebuild)."""
        held: dict[str, tuple[int, int]] = {}
        for n in self.closed():
            for pid, revision, epoch, _seq in self.read_sidecar(n)["rows"]:
                held[pid] = (int(revision), int(epoch))
        return held

    def closed(self) -> list[int]:
        """The closed shards' numbers, in order."""
        shards = {int(m.group(1)) for e in os.listdir(self.root) if (m := _SHARD.match(e))}
        sides = {int(m.group(1)) for e in os.listdir(self.state) if (m := _SIDECAR.match(e))}
        return sorted(shards & sides)

    def close(self, n: int, write: Callable[[str], None], sidecar: Callable[[], dict[str, Any]]) -> None:
        """Shard ``n``: ``write(path)`` writes it under a hidden name; then its sidecar (``sidecar()``, made once
        the rows are written); then the rename that closes it. Each step is fsynced, so a crash of the machine
        (not only of the process) keeps the order."""
        partial = os.path.join(self.root, f".partial-{self.name(n)}")
        _remove(partial)
        write(partial)
        _fsync_tree(partial)
        body = json.dumps(sidecar(), separators=(",", ":")).encode()
        side, tmp = self.sidecar_path(n), os.path.join(self.state, f".{n:0{SHARD_DIGITS}d}.json.tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, side)
        _fsync_dir(self.state)
        os.replace(partial, os.path.join(self.root, self.name(n)))  # the shard is closed from here on
        _fsync_dir(self.root)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        with open(p, "rb") as f:
            os.fsync(f.fileno())


# -- the follower -------------------------------------------------------------------------------------------
@dataclass
class FollowOptions:
    reader: str | None = None  # registered with the feed: the log is kept until this reader committed past it
    until_idle_s: float | None = None  # end after this long with nothing new (None: only when the job finished)
    shard_rows: int = DEFAULT_SHARD_ROWS
    shard_s: float = DEFAULT_SHARD_S
    poll_s: float = POLL_S


class Follower:
    """Reads the feed of ``job`` into shards of ``fmt`` under ``out`` until an end condition (:meth:`run`)."""

    def __init__(
        self,
        settings: Settings,
        job: str,
        exporter: ExportFormat,
        out: str,
        follow: FollowOptions,
    ) -> None:
        self.settings, self.job, self.exporter, self.opts = settings, job, exporter, follow
        self.dir = ShardDir(out, job, exporter.name, exporter.suffix)
        self.result = FollowResult(out=self.dir.root, format=exporter.name, job=job)
        self._given: dict[str, tuple[int, int]] | None = None  # the sidecars' rows, read once, then kept up to date
        self._pending: list[Any] = []  # FeedBatch objects not yet in a closed shard
        self._pending_rows = 0
        self._pending_since: float | None = None
        self._started = time.monotonic()
        self._down_since: float | None = None  # when Redis stopped answering (None: it answers)

    def run(self) -> FollowResult:
        from storage import feed

        last, doc = self.dir.recover()
        self.result.resumed_from = last
        self.next = last + 1
        self.cursor = feed.Cursor.from_json(json.dumps(doc["cursor"])) if doc else None
        while True:
            try:
                self.result.ended = self._follow()
                return self.result
            except REDIS_DOWN as exc:
                # Rows held and not yet in a closed shard are dropped: the log still has them (nothing was
                # committed past the last closed shard), or a rebuild gives them again.
                self._pending, self._pending_rows, self._pending_since = [], 0, None
                now = time.monotonic()
                self._down_since = self._down_since or now
                if now - self._down_since > REDIS_DOWN_MAX_S:
                    raise ExportError(
                        f"Redis at {self.settings.redis_url} did not answer for {REDIS_DOWN_MAX_S:.0f} s ({exc}); "
                        f"shards up to {self.next - 1} are closed: run the same command again to go on"
                    ) from exc
                log.warning("Redis does not answer (%s): following again in %.0f s", exc, REDIS_RETRY_S)
                time.sleep(REDIS_RETRY_S)

    def given(self) -> dict[str, tuple[int, int]]:
        """What the closed shards hold (:meth:`ShardDir.given`): read from the sidecars once, then kept up to date."""
        if self._given is None:
            self._given = self.dir.given()
        return dict(self._given)

    def _follow(self) -> str:
        from storage import feed
        from thinkfleet.redis_client import sync_client

        opts = self.opts
        with sync_client(self.settings.redis_url) as client:
            if not client.exists(self.settings.keys.job(self.job)):
                raise ExportError(
                    f"job {self.job!r} has no record in Redis: --follow reads a submitted job's commit log "
                    "(export a finished or purged job's stored rows without --follow)"
                )
        last_new = time.monotonic()
        finished_seen = False
        batches = feed.follow(
            self.settings, self.job, self.cursor, reader=opts.reader, given=self.given,
            max_rows=min(FEED_BATCH_ROWS, opts.shard_rows), block_s=opts.poll_s,
        )  # fmt: skip
        for batch in batches:
            now = time.monotonic()
            self._down_since = None  # the feed answered
            if batch is None:  # nothing new for a poll: close what is held, then the end conditions
                if self._pending:
                    self._close()
                if finished_seen:
                    return "job finished"
                # Finished now means every row is in the log: one more idle poll with nothing new, and all is read.
                finished_seen = feed.finished(self.settings, self.job)
                if opts.until_idle_s is not None and now - last_new >= opts.until_idle_s:
                    return f"idle {opts.until_idle_s:g}s"
                continue
            if not batch.events:
                continue
            last_new, finished_seen = now, False  # (rows came since: finished is asked again at the next idle poll)
            if self._pending_rows + len(batch.events) > opts.shard_rows:
                self._close()
            self._pending.append(batch)
            self._pending_rows += len(batch.events)
            self._pending_since = self._pending_since or now
            if self._pending_rows >= opts.shard_rows or now - self._pending_since >= opts.shard_s:
                self._close()
        return "feed ended"

    def _close(self) -> None:
        """The held batches → shard ``self.next``, closed; then its cursor committed for the reader."""
        from storage import feed

        batches, self._pending, self._pending_rows, self._pending_since = self._pending, [], 0, None
        events = [e for b in batches for e in b.events]
        cursor = batches[-1].cursor
        table = last_per_prompt(pa.concat_tables([b.table.select(SCHEMA.names) for b in batches]))
        replaces = [
            {"id": e.prompt_id, "revision": e.revision, "epoch": e.epoch, "replaces": list(e.replaces)}
            for e in events
            if e.replaces is not None
        ]
        part = ExportResult(path="", format=self.exporter.name, rows=0)
        n = self.next

        def write(path: str) -> None:
            rows = ShardRows(self.settings, self.job, table, self.exporter.options, part.skipped)
            self.exporter.write(part, layout.locate(path), rows)

        def sidecar() -> dict[str, Any]:
            return {
                "kind": SIDECAR_KIND,
                "job": self.job,
                "format": self.exporter.name,
                "shard": n,
                "file": self.dir.name(n),
                "cursor": json.loads(cursor.to_json()),
                "written": part.rows,  # rows in the file (the events less what the filters left out)
                "rows": [[e.prompt_id, e.revision, e.epoch, e.seq] for e in events],
                "replaces": replaces,
            }

        self.dir.close(n, write, sidecar)
        self.next, self.cursor = n + 1, cursor
        if self._given is not None:
            self._given.update((e.prompt_id, (e.revision, e.epoch)) for e in events)
        self._count(part, events, replaces)
        if self.opts.reader:
            feed.commit(self.settings, self.job, self.opts.reader, cursor)

    def _count(self, part: ExportResult, events: list[Any], replaces: list[dict[str, Any]]) -> None:
        r = self.result
        r.rows += part.rows
        r.events += len(events)
        r.shards += 1
        r.replacements += len(replaces)
        for reason, count in part.skipped.items():
            r.skipped[reason] = r.skipped.get(reason, 0) + count
        r.longest = max(r.longest, part.longest)
        r.over_max_length += part.over_max_length
        r.max_length = part.max_length
        if r.first_row_s is None:
            r.first_row_s = round(time.monotonic() - self._started, 3)


def follow_job(settings: Settings, job: str, fmt: str, out: str | None, options: ExportOptions,
               follow: FollowOptions) -> FollowResult:  # fmt: skip
    """``producer export JOB --follow``: check what was asked, then follow until an end condition."""
    from storage.exports import FORMATS
    from storage.exports.provenance import write_export_provenance

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if options.merge_turns:
        raise ExportError("--merge-turns cannot --follow: a conversation's turns arrive apart; export it when done")
    if options.push_to_hub:
        raise ExportError("--push-to-hub cannot --follow: push the finished export instead")
    exporter = FORMATS[fmt](options)
    exporter.check()
    out = out or f"{job}-{fmt}"
    if "://" in out:
        raise ExportError(f"--follow writes a local directory (closed by atomic renames), not {out!r}")
    if os.path.isfile(out):
        raise ExportError(f"--out {out} is a file: --follow writes a directory of shards")
    if follow.shard_rows < 1:
        raise ExportError(f"--shard-rows must be at least 1, got {follow.shard_rows}")
    result = Follower(settings, job, exporter, out, follow).run()
    # Beside the shards, as every export: where its rows came from (storage/exports/provenance.py).
    done = ExportResult(path=result.out, format=fmt, rows=result.rows, skipped=dict(result.skipped))
    write_export_provenance(settings, job, layout.locate(result.out), done, options)
    return result


# -- reading the output ---------------------------------------------------------------------------------------
def current_ids(out: str) -> dict[str, int]:
    """prompt_id → the shard holding its current row, with every shard's replacements applied (what a trainer
    keeps; a prompt replaced by a row the filters left out is in none)."""
    where: dict[str, int] = {}
    shard_dir = ShardDir(out, "", "", "")
    for n in shard_dir.closed():
        side = shard_dir.read_sidecar(n)
        for replaced in side["replaces"]:
            where.pop(replaced["id"], None)
        for pid, *_ in side["rows"]:
            where[pid] = n
    return where
