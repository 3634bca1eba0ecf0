"""The prompt state machine in Redis: every transition a worker makes, named once.

States of one prompt of a job (keys in :mod:`thinkfleet.keys`)::

    queued ──claim──► claimed ──mark_part──► committing ──finalize──► done
       ▲                │  │                     │
       │   release      │  └──dead_letter──► dead ◄──(poison: claim refuses after max_deliveries crashes)
       └────────────────┘◄──────release──────────┘   (a claim naming a part keeps it, with no owner)

1. ``claim`` — before generating. A prompt already done or dead is skipped without a server call; a
   claim held by a live worker (its heartbeat key exists) makes a redelivered copy wait for that run;
   a claim left by a dead worker is taken over (``stale``); each run counts one *delivery*.
2. ``mark_part`` — just before a part is written, each claim records the part's path.
3. ``finalize`` — after the part is committed, the prompts join ``done`` and their claims go; each row that joins
   appends an entry naming its part and row to the job's commit log (``Keys.feed``, read by storage/feed.py).
4. ``release`` — a clean hand-back (server down, draining, storage down): the claim goes (or, naming a
   part, stays ownerless and *settled*); ``crashed`` — an unexpected exception — does the same and
   counts the exception against the prompt (``x``, exactly attributed).

   A killed worker cannot say which prompt killed it, so its death is charged (``k``) to every prompt
   it held when their stale claims are taken over — the culprit and its bystanders alike. Only a death: a
   worker paused past its lease (GC, a frozen VM, a partition) that comes back takes the charge back
   (``came_back``: when its run is fenced, or at once when its heartbeat finds the lease lapsed), and a stray
   claim a live worker lets go is settled.
   A prompt one crash short of ``max_deliveries`` becomes a *suspect*: ``claim`` answers ``suspect`` without
   claiming, and the worker claims it again (``isolated=True``) as a member of its *suspect group* — the
   last-chance runs it runs at once, alongside its other work (workers/suspects.py). A worker's death takes
   its whole group, so resolving suspects is group testing: a group that completes clears all its members;
   a group that dies is split — each member's cap ``g`` becomes half the group's size (the size of the dead
   worker life's group set, Keys.suspect_group), and a run joins a group only while it fits every member's
   cap. A death alone in its group counts as ``ik``. Poison = ``x ≥ max_deliveries`` (exceptions), or
   ``x + k ≥ max_deliveries`` with two deaths alone (``ik ≥ 2``): a culprit that kills every worker is
   dead-lettered after at most ``max_deliveries + 1 + ⌊log2 n⌋`` deaths, n being the suspects that ran with it
   (caps bind only after a death, so n is what the worker took at once), while a bystander would have to be
   alone in a group killed for another reason twice — and suspects no longer run one at a time.
5. ``dead_letter`` — a permanent failure, with the whole message kept for ``producer retry``.

Fencing. Every claim gets an *epoch* (claim.lua: from Redis TIME, above the job's last one), held here for the run
(:attr:`Ledger.held`). ``mark_part``, ``finalize``, ``release`` and ``dead_letter`` act only while the claim is
still ours at that epoch: a worker paused past its lease (GC, a frozen VM, a partition) whose prompt another
worker took over is *fenced* — its rows are not written or not finalized, it changes no counter, answer record or
next turn, and its message is acked as ``fenced``. The row carries the epoch (storage's committed view keeps the
highest, storage/reader.py), so a fenced write that landed anyway is left out of every read.

A worker that dies between 2 and 3 leaves claims naming a part; so does a hand-back after 2 (the
*ambiguous commit*: the write may have landed). Whoever claims the prompt next finds the part: if it
exists the prompt is finalized from it (``finalize`` with the part's real token counts), never
regenerated.

One file because it is the state machine: each transition above is one method over one Lua script, and their
fences, revisions and finalize marks are only right when read together (a change to one is checked against the
others here, not across files).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, is_plain_name
from thinkfleet.state.recent import Recent
from thinkfleet.state.scripts import lua

log = logging.getLogger("thinkfleet.worker")


#: Claim states that make the prompt this run's (under :attr:`Claim.epoch`).
OURS = frozenset({"new", "stale", "mine"})


@dataclass(frozen=True)
class Claim:
    state: str  # new | mine | busy | stale | done | dead | poison | suspect | superseded
    previous: dict[str, Any] | None  # the claim found (stale/busy/mine), or the delivery record (poison)
    epoch: int = 0  # the fencing token of this run's claim (states in OURS), else 0

    @property
    def part(self) -> str | None:
        """The part a previous run of this prompt was committing (a claim taken over: stale, or mine when Redis
        lost our finalize), which may have committed."""
        return (self.previous or {}).get("part") if self.state in ("stale", "mine") else None


@dataclass(frozen=True)
class FinalRow:
    prompt_id: str
    completion_tokens: int
    has_think_end: bool
    truncated: bool
    #: The row is expected to reason (its prompt opens reasoning, or its job's model opens it in thinking mode):
    #: only such rows count for the reasoning alarm (``thinkfleet.profiles.expects_reasoning``).
    expects_reasoning: bool = True
    #: The epoch the stored row carries: this run's claim's, or for an orphan an earlier claim's (0: unknown).
    epoch: int = 0
    #: The revision the stored row carries (its message's; for an orphan the stored row's): finalize refuses a row
    #: of a lower revision than the one requested since (``producer retry --truncated``, ``Keys.revisions``).
    revision: int = 0
    #: A later turn's reusable prefix (its message's ``prefix_reusable``: how much of its prompt its previous turn's
    #: server already computed) and the cached tokens the server reported; None = unknown (not counted).
    prefix_reusable: int | None = None
    cached_tokens: int | None = None
    #: The row's quality flags (storage/quality.py: ``truncated``, ``loop``, …), counted per dataset as rows are
    #: finalized so ``producer status`` shows them live.
    flags: tuple[str, ...] = ()
    #: Where the stored row is: its part's URI and its index in the part (-1: not known), named by the commit log's
    #: entry finalize appends for it (Keys.feed, storage/feed.py reads the row from there).
    part: str = ""
    row_index: int = -1

    @property
    def truncated_arg(self) -> str:
        """finalize.lua's per-row ``truncated`` argument: '1' or '0', then ':' and the flags when the row has any."""
        return f"{int(self.truncated)}:{','.join(self.flags)}" if self.flags else str(int(self.truncated))

    @property
    def think_flag(self) -> int:
        """finalize.lua's per-row flag: 1 closed reasoning, 0 expected to and did not, 2 not expected to."""
        return 1 if self.has_think_end else 0 if self.expects_reasoning else 2


class Fence(NamedTuple):
    """What this process holds of a prompt's claim: its epoch, the job record generation and the message revision
    the run is for (mark_part.lua refuses a run of a lower revision than the one requested since)."""

    epoch: str = ""  # a decimal string, as claim.lua minted it ('' = no claim held)
    generation: str = ""  # '' = not recorded
    revision: str = "0"  # the run's message revision, a decimal string


_NO_FENCE = Fence()


class Finalized(NamedTuple):
    new: int  # rows that became done
    fire: bool  # the reasoning alarm's condition holds
    seen: int  # alarm window rows
    missing: int  # of them without </think>
    fenced: dict[str, str]  # prompt id → what holds it now (another claim's epoch@worker, 'done', 'dead')
    #: next turns this call offered on the caller's host list (host affinity): only the call that moves a row into
    #: done pushes its next turn, so a retried or replayed finalize of the same rows offers (and counts) none
    offered: int = 0


#: The commit log's cap, entries (the ``feed_max_len`` setting's default): a job nobody reads keeps at most about this
#: many (a few hundred bytes each); a reader the cap outran is rebuilt from storage (storage/feed.py).
DEFAULT_FEED_MAX_LEN = 200_000
#: dead_letter.lua's answer for a job whose record is gone or of another generation (purged).
PURGED = -2
#: dead_letter.lua: the message is of a lower revision than the one asked for since (nothing written).
SUPERSEDED = -3
#: How many of its latest dead letters a worker remembers, to record again those a Redis rollback lost.
RECENT_DEAD_LETTERS = 5_000
#: A dead letter's ``answer``: at most this many output ids, and this many characters of JSON in all.
ANSWER_IDS_KEPT = 4096
ANSWER_MAX_CHARS = 65_536


def bounded_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` as a dead letter keeps it: its ``output_ids`` cut to the first :data:`ANSWER_IDS_KEPT`
    (``output_ids_count`` says how many there were); past :data:`ANSWER_MAX_CHARS` of JSON in all, the
    ids are cut further, and as a last resort the JSON text itself (``{"excerpt", "truncated": true}``)."""
    out = dict(answer)
    ids = out.get("output_ids")
    if isinstance(ids, list):
        out.setdefault("output_ids_count", len(ids))
        out["output_ids"] = ids[:ANSWER_IDS_KEPT]
    text = json.dumps(out, default=repr)
    while len(text) > ANSWER_MAX_CHARS and isinstance(out.get("output_ids"), list) and out["output_ids"]:
        out["output_ids"] = out["output_ids"][: len(out["output_ids"]) // 2]
        text = json.dumps(out, default=repr)
    if len(text) > ANSWER_MAX_CHARS:
        return {"excerpt": text[:ANSWER_MAX_CHARS], "truncated": True}
    return out


class Ledger:
    """One worker's view of the job state; every method is one atomic transition or one read."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        worker: str,
        max_deliveries: int = 3,
        waitaof_ms: int = 0,
        wait_replicas: int = 0,
        feed_max_len: int = DEFAULT_FEED_MAX_LEN,
    ) -> None:
        self.r = client
        #: The commit log's approximate cap, entries (finalize.lua; the ``feed_max_len`` setting; 0: none).
        self.feed_max_len = feed_max_len
        self.keys = keys
        self.worker = worker
        self.max_deliveries = max_deliveries
        #: (job, prompt id) → the fence of the claim this process holds for it.
        self.held: dict[tuple[str, str], Fence] = {}
        #: WAITAOF after finalize (None: not tried yet; False: the server cannot, e.g. before Redis 7.2 or AOF off).
        self.waitaof_ms = waitaof_ms
        self._waitaof_ok: bool | None = None if waitaof_ms > 0 else False
        #: WAIT for this many replicas after finalize (0: off), up to ``waitaof_ms`` (or 1 s when that is 0).
        self.wait_replicas = wait_replicas
        #: Finalizes acknowledged by fewer replicas / AOF fsyncs than asked (:meth:`_finalize_durably`).
        self.short_waits: Counter[str] = Counter()
        self._short_logged = 0.0
        #: This process's finalize marks (finalize.lua writes ``nonce:seq`` under our name in finalize_marks): the
        #: nonce tells our marks from an earlier life's, ``_marked[job]`` is the seq of our latest finalize of the
        #: job that Redis answered — a mark found below it means Redis lost finalizes (:meth:`lost_finalizes`).
        self._mark_nonce = uuid.uuid4().hex[:12]
        #: This process's suspect group (claim.lua): the last-chance runs it runs at once, one per worker life.
        self.group = f"{worker}:{self._mark_nonce}"
        self._mark_seq = 0
        self._marked: dict[str, int] = {}
        #: Our latest dead letters (job, prompt id) → (dataset, record, epoch, generation, revision), for
        #: :meth:`redo_dead_letters`.
        self._recent_dead: Recent[tuple[str, str], tuple[str, str, str, str, int]] = Recent(RECENT_DEAD_LETTERS)
        self._claim = client.register_script(lua("claim"))
        self._mark_part = client.register_script(lua("mark_part"))
        self._release = client.register_script(lua("release"))
        self._finalize = client.register_script(lua("finalize"))
        self._abandon = client.register_script(lua("abandon"))
        self._dead_letter = client.register_script(lua("dead_letter"))
        self._tool_calls = client.register_script(lua("tool_calls"))
        self._came_back = client.register_script(lua("came_back"))

    def _claim_json(self, part: str | None = None, group_size: int = 0) -> str:
        claim: dict[str, Any] = {"worker": self.worker, "part": part, "at": time.time()}
        if group_size:
            claim["group"] = self.group
            claim["gs"] = group_size
        return json.dumps(claim)

    def _member(self, job: str, prompt_id: str) -> str:
        """A run's name in the suspect group's set (the group spans jobs)."""
        return f"{self.keys.claims(job)}|{prompt_id}"

    # -- transitions ----------------------------------------------------------------------------------
    async def claim(
        self,
        job: str,
        prompt_id: str,
        isolated: bool = False,
        revision: int = 0,
        generation: str = "",
        group_size: int = 1,
    ) -> Claim:
        """Claim ``prompt_id`` for a run of the message's ``revision``; when the state is in :data:`OURS` the
        claim's epoch is held (:attr:`held`) until the run is finalized, released or dead-lettered.

        ``isolated``: a last-chance run (the prompt answered ``suspect``) in this process's suspect group, which
        then holds ``group_size`` runs with this one; it joins the group's set in Redis until :meth:`leave_group`."""
        k = self.keys
        state, previous, epoch = await self._claim(
            keys=[
                k.done(job),
                k.dead(job),
                k.claims(job),
                k.deliveries(job),
                k.epoch_clock(job),
                k.revisions(job),
                k.job(job),
            ],
            args=[
                prompt_id,
                self.worker,
                self._claim_json(group_size=max(1, group_size) if isolated else 0),
                k.heartbeat(""),
                self.max_deliveries,
                int(isolated),
                int(revision),
                generation,
                k.suspect_group(""),
                self.group,
                max(1, group_size),
                self._member(job, prompt_id),
                int(time.time() * 1_000_000),  # epochs never below this host's clock (claim.lua)
            ],
        )
        state = state.decode() if isinstance(state, bytes) else state
        epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch or "")
        prev = None
        if previous and state != "superseded":
            prev = json.loads(previous)
        if state in OURS:
            self.held[(job, prompt_id)] = Fence(epoch, generation, str(int(revision)))
        return Claim(state, prev, int(epoch) if epoch else 0)

    async def leave_group(self, job: str, prompt_id: str) -> None:
        """A last-chance run ended (whichever way): it leaves this process's suspect group, so a later death
        splits only the runs it took with it."""
        await self.r.srem(self.keys.suspect_group(self.group), self._member(job, prompt_id))

    async def came_back(self, job: str, prompt_id: str, epoch: int | str) -> bool:
        """Our claim of ``prompt_id`` under ``epoch`` was taken over while we lived (paused past our lease): take
        back the death that takeover charged (came_back.lua). True when there was one."""
        keys = [self.keys.deliveries(job)]
        return bool(int(await self._came_back(keys=keys, args=[prompt_id, self.worker, str(epoch)])))

    def _fence(self, job: str, prompt_id: str) -> Fence:
        return self.held.get((job, prompt_id), _NO_FENCE)

    def fence(self, job: str, prompt_id: str) -> Fence | None:
        """The fence this process holds for the prompt's claim (None when it holds none)."""
        return self.held.get((job, prompt_id))

    @contextlib.contextmanager
    def holding(self, job: str, prompt_id: str, fence: Fence | None) -> Iterator[None]:
        """Hold ``fence`` for the prompt while the block runs, where this process holds none: a row finalized again
        from storage (``GroupCommitter.replay`` after a Redis rollback) runs its hooks under the fence of the run that
        stored it — an agentic step's executor record is fenced by our claim (tool_calls.lua), and with no fence
        held it would read as fenced and the step's finalize would record no answer and enqueue no next step,
        stranding its chain. A live run's own fence is left as it is."""
        key = (job, prompt_id)
        added = fence is not None and key not in self.held
        if added:
            assert fence is not None
            self.held[key] = fence
        try:
            yield
        finally:
            if added and self.held.get(key) is fence:
                self.held.pop(key, None)

    def _drop(self, job: str, prompt_id: str) -> None:
        """The run of the prompt ended here (finalized, fenced, released, dead-lettered): its fence goes."""
        self.held.pop((job, prompt_id), None)

    async def release(self, job: str, prompt_id: str) -> None:
        """Clean hand-back: drop our claim (keeping a named part, ownerless and settled)."""
        await self._give_back(job, prompt_id, "")

    async def crashed(self, job: str, prompt_id: str, error: str) -> int:
        """An unexpected exception ended this delivery: give our claim back and count the exception with
        ``error``. Returns the exceptions counted so far (0: the prompt is already done or dead)."""
        return await self._give_back(job, prompt_id, error[:500] or "crash")

    async def _give_back(self, job: str, prompt_id: str, error: str) -> int:
        k = self.keys
        fence = self._fence(job, prompt_id)
        result = int(
            await self._release(
                keys=[k.claims(job), k.deliveries(job), k.done(job), k.dead(job), k.job(job)],
                args=[prompt_id, self.worker, error, fence.epoch, fence.generation],
            )
        )
        self._drop(job, prompt_id)
        return result

    async def mark_part(self, job: str, prompt_ids: list[str], part: str) -> dict[str, str]:
        """Record ``part`` in each claim that is still ours at our epoch (and of a revision not below the one
        requested) — the check just before a part is written. Returns the prompts that are not ours any more (prompt
        id → what holds it now): their rows must not be written."""
        k = self.keys
        args: list[Any] = [self.worker, part, f"{time.time():.6f}"]
        for pid in prompt_ids:
            args += [pid, *self._fence(job, pid)]
        keys = [k.claims(job), k.done(job), k.dead(job), k.job(job), k.counters(job), k.revisions(job)]
        fenced = _pairs(await self._mark_part(keys=keys, args=args))
        for pid in fenced:
            self._drop(job, pid)
        return fenced

    async def finalize(
        self,
        job: str,
        dataset: str,
        rows: list[FinalRow],
        alarm_min_rows: int,
        alarm_share: float,
        turns: list[Any] | None = None,
        queue: str = "",
        answers: str = "",
        fences: Mapping[str, Fence] | None = None,
        offers: str = "",
    ) -> Finalized:
        """Mark rows done — those whose claim is still ours at our epoch; the others are fenced (returned, and
        they change nothing). Returns (new rows, alarm condition, alarm window rows, of them missing, fenced).

        A multi-turn job (``workers/turns.py``) passes ``turns`` (per row a ``NextTurn`` or None): in the
        same Lua call each row that becomes done records its answer into ``answers`` and enqueues its
        conversation's next turn into ``queue``; the next turn joins the job's submitted prompts
        (``prompts``, ``prompt_dataset``) then too. A next turn already done or dead (a re-derivation after a
        re-run of its turn) leaves ``done``/``dead`` as it is enqueued, and so do the later turns a chain that
        ends here no longer derives (``NextTurn.drop``), the counters following (as ``producer retry``).

        ``fences`` (prompt id → fence): rows finalized under a fence this process no longer holds for them (a
        finalize replayed from a row it stored under an earlier claim: ``GroupCommitter.replay``). Passed, never
        swapped into the fences held: a live run of the same prompt may mark its part while this call awaits Redis,
        and must do so under its own fence (with the old one it was fenced by its own claim: acked, never stored).
        Its held fence stays too: it is that live run's, not this finalize's.

        ``offers`` (thinkfleet/broker/affinity.py): ``queue`` is this worker's host list, and each next turn's offer
        time goes into this ZSET with it (one step: a host list message always has its offer). The next turns this
        call pushed are ``Finalized.offered``, and counted ``offered`` in ``AFFINITY`` here: a retried finalize
        (an error after the Lua call ran) or a replayed one finds its rows done and offers nothing again."""
        k = self.keys
        given = fences or {}
        args: list[Any] = [self.worker, alarm_min_rows, alarm_share, dataset]
        for row, turn in zip(rows, turns or [None] * len(rows), strict=True):
            args += [row.prompt_id, row.completion_tokens, row.think_flag, row.truncated_arg]
            if turn is None:
                args += ["", "", "", "", ""]
            else:
                drop = json.dumps(list(turn.drop)) if turn.drop else ""
                args += [turn.answer, turn.next_prompt_id, turn.next_hash, turn.next_message, drop]
            epoch, generation, _ = given.get(row.prompt_id) or self._fence(job, row.prompt_id)
            next_revision = message_revision(turn.next_message) if turn is not None and turn.next_prompt_id else 0
            args += [epoch, str(row.epoch) if row.epoch else epoch, generation, int(row.revision), next_revision]
            args += [_count_arg(row.prefix_reusable), _count_arg(row.cached_tokens), row.part, int(row.row_index)]
        keys = [
            k.done(job),
            k.claims(job),
            k.counters(job),
            k.dataset_counters(job, dataset),
            k.worker_counters(job),
            k.timeline(job),
            k.deliveries(job),
            k.dead(job),
            k.committed_epochs(job),
            k.job(job),
        ]
        if any(t is not None for t in turns or []):
            keys += [queue, k.prompts(job), k.prompt_dataset(job), answers, k.chain_state(job), k.chain_waiting(job)]
            keys += [offers] if offers else []
        seq, mark = self._next_mark(job)
        keys += [k.revisions(job), k.finalize_marks(job), k.feed(job), k.feed_log(job), k.committed_revisions(job)]
        args += [int(self.feed_max_len), mark]
        new, fire, seen, miss, flat, offered = await self._finalize_durably(keys, args)
        self._marked[job] = max(self._marked.get(job, 0), seq)
        fenced = _pairs(flat)
        for row in rows:
            if row.prompt_id not in given:
                self._drop(job, row.prompt_id)
        if offers and int(offered):
            # Counted where the offer is made, once per next turn (thinkfleet/broker/affinity.py AFFINITY)
            from thinkfleet.broker.affinity import AFFINITY

            AFFINITY.note("offered", int(offered))
        return Finalized(int(new), bool(fire), int(seen), int(miss), fenced, int(offered))

    def _mark(self, seq: int) -> str:
        return f"{self._mark_nonce}:{seq}"

    def _next_mark(self, job: str) -> tuple[int, str]:
        """The next write's sequence number and its mark ``nonce:seq:prev`` (prev: our highest write to ``job`` that
        Redis answered, which _mark.lua compares with the mark it finds)."""
        self._mark_seq += 1
        return self._mark_seq, f"{self._mark(self._mark_seq)}:{self._marked.get(job, 0)}"

    def marked_jobs(self) -> list[str]:
        """The jobs this process has finalized rows of (whose marks :meth:`lost_finalizes` can check)."""
        return list(self._marked)

    async def lost_finalizes(self, job: str) -> bool:
        """True when Redis has lost finalizes this process made for ``job``: our mark there is older than our
        latest finalize it answered, or gone (a rollback to an older snapshot, a replica promoted behind — both
        lose a suffix of the writes, so a lost finalize always takes the latest mark with it)."""
        seq = self._marked.get(job)
        if seq is None:
            return False
        async with self.r.pipeline(transaction=False) as p:
            p.exists(self.keys.job(job))
            p.hget(self.keys.finalize_marks(job), self.worker)
            p.hexists(self.keys.finalize_marks(job), self._lost_field)
            exists, raw, flagged = await p.execute()
        if not exists:
            # Purged (or Redis lost everything and a re-submit has not come yet): nothing of ours to finalize again
            # — a replay would bring a purged job's keys back. A re-submit mints a new generation, which fences
            # our old rows anyway.
            self._marked.pop(job, None)
            return False
        if flagged:  # a later write of ours found the mark behind (_mark.lua): the latest mark alone would hide it
            return True
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")
        nonce, _, found = text.partition(":")
        return nonce != self._mark_nonce or not found.isdigit() or int(found) < seq

    @property
    def _lost_field(self) -> str:
        """Where _mark.lua flags that Redis lost writes of ours (finalize_marks ``{worker}|lost``)."""
        return f"{self.worker}|lost"

    async def remark(self, job: str) -> None:
        """After the rows a rollback lost were finalized again: our mark says so, and :meth:`lost_finalizes` is
        False until Redis loses writes again."""
        seq = self._marked.get(job)
        if seq is not None:
            async with self.r.pipeline(transaction=True) as p:
                p.hset(self.keys.finalize_marks(job), self.worker, self._mark(seq))
                p.hdel(self.keys.finalize_marks(job), self._lost_field)
                await p.execute()

    async def unresolved(self, job: str, prompt_ids: list[str]) -> list[str]:
        """Of ``prompt_ids``, those neither done nor dead (one pipelined round trip per 500)."""
        out: list[str] = []
        for start in range(0, len(prompt_ids), 500):
            chunk = prompt_ids[start : start + 500]
            async with self.r.pipeline(transaction=False) as p:
                for pid in chunk:
                    p.sismember(self.keys.done(job), pid)
                    p.hexists(self.keys.dead(job), pid)
                flags = await p.execute()
            out += [
                pid for pid, done, dead in zip(chunk, flags[::2], flags[1::2], strict=True) if not done and not dead
            ]
        return out

    async def _finalize_durably(self, keys: list[str], args: list[Any]) -> Any:
        """finalize.lua, then ``WAIT`` (replicas) and ``WAITAOF`` (the AOF's fsync) on the **same connection** (one
        non-transactional pipeline): both count only the writes made on the connection they run on, so sent on
        another pooled connection they covered nothing.

        A short count (a replica behind, or none; an fsync not done in time) is logged and counted
        (``short_waits``), and the finalize stands: the row is already durable in storage and its finalize cannot be
        taken back, so handing the message back would only run it again. If a failover or a crash then loses the
        finalize, this process's finalize marks find the loss (:meth:`lost_finalizes`) and the rows are finalized
        again from their stored parts — the recovery a rollback already has. Off where the server cannot (WAITAOF
        before Redis 7.2 or with AOF off: noted once)."""
        timeout_ms = self.waitaof_ms or 1000
        async with self.r.pipeline(transaction=False) as p:
            await self._finalize(keys=keys, args=args, client=p)
            if self.wait_replicas:
                p.wait(self.wait_replicas, timeout_ms)
            if self._waitaof_ok is not False:
                p.waitaof(1, 0, timeout_ms)
            results = await p.execute(raise_on_error=False)
        finalized = results[0]
        if isinstance(finalized, Exception):
            raise finalized
        rest = list(results[1:])
        if self.wait_replicas:
            acked = rest.pop(0)
            if isinstance(acked, Exception) or int(acked) < self.wait_replicas:
                self._short("replicas", f"WAIT {self.wait_replicas}: {acked} replica(s) acknowledged")
        if self._waitaof_ok is not False:
            fsynced = rest.pop(0)
            if isinstance(fsynced, ResponseError):
                self._waitaof_ok = False
                log.info("WAITAOF after finalize is off: %s (Redis 7.2+ with appendonly yes can)", fsynced)
            elif isinstance(fsynced, Exception) or not fsynced or int(fsynced[0]) < 1:
                self._short("aof", f"WAITAOF: not fsynced within {timeout_ms} ms ({fsynced})")
            else:
                self._waitaof_ok = True
        return finalized

    def _short(self, what: str, detail: str) -> None:
        self.short_waits[what] += 1
        now = time.monotonic()
        if now - self._short_logged >= 60:  # one line a minute: a lagging replica would otherwise flood the log
            self._short_logged = now
            log.warning(
                "a finalize was not confirmed durable (%s; %d such finalizes so far): the rows stand, and a failover "
                "that loses them is recovered from storage by the finalize marks",
                detail,
                sum(self.short_waits.values()),
            )

    async def dead_letter(
        self, task: PromptTask, error_class: str, message: str, attempts: int, answer: dict[str, Any] | None = None
    ) -> bool:
        """Record a permanent failure; the record keeps the whole message so `producer retry` can resend it,
        and ``answer`` (what the server sent, e.g. for ``bad_output``; bounded by :func:`bounded_answer`)
        under ``"answer"``. False when the prompt was already dead or done (nothing changed) — or when its job was
        purged (its record gone or of another generation): the message is then recorded in the fleet-wide malformed
        list with its reason, and nothing of the job is written."""
        job, dataset = task.job, task.dataset
        fields: dict[str, Any] = {
            "error_class": error_class,
            "message": message[:2000],
            "attempts": attempts,
            "worker": self.worker,
            "at": time.time(),
            "dataset": dataset,
            "task": base64.b64encode(msgpack.packb(task.to_args())).decode(),
        }
        if answer is not None:
            fields["answer"] = bounded_answer(answer)
        record = json.dumps(fields, default=repr)
        epoch = self._fence(job, task.prompt_id).epoch
        self._drop(job, task.prompt_id)
        written = (dataset, record, epoch, task.generation, int(task.revision))
        result = await self._write_dead_letter(job, task.prompt_id, *written)
        if result > 0:
            self._recent_dead.remember((job, task.prompt_id), written)
        if result == PURGED:
            await self._purged(task, error_class, record)
        elif result == SUPERSEDED:
            log.info(
                "%s/%s: dead letter %s of revision %s not recorded: a later revision is asked for (producer retry), "
                "whose run ends the prompt", job, task.prompt_id, error_class, task.revision,
            )  # fmt: skip
        elif result < 0:
            log.warning(
                "fenced: dead letter %s of %s/%s refused: its claim (epoch %s) was taken over by another run",
                error_class,
                job,
                task.prompt_id,
                epoch,
            )
        return result > 0

    async def _write_dead_letter(
        self, job: str, prompt_id: str, dataset: str, record: str, epoch: str, generation: str, revision: int
    ) -> int:
        k = self.keys
        seq, mark = self._next_mark(job)
        keys = [k.dead(job), k.claims(job), k.counters(job), k.dataset_counters(job, dataset), k.deliveries(job)]
        keys += [k.done(job), k.finalize_marks(job), k.job(job), k.revisions(job)]
        args = [prompt_id, record, self.worker, epoch, mark, generation, revision]
        result = int(await self._dead_letter(keys=keys, args=args))
        if result != PURGED:
            self._marked[job] = max(self._marked.get(job, 0), seq)
        return result

    async def _purged(self, task: PromptTask, error_class: str, record: str) -> None:
        """A dead letter of a purged job's message (a straggler): recorded where no job key is touched — the
        fleet-wide malformed list, with its reason and the whole dead-letter record — logged once."""
        log.warning(
            "%s/%s: its job record is gone or another generation now (producer purge): dead letter %s recorded in %s",
            task.job, task.prompt_id, error_class, self.keys.malformed,
        )  # fmt: skip
        entry = {
            "message_id": task.task_id,
            "error": f"purged_job: {error_class} of generation {task.generation!r}, job record gone or replaced",
            "at": time.time(),
            "args": record[:4000],
        }
        async with self.r.pipeline(transaction=True) as p:
            p.lpush(self.keys.malformed, json.dumps(entry))
            p.ltrim(self.keys.malformed, 0, 9999)
            await p.execute()

    async def redo_dead_letters(self, job: str) -> int:
        """Redis lost writes of ours (:meth:`lost_finalizes`): record again each of our recent dead letters of
        ``job`` that Redis now shows neither dead nor done — its message was acked, so nothing else would. Fenced
        as the first time (a claim another run holds now is theirs). Returns how many."""
        pids = [pid for (j, pid) in list(self._recent_dead) if j == job]
        again = 0
        for pid in await self.unresolved(job, pids):
            if await self._write_dead_letter(job, pid, *self._recent_dead[(job, pid)]) > 0:
                log.warning("dead-lettered %s/%s again: Redis had lost its dead letter (a rollback?)", job, pid)
                again += 1
        return again

    async def abandon_claims(
        self,
        running: Callable[[str, str], bool] | None = None,
        replay: Callable[[str, str], Awaitable[bool]] | None = None,
    ) -> int:
        """At start: claims under our name are a previous life's (same --name, or same hostname-pid in a
        restarted container). Our fresh heartbeat would make them look alive to other workers, whose
        redelivered copies would wait on them forever, so they lose their owner (and keep their part:
        whoever claims next still finds a committed part and only finalizes it). Returns how many.

        While running, with ``running(job, prompt_id)`` (this process runs it): our claims that no run of ours
        holds are strays — Redis lost the finalize that deleted them (a rollback to an older snapshot, a
        replica promoted behind) — and are let go the same way, so no copy waits on them. Before that,
        ``replay(job, prompt_id)`` may finalize the stray again from the row this process stored (True: done,
        not let go): the lost message that ran it may never come back, and the row is already durable."""
        abandoned = 0
        for raw_job in await self.r.smembers(self.keys.jobs):
            job = raw_job.decode(errors="replace") if isinstance(raw_job, bytes) else str(raw_job)
            if not is_plain_name(job):
                # Never a submitted job (submit refuses such names): `x:claims` would name job x's keys.
                log.warning("abandon_claims: skipping job %r in %s: not a plain job name", job[:200], self.keys.jobs)
                continue
            try:
                async for prompt_id, raw in self.r.hscan_iter(self.keys.claims(job)):
                    try:
                        claim = json.loads(raw)
                    except ValueError:
                        continue  # not ours to judge: a foreign value in the hash must not stop the worker
                    if isinstance(claim, dict) and claim.get("worker") == self.worker:
                        pid = prompt_id.decode(errors="replace") if isinstance(prompt_id, bytes) else str(prompt_id)
                        if running is not None and ((job, pid) in self.held or running(job, pid)):
                            continue
                        if replay is not None and await replay(job, pid):
                            continue
                        # A previous life's claim: it died, the next claim charges its death. A stray while we
                        # run: we live, so it is let go settled (release.lua's hand-back), charging nothing.
                        orphan = json.dumps({**claim, "worker": ""} | ({"settled": True} if running else {}))
                        keys = [self.keys.claims(job)]
                        abandoned += int(await self._abandon(keys=keys, args=[prompt_id, raw, orphan]))
            except ResponseError as exc:  # e.g. WRONGTYPE: a foreign key where the claims hash belongs
                log.warning("abandon_claims: skipping job %r: %s", job, exc)
        return abandoned

    async def tool_call(self, job: str, prompt_id: str, mode: str, field: str, value: str) -> tuple[str, str]:
        """An agentic step's executor record (workers/tool_exec.py), fenced by our claim (tool_calls.lua): ``mark``
        writes the pending mark ``value`` before the executor is called, ``record`` its outcome over our mark.
        Returns (state, detail) as tool_calls.lua does; a fenced run's fence goes, so mark_part refuses its row."""
        k = self.keys
        fence = self._fence(job, prompt_id)
        keys = [k.claims(job), k.done(job), k.dead(job), k.job(job), k.tool_calls(job)]
        args = [mode, prompt_id, field, self.worker, fence.epoch, fence.generation, value, f"{time.time():.6f}"]
        state, detail = (
            v.decode() if isinstance(v, bytes) else str(v) for v in await self._tool_calls(keys=keys, args=args)
        )
        if state == "fenced":
            self._drop(job, prompt_id)
        return state, detail

    async def raise_alarm(self, job: str, evidence: dict[str, Any]) -> bool:
        """Set the job's alarm once; True if this call set it."""
        return bool(await self.r.set(self.keys.alarm(job), json.dumps(evidence), nx=True))

    # -- reads ----------------------------------------------------------------------------------------
    async def resolved(self, job: str, prompt_id: str) -> str | None:
        """'done' / 'dead' once the prompt is finished by anyone, else None."""
        async with self.r.pipeline(transaction=False) as p:
            p.sismember(self.keys.done(job), prompt_id)
            p.hexists(self.keys.dead(job), prompt_id)
            done, dead = await p.execute()
        return "done" if done else "dead" if dead else None

    async def claim_owner(self, job: str, prompt_id: str) -> str | None:
        raw = await self.r.hget(self.keys.claims(job), prompt_id)
        return json.loads(raw)["worker"] if raw else None

    async def count(self, job: str, field: str, amount: int = 1) -> None:
        await self.r.hincrby(self.keys.counters(job), field, amount)


def message_revision(raw: bytes | str) -> int:
    """The revision of an encoded task message, from its task id (``job/prompt_id/rN``, thinkfleet/message.py); 0
    when it names none."""
    from thinkfleet.broker.queues import task_id_of

    tid = task_id_of(raw.encode() if isinstance(raw, str) else raw) or ""
    _, sep, rev = tid.rpartition("/r")
    return int(rev) if sep and rev.isdigit() else 0


def _pairs(flat: list[Any]) -> dict[str, str]:
    """A Lua script's flat {key, value, ...} answer as a dict of strings."""
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in flat or []]
    return dict(zip(text[0::2], text[1::2], strict=True))


def _count_arg(value: int | None) -> str | int:
    """A per-row count for finalize.lua: '' = unknown (a negative count is no count either)."""
    return "" if value is None or value < 0 else int(value)
