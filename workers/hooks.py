"""Post-commit hooks: work that hangs off a prompt's commit without growing the prompt's core trip.

A prompt's core trip (workers/pipeline.py) is claim → generate → row → commit → outcome. Features that follow
a stored row — multi-turn chaining today (:class:`workers.turns.TurnChaining`), tool steps tomorrow — are
:class:`PostCommitHook` subclasses, registered in order when the worker is built (workers/runtime.py), and
entered through :class:`PostCommitHooks` by code that does not know what they do (as dramatiq's
``after_process_message`` middleware hangs retries and results off a message).

Why two phases, and not only an "after" one: a hook whose work must happen exactly once per stored row (the next
turn's message) cannot run after the finalize, since a crash between the two would lose it — and the orphan
recovery, which finalizes the part of a dead run, would not know it was owed. So a hook's durable work rides in
the row's own finalize (thinkfleet/state/lua/finalize.lua): only the Lua call that moves the row into ``done``
writes it, in the same atomic step, and a recovery that finalizes an orphan part writes it if nobody did.

- :meth:`PostCommitHook.before_write` — once per commit group, before its part is written (and retried with the
  commit): the hook may fill its own columns of the rows (they are written as it leaves them), and returns the
  :class:`FinalizeWrites` its rows' finalize carries, computed from the rows as they will be stored.
- :meth:`PostCommitHook.before_orphan_finalize` — the same for one row found committed in a part but never
  finalized (a death between write and finalize): computed from the stored row, so it equals what the dead run
  would have written.
- :meth:`PostCommitHook.after_commit` — per prompt, once its row is durable and finalized by this run (stored, or
  an orphan finalized): for work that may be repeated or lost without harm (it runs once per delivery that stored
  or finalized the row, and not at all when the worker dies first; a fenced row never gets here). It holds the
  message's ack while it runs; an error is logged and counted and never changes the outcome (the row is stored).

The finalize carries one write per row, onto one queue and one record hash (finalize.lua's KEYS): two hooks may
both contribute to a group only with the same keys and for different rows (:class:`HookConflict` otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from thinkfleet.message import PromptTask
from thinkfleet.state.ledger import FinalRow
from workers.jobs import JobSpec

log = logging.getLogger("thinkfleet.worker")


class RowWrite(Protocol):
    """What a row's finalize writes with it, in its Lua call (``Ledger.finalize``'s per-row ``turns``)."""

    @property
    def prompt_id(self) -> str: ...  # the row it rides with
    @property
    def answer(self) -> str: ...  # recorded into ``FinalizeWrites.records`` under prompt_id ('' = none)
    @property
    def next_prompt_id(self) -> str: ...  # a prompt the job gains and enqueues ('' = none)
    @property
    def next_hash(self) -> str: ...
    @property
    def next_message(self) -> bytes: ...  # its broker message, pushed onto ``FinalizeWrites.queue``
    @property
    def drop(self) -> tuple[str, ...]: ...  # prompts taken out of done/dead


@dataclass(frozen=True)
class FinalizeWrites:
    """A hook's share of one finalize: per prompt id its :class:`RowWrite`, and the keys they go to."""

    queue: str  # the broker list the rows' messages are pushed onto
    records: str  # the hash their ``answer`` records go into
    rows: Mapping[str, RowWrite]  # prompt id → its write (keyed, so rows split off or fenced simply find none)
    #: When ``queue`` is this worker's host list: the ZSET each message's offer time goes into (thinkfleet/broker/
    #: affinity.py); '' = the shared queue.
    offers: str = ""

    def merged(self, other: FinalizeWrites) -> FinalizeWrites:
        """Two hooks' writes as one finalize's (they must name the same keys and different rows)."""
        if (other.queue, other.records, other.offers) != (self.queue, self.records, self.offers):
            raise HookConflict(
                f"two hooks write one finalize to {self.queue} + {self.records} and {other.queue} + {other.records}: "
                "finalize.lua takes one queue and one record hash"
            )
        both = self.rows.keys() & other.rows.keys()
        if both:
            raise HookConflict(f"two hooks write the finalize of {sorted(both)[:3]}: finalize.lua takes one per row")
        return FinalizeWrites(self.queue, self.records, {**self.rows, **other.rows}, self.offers)


class HookConflict(TypeError):
    """Two hooks' finalize writes cannot share one Lua call: a wiring error of the worker, not of a prompt."""


@dataclass(frozen=True)
class CommitGroup:
    """Rows of one (job, dataset) about to be written as one part."""

    job: str
    dataset: str
    rows: list[dict[str, Any]]  # as they will be written: a hook may fill its own columns


@dataclass(frozen=True)
class StoredRow:
    """A row committed in ``part`` by an earlier run and never finalized (the orphan recovery)."""

    job: str
    dataset: str
    part: str
    prompt_id: str


@dataclass(frozen=True)
class Committed:
    """A prompt whose row is durable and finalized by this run."""

    task: PromptTask
    job: JobSpec
    final: FinalRow
    part: str  # the part holding the row
    row: dict[str, Any] | None  # the row as written; None for an orphan (read it from ``part``)


class PostCommitHook:
    """A feature hung off the commit; every phase does nothing unless overridden (see the module docstring)."""

    #: The hook's name in logs and errors.
    name = "hook"

    async def before_write(self, group: CommitGroup) -> FinalizeWrites | None:
        return None

    async def before_orphan_finalize(self, row: StoredRow) -> FinalizeWrites | None:
        return None

    async def after_commit(self, committed: Committed) -> None:
        return None


class PostCommitHooks:
    """The worker's hooks, in registration order: what the committer and the pipeline call."""

    def __init__(
        self, hooks: Iterable[PostCommitHook] = (), on_error: Callable[[PostCommitHook, Exception], None] | None = None
    ) -> None:
        self.hooks = tuple(hooks)
        self._on_error = on_error

    async def before_write(self, group: CommitGroup) -> FinalizeWrites | None:
        """Every hook's columns filled, and their finalize writes together (None: the plain finalize)."""
        return _merge([await h.before_write(group) for h in self.hooks])

    async def before_orphan_finalize(self, row: StoredRow) -> FinalizeWrites | None:
        return _merge([await h.before_orphan_finalize(row) for h in self.hooks])

    async def after_commit(self, committed: Committed) -> None:
        """Each hook in turn; one that raises is logged and counted, the others still run."""
        for hook in self.hooks:
            try:
                await hook.after_commit(committed)
            except Exception as exc:
                log.exception(
                    "post-commit hook %s failed for %s/%s (the row is stored)",
                    hook.name, committed.task.job, committed.task.prompt_id,
                )  # fmt: skip
                if self._on_error is not None:
                    self._on_error(hook, exc)


def _merge(writes: list[FinalizeWrites | None]) -> FinalizeWrites | None:
    out: FinalizeWrites | None = None
    for w in writes:
        if w is not None and w.rows:
            out = w if out is None else out.merged(w)
    return out
