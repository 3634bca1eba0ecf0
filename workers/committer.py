"""Group commit: rows from many concurrent requests go into one Parquet part.

A finished request hands its row here and waits; every ``flush_interval_s`` the pending rows are
written as one part per (job, dataset), committed atomically, marked done in Redis, and only then are
their tasks released to acknowledge their messages.

A waiting row holds a pool thread (not a request slot), so a flush also starts early once
``max_pending`` rows wait — half the thread headroom beyond the in-flight bound — and at ``flush_rows``.
Slow real servers (a row every few seconds) thus get few, large parts; a fast simulator never
starves the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from storage.writer import PartWriter
from workers.ledger import FinalRow, Ledger

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    job: str
    dataset: str
    row: dict[str, Any]
    final: FinalRow
    future: asyncio.Future[None] = field(repr=False)


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
    ) -> None:
        self.writer = writer
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

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="group-commit")

    async def commit(self, job: str, dataset: str, row: dict[str, Any], final: FinalRow) -> None:
        """Returns once the row is durably stored and marked done; raises if the write failed."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(job, dataset, row, final, future))
        self._wake.set()
        if len(self._pending) >= self.early_flush_rows:
            self._urgent.set()
        await future

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
            batch, self._pending = self._pending[: self.flush_rows], self._pending[self.flush_rows :]
            if not self._pending:
                self._wake.clear()
            elif len(self._pending) >= self.early_flush_rows:
                self._urgent.set()
            if batch:
                await self._flush(batch)

    async def _flush(self, batch: list[_Pending]) -> None:
        groups: dict[tuple[str, str], list[_Pending]] = defaultdict(list)
        for item in batch:
            groups[(item.job, item.dataset)].append(item)
        for (job, dataset), items in groups.items():
            started = time.perf_counter()
            try:
                part = self.writer.part_name(job, dataset)
                await self.ledger.mark_part(job, [i.final.prompt_id for i in items], part)
                await asyncio.to_thread(self.writer.write, job, dataset, [i.row for i in items], part)
                _, fire, seen, miss = await self.ledger.finalize(
                    job, dataset, [i.final for i in items], self.alarm_min_rows, self.alarm_share
                )
            except Exception as exc:
                log.exception("group commit of %d rows for %s/%s failed", len(items), job, dataset)
                for item in items:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            self.on_flush(len(items), time.perf_counter() - started)
            if fire:
                await self.on_alarm(job, seen, miss)
            for item in items:
                if not item.future.done():
                    item.future.set_result(None)
