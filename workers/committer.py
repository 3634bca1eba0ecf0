"""Group commit: rows from many concurrent requests go into one Parquet part.

A finished request hands its row here and waits; every ``flush_interval_s`` the pending rows are
written as one part per (job, dataset), committed atomically, marked done in Redis, and only then are
their tasks released to acknowledge their messages.

A waiting row holds a pool thread (not a request slot), so a flush also starts early once
``max_pending`` rows wait — three quarters of the thread headroom beyond the in-flight bound — and at ``flush_rows``.
Slow real servers (a row every few seconds) thus get few, large parts; a fast simulator never
starves the pool.

Errors are split by kind (:func:`io_fault`, :func:`data_fault`), so that an error ends only what caused it:

- an I/O error (storage: OSError, pyarrow/fsspec I/O; Redis) is retried with backoff, rows kept in memory, and
  ``on_storage(False, exc)`` closes the worker's consuming gate until a commit succeeds again
  (``on_storage(True, None)``) — the storage gate ``producer status`` names;
- a row that cannot be encoded is split off before the write (:class:`BadRow`) and its neighbours land;
- a hook (next-turn render, tool planning, serialisation) that raises anything else is a row's fault, never the
  gate's: a data error (TypeError, ValueError, a template's error, …) at once, an unknown one after
  :data:`UNKNOWN_ERROR_ATTEMPTS` tries, the group is committed row by row and the row whose own hooks still raise
  ends as :class:`RowFailed` (dead-lettered ``commit_hook`` with the error's last line) while the others commit.

:meth:`GroupCommitter.progress` says what waits and since when (workers/stall.py publishes it with the heartbeat).

Post-commit hooks (workers/hooks.py, multi-turn chaining among them) are asked once per group, before its part is
written, for their columns and for what the rows' finalize writes in its own Lua call (the next turn's message:
exactly once, with the row's ``done``); :meth:`GroupCommitter.finalize_orphan` asks them the same for a row an
earlier run committed and never finalized.

Fencing (thinkfleet/state/ledger.py): just before each write attempt ``mark_part`` checks that every row's
claim is still ours at its epoch; rows taken over meanwhile (this worker was paused past its lease) are not
written, and ``finalize`` refuses any that slipped through — both end as :class:`Fenced`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from storage import quarantine
from storage.layout import confine_part
from storage.writer import PartWriter
from thinkfleet.failpoints import failpoint
from thinkfleet.state.ledger import Fence, Finalized, FinalRow, Ledger
from thinkfleet.state.recent import Recent
from workers.commit_faults import UNKNOWN_ERROR_ATTEMPTS, CommitProgress, RowFailed, data_fault, io_fault
from workers.hooks import CommitGroup, FinalizeWrites, PostCommitHooks, StoredRow
from workers.outcomes import crash_summary

__all__ = ["BadRow", "Fenced", "GroupCommitter", "RowFailed", "StorageUnavailable"]

#: How many finalized rows a worker remembers for :meth:`GroupCommitter.replay` (a few hundred bytes each).
RECENT_FINALIZES = 20_000
#: A part's size target (the ``part_target_bytes`` setting's default): a flush starts once this much waits, and a
#: larger group is written as several parts — long outputs with logprobs make 512-row parts of GBs otherwise.
DEFAULT_PART_TARGET_BYTES = 64 << 20


def row_bytes(row: dict[str, Any]) -> int:
    """About what a row adds to its part: 4 bytes an id, logprobs included (their top-K ids and values: 8 a pair)."""

    def n(key: str) -> int:
        value = row.get(key)  # a list, a numpy array (no truth value) or None
        return 0 if value is None else len(value)

    top = row.get("top_logprob_ids")
    width = len(top[0]) if top is not None and len(top) else 0
    return 256 + 4 * (n("input_ids") + n("output_ids")) + 4 * n("output_logprobs") * (1 + 2 * width)


log = logging.getLogger(__name__)


class StorageUnavailable(Exception):
    """A commit gave up (only while draining): hand the prompt back."""


class Fenced(Exception):
    """The row's claim was taken over by another run (its epoch is not ours any more): never stored or counted
    by this run; the message is acked as ``fenced``."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"claim now held by {holder}")
        self.holder = holder


class BadRow(Exception):
    """The row cannot be encoded into the schema (an id outside int32, a count that contradicts the ids): a
    fault of the answer, not of storage; it never joins a part."""


@dataclass
class _Pending:
    job: str
    dataset: str
    row: dict[str, Any]
    final: FinalRow
    future: asyncio.Future[str] = field(repr=False)  # the part that holds the row
    size: int = 0  # row_bytes(row): what it adds to its part
    at: float = field(default_factory=time.monotonic)  # when it was handed to the committer


class GroupCommitter:
    def __init__(
        self,
        writer: PartWriter,
        ledger: Ledger,
        flush_rows: int,
        flush_interval_s: float,
        alarm_min_rows: int,
        alarm_share: float,
        on_alarm: Callable[[str, int, int], Any],
        on_flush: Callable[[int, float], None] = lambda rows, seconds: None,
        max_pending: int | None = None,
        on_storage: Callable[[bool, Exception | None], None] = lambda ok, exc: None,
        retry_max_s: float = 30.0,
        hooks: PostCommitHooks | None = None,
        part_target_bytes: int = DEFAULT_PART_TARGET_BYTES,
    ) -> None:
        self.writer = writer
        self.part_target_bytes = part_target_bytes
        self._pending_bytes = 0
        self.ledger = ledger
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.early_flush_rows = max(1, min(flush_rows, max_pending or flush_rows))
        self.alarm_min_rows = alarm_min_rows
        self.alarm_share = alarm_share
        self.on_alarm = on_alarm
        self.on_flush = on_flush
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.on_storage = on_storage
        self.retry_max_s = retry_max_s
        self._giving_up = False
        self._retry_now = asyncio.Event()
        self.hooks = hooks or PostCommitHooks()
        #: (job, prompt id) → (dataset, part, final row, its fence) of the rows this process finalized last: what
        #: :meth:`replay` finalizes again when Redis lost that finalize (a rollback) along with the message.
        self._recent: Recent[tuple[str, str], tuple[str, str, FinalRow, Fence]] = Recent(RECENT_FINALIZES)
        # What :meth:`progress` reports: the batch being committed, the last success, the failure and attempt now.
        self._flushing: list[_Pending] = []
        self._committed_at = time.monotonic()
        self._failing: tuple[str, bool] | None = None
        self._attempt_at: float | None = None

    def progress(self) -> CommitProgress:
        """What waits to commit and since when, and what the commit now fails with (workers/stall.py)."""
        now = time.monotonic()
        waiting = [i for i in (*self._flushing, *self._pending) if not i.future.done()]
        oldest = min((i.at for i in waiting), default=None)
        failing, io = self._failing or (None, False)
        return CommitProgress(
            len(waiting),
            None if oldest is None else now - oldest,
            now - self._committed_at,
            failing,
            io,
            None if self._attempt_at is None else now - self._attempt_at,
        )

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="group-commit")

    async def commit(self, job: str, dataset: str, row: dict[str, Any], final: FinalRow) -> str:
        """The part holding the row, once it is durably stored and marked done. While storage fails it keeps
        waiting (the commit is retried); raises :class:`StorageUnavailable` only when a drain gives up."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(job, dataset, row, final, future, row_bytes(row)))
        self._pending_bytes += self._pending[-1].size
        self._wake.set()
        if len(self._pending) >= self.early_flush_rows or self._pending_bytes >= self.part_target_bytes:
            self._urgent.set()
        return await future

    def flush_soon(self) -> None:
        """Drain: don't wait for the interval."""
        self._urgent.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            try:
                async with asyncio.timeout(self.flush_interval_s):
                    await self._urgent.wait()
            except TimeoutError:
                pass
            self._urgent.clear()
            take = self._within_target(self._pending[: self.flush_rows])
            batch, self._pending = self._pending[:take], self._pending[take:]
            self._pending_bytes -= sum(i.size for i in batch)
            if not self._pending:
                self._wake.clear()
            elif len(self._pending) >= self.early_flush_rows or self._pending_bytes >= self.part_target_bytes:
                self._urgent.set()
            if batch:
                self._flushing = batch
                try:
                    await self._flush(batch)
                except Exception as exc:
                    # Our own bug: the task must outlive it (every later commit waits on it) and the batch's
                    # prompts are handed back through their runs' crash path, never left waiting forever.
                    log.exception("group commit of %d rows failed unexpectedly: their prompts go back", len(batch))
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(exc)
                finally:
                    self._flushing, self._attempt_at = [], None

    def _within_target(self, items: list[_Pending]) -> int:
        """How many of ``items`` (at least one) stay within the part size target."""
        total = 0
        for n, item in enumerate(items):
            total += item.size
            if total > self.part_target_bytes and n:
                return n
        return len(items)

    async def _flush(self, batch: list[_Pending]) -> None:
        groups: dict[tuple[str, str], list[_Pending]] = defaultdict(list)
        for item in batch:
            groups[(item.job, item.dataset)].append(item)
        for (job, dataset), items in groups.items():
            await self._commit_group(job, dataset, items)

    async def _commit_group(self, job: str, dataset: str, items: list[_Pending], hook_tries: int = 0) -> None:
        """Encode → mark (the fence) → write → finalize, retried with backoff until it succeeds: finished
        generations are never thrown away while this worker lives. The part keeps its name across retries, so a
        write that landed before an error (the ambiguous commit) is found and only finalized, not repeated.
        A hook error that is not I/O is a row's (:meth:`_hooks_failed`); ``hook_tries``: what a split group's rows
        had already tried."""
        started = time.perf_counter()
        part = self.writer.part_name(job, dataset)
        # The fences the rows run under (the finalize drops them): kept with the rows this process remembers.
        fences = {i.final.prompt_id: self.ledger.fence(job, i.final.prompt_id) for i in items}
        written = False
        encoded: memoryview | None = None
        finalized: Finalized | None = None
        asked = False  # the hooks, once per group: their columns and finalize writes stand across retries
        writes: FinalizeWrites | None = None
        failures = 0
        while True:
            self._attempt_at = time.monotonic()
            try:
                if not asked:
                    try:
                        writes = await self.hooks.before_write(CommitGroup(job, dataset, [i.row for i in items]))
                    except Exception as exc:
                        if io_fault(exc):
                            raise
                        hook_tries += 1
                        if await self._hooks_failed(job, dataset, items, exc, hook_tries):
                            return  # ended, or committed row by row
                        continue
                    asked = True
                if encoded is None:
                    items, encoded = await self._encode(job, dataset, items)
                    if not items:
                        break  # every row was refused
                if not written and not (failures and await asyncio.to_thread(self.writer.exists, part)):
                    fenced = await self.ledger.mark_part(job, [i.final.prompt_id for i in items], part)
                    failpoint("after_mark")
                    if fenced:  # paused past our lease: those rows are another run's now
                        items = self._fenced(job, items, fenced)
                        if items:
                            items, encoded = await self._encode(job, dataset, items)
                    if not items:
                        break  # every row is fenced
                    failpoint("before_part_write")
                    await asyncio.to_thread(self.writer.write_encoded, job, dataset, encoded, part)
                written = True
                failpoint("after_part_write")
                if finalized is None:
                    # each row's place, for the commit log entry its finalize appends (storage/feed.py): the items
                    # are the part's rows in order
                    for n, item in enumerate(items):
                        item.final = replace(item.final, part=part, row_index=n)
                    finalized = await self._finalize(job, dataset, [i.final for i in items], writes)
                    if finalized.fenced:
                        items = self._fenced(job, items, finalized.fenced)
                failpoint("after_finalize")
                break
            except Exception as exc:
                failures += 1
                self._attempt_at, self._failing = None, (crash_summary(exc), io_fault(exc))
                self.on_storage(False, exc)
                if self._giving_up:
                    # Draining past its grace: the rows go; their prompts go back to the queue (claims
                    # that name the part stay, ownerless, so a landed write is still found and used).
                    log.error("giving up commit of %d rows for %s/%s while draining: %s", len(items), job, dataset, exc)
                    for item in items:
                        if not item.future.done():
                            item.future.set_exception(StorageUnavailable(str(exc)))
                    return
                backoff = random.uniform(0.5, 1.0) * min(self.retry_max_s, 0.5 * 2 ** min(failures - 1, 16))
                log.error(
                    "commit of %d rows for %s/%s failed (attempt %d), rows kept in memory, retrying in %.1fs: %s: %s",
                    len(items), job, dataset, failures, backoff, type(exc).__name__, exc,
                )  # fmt: skip
                self._retry_now.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(backoff):
                        await self._retry_now.wait()
        if failures:
            log.warning("commit of %d rows for %s/%s succeeded after %d failures", len(items), job, dataset, failures)
        self._attempt_at, self._failing, self._committed_at = None, None, time.monotonic()
        self.on_storage(True, None)
        self.on_flush(len(items), time.perf_counter() - started)
        # A job run without reasoning spans (--no-reasoning-spans) has no </think> to miss: never alarm.
        watched = any(getattr(i.final, "reasoning_alarm", True) for i in items)
        if finalized is not None and finalized.fire and watched:
            try:
                await self.on_alarm(job, finalized.seen, finalized.missing)
            except Exception as exc:  # the rows are stored and done: a lost alarm write must not strand them
                # (the condition holds again at the next flush of the job, which records it then).
                log.error("reasoning alarm of job %s not recorded: %s: %s", job, type(exc).__name__, exc)
        for item in items:
            if not item.future.done():
                self._remember(job, dataset, part, item.final, fences.get(item.final.prompt_id))
                item.future.set_result(part)

    async def _hooks_failed(self, job: str, dataset: str, items: list[_Pending], exc: Exception, tries: int) -> bool:
        """The group's hooks raised ``exc`` (not I/O) on try ``tries``: False to try again (an unknown error, within
        :data:`UNKNOWN_ERROR_ATTEMPTS`, after a short backoff), else True once the group is dealt with — a single row
        ends as :class:`RowFailed`, a larger group is committed row by row (each row's hooks asked alone), so only
        the row whose own hooks raise ends and its neighbours commit. Never closes the storage gate."""
        summary = crash_summary(exc)
        bound = 1 if data_fault(exc) else UNKNOWN_ERROR_ATTEMPTS
        self._failing = (summary, False)
        if tries < bound:
            backoff = random.uniform(0.5, 1.0) * min(self.retry_max_s, 0.5 * 2 ** (tries - 1))
            log.error(
                "post-commit hooks of %d rows for %s/%s failed (try %d of %d), retrying in %.1fs: %s",
                len(items), job, dataset, tries, bound, backoff, summary,
            )  # fmt: skip
            self._attempt_at = None
            await asyncio.sleep(backoff)
            return False
        if len(items) > 1:
            log.error(
                "post-commit hooks of %d rows for %s/%s failed (%s): committing them row by row to end only the row "
                "that causes it", len(items), job, dataset, summary,
            )  # fmt: skip
            for item in items:
                await self._commit_group(job, dataset, [item], tries)
            return True
        item = items[0]
        log.error(
            "row %s/%s ends: its post-commit hooks failed %d time(s): %s", job, item.final.prompt_id, tries, summary,
            exc_info=exc,
        )  # fmt: skip
        if not item.future.done():
            item.future.set_exception(RowFailed("commit_hook", summary))
        self._failing = None
        return True

    async def _encode(self, job: str, dataset: str, items: list[_Pending]) -> tuple[list[_Pending], memoryview]:
        """The rows as Parquet bytes (in a thread: encoding is CPU). A row the schema refuses is split off
        (:class:`BadRow` for its task) and the rest encoded without it: one bad answer never holds its
        neighbours, nor closes the storage gate."""
        keep, bad, data = await asyncio.to_thread(self._encode_rows, job, dataset, [i.row for i in items])
        for n, reason in bad:
            log.error("row of %s/%s cannot be stored: %s", job, items[n].final.prompt_id, reason)
            if not items[n].future.done():
                items[n].future.set_exception(BadRow(reason))
        if bad:
            items = [items[n] for n in keep]
        return items, data

    def _encode_rows(
        self, job: str, dataset: str, rows: list[dict[str, Any]]
    ) -> tuple[list[int], list[tuple[int, str]], memoryview]:
        refused = (ValueError, TypeError, OverflowError, pa.ArrowException)
        try:
            return list(range(len(rows))), [], self.writer.encode(job, dataset, rows)
        except refused:
            pass
        keep: list[int] = []
        bad: list[tuple[int, str]] = []
        for n, row in enumerate(rows):
            try:
                self.writer.encode(job, dataset, [row])
                keep.append(n)
            except refused as exc:
                bad.append((n, f"{type(exc).__name__}: {exc}"))
        return keep, bad, self.writer.encode(job, dataset, [rows[n] for n in keep])

    def _fenced(self, job: str, items: list[_Pending], fenced: dict[str, str]) -> list[_Pending]:
        """Drop the rows whose claim is no longer ours; their tasks end as :class:`Fenced`."""
        keep: list[int] = []
        for n, item in enumerate(items):
            holder = fenced.get(item.final.prompt_id)
            if holder is None:
                keep.append(n)
                continue
            log.warning(
                "fenced: %s/%s (our epoch %s) is held by %s now: our row is not committed",
                job, item.final.prompt_id, item.row.get("epoch"), holder,
            )  # fmt: skip
            if not item.future.done():
                item.future.set_exception(Fenced(holder))
        return [items[n] for n in keep]

    async def _finalize(
        self,
        job: str,
        dataset: str,
        finals: list[FinalRow],
        writes: FinalizeWrites | None,
        fences: dict[str, Fence] | None = None,
    ) -> Finalized:
        """Mark the rows done, and in the same Lua call write what the hooks asked for theirs (keyed by prompt id:
        a row split off or fenced since takes its write with it). ``fences``: see ``Ledger.finalize``."""
        given: dict[str, Any] = {"fences": fences} if fences else {}  # (only a replay passes them)
        if writes is None:
            return await self.ledger.finalize(job, dataset, finals, self.alarm_min_rows, self.alarm_share, **given)
        per_row = [writes.rows.get(f.prompt_id) for f in finals]
        if writes.offers:  # the next turns go onto our host list, offered (thinkfleet/broker/affinity.py)
            given["offers"] = writes.offers
        return await self.ledger.finalize(
            job, dataset, finals, self.alarm_min_rows, self.alarm_share, per_row, writes.queue, writes.records, **given
        )

    async def finalize_orphan(
        self, job: str, dataset: str, part: str, final: FinalRow, fence: Fence | None = None
    ) -> Finalized:
        """The recovery of a row committed in ``part`` but never finalized: finalize it with what the hooks
        compute from the stored row (a turn's next turn: as the dead run would have written it). ``part`` must be a part
        of the job's dataset (storage/layout.py ``confine_part``: a claim's part comes from Redis)."""
        loc = getattr(self.writer, "loc", None)
        if loc is not None:
            confine_part(loc, job, part, dataset)  # PartPathRefused: nothing outside the job is read
        # (under the stored run's fence when we hold none: its hooks' own fenced writes, e.g. an agentic step's
        # executor record, are that run's — Ledger.holding)
        with self.ledger.holding(job, final.prompt_id, fence):
            writes = await self.hooks.before_orphan_finalize(StoredRow(job, dataset, part, final.prompt_id))
        if final.part != part or final.row_index < 0:  # the commit log names the row's place (storage/feed.py)
            final = replace(final, part=part, row_index=await asyncio.to_thread(self._row_in_part, part, final))
        fences = {final.prompt_id: fence} if fence is not None else None
        return await self._finalize(job, dataset, [final], writes, fences)

    def _row_in_part(self, part: str, final: FinalRow) -> int:
        """The index of ``final``'s row (its prompt id, at its epoch when known) in ``part``; -1 when it cannot be
        told (compacted since, damaged, unreadable): the commit log's reader then finds it by prompt id."""
        loc = getattr(self.writer, "loc", None)
        if loc is None:
            return -1
        try:
            table = quarantine.read_checked(loc, loc.path(part), ["prompt_id", "epoch"])
        except Exception:  # gone or unreadable: the index is a hint, the finalize must not wait on it
            return -1
        if table is None:
            return -1
        for n, (pid, epoch) in enumerate(zip(table["prompt_id"].to_pylist(), table["epoch"].to_pylist(), strict=True)):
            if pid == final.prompt_id and (not final.epoch or (epoch or 0) == final.epoch):
                return n
        return -1

    def _remember(self, job: str, dataset: str, part: str, final: FinalRow, fence: Fence | None) -> None:
        if fence is None:
            return
        self._recent.remember((job, final.prompt_id), (dataset, part, final, fence))

    async def replay(self, job: str, prompt_id: str) -> bool:
        """Finalize again a row this process stored and finalized, whose claim Redis shows as still ours (a
        rollback lost the finalize; the message that ran it may be lost too): True once it is done again. The
        finalize is fenced as always (the claim must still be ours at the row's epoch), and the hooks rebuild
        their writes from the stored row (a turn's next turn, lost with the finalize)."""
        entry = self._recent.get((job, prompt_id))
        if entry is None:
            return False
        dataset, part, final, fence = entry
        if not await asyncio.to_thread(self.writer.exists, part):
            return False
        # under the run's own fence, passed to this one finalize: a live run of the prompt here keeps its own
        finalized = await self.finalize_orphan(job, dataset, part, final, fence)
        if prompt_id in finalized.fenced:
            return False
        log.warning("finalized %s/%s again from %s: Redis had lost its finalize (a rollback?)", job, prompt_id, part)
        return True

    async def recheck(self, job: str) -> int:
        """Redis lost finalizes of ours for ``job`` (:meth:`Ledger.lost_finalizes`): finalize again every row this
        process remembers that Redis now shows neither done nor dead — also where the rollback took the claim with
        it (claimed after the snapshot) and the message is gone too (its ack landed on the restored Redis): then
        no claim names us for ``abandon_claims`` to find, and no delivery would ever run the prompt again. Each
        finalize is fenced as always (a prompt another worker claimed since is theirs). Returns how many."""
        pids = [pid for (j, pid) in list(self._recent) if j == job]
        again = 0
        for pid in await self.ledger.unresolved(job, pids):
            if await self.replay(job, pid):
                again += 1
        return again

    def give_up(self) -> None:
        """Draining: a commit that is failing stops retrying and hands its prompts back."""
        self._giving_up = True
        self._retry_now.set()
