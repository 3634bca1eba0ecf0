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
3. ``finalize`` — after the part is committed, the prompts join ``done`` and their claims go.
4. ``release`` — a clean hand-back (server down, draining, storage down): the claim goes (or, naming a
   part, stays ownerless and *settled*); ``crashed`` — an unexpected exception — does the same and
   counts the exception against the prompt (``x``, exactly attributed).

   A killed worker cannot say which prompt killed it, so its death is charged (``k``) to every prompt
   it held when their stale claims are taken over — the culprit and its bystanders alike. A prompt
   one crash short of ``max_deliveries`` becomes a *suspect*: ``claim`` answers ``suspect`` without
   claiming, and the worker claims it again (``isolated=True``) only while it runs no other suspect.
   A death during an isolated run is also counted as ``ik``. Poison = ``x ≥ max_deliveries``
   (exceptions), or ``x + k ≥ max_deliveries`` with two isolated deaths (``ik ≥ 2``): a culprit that
   kills every worker is dead-lettered after ``max_deliveries + 1`` deaths, while a bystander would have
   to be the one isolated prompt on a worker killed for another reason twice.
5. ``dead_letter`` — a permanent failure, with the whole message kept for ``producer retry``.

A worker that dies between 2 and 3 leaves claims naming a part; so does a hand-back after 2 (the
*ambiguous commit*: the write may have landed). Whoever claims the prompt next finds the part: if it
exists the prompt is finalized from it (``finalize`` with the part's real token counts), never
regenerated.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, is_plain_name
from thinkfleet.state.scripts import lua

log = logging.getLogger("thinkfleet.worker")


@dataclass(frozen=True)
class Claim:
    state: str  # new | mine | busy | stale | done | dead | poison | suspect
    previous: dict[str, Any] | None  # the claim found (stale/busy/mine), or the delivery record (poison)

    @property
    def part(self) -> str | None:
        """The part a previous run of this prompt was committing (stale claims only)."""
        return (self.previous or {}).get("part") if self.state == "stale" else None


@dataclass(frozen=True)
class FinalRow:
    prompt_id: str
    completion_tokens: int
    has_think_end: bool
    truncated: bool
    #: The row is expected to reason (its prompt opens reasoning, or its job's model opens it in thinking mode):
    #: only such rows count for the reasoning alarm (``thinkfleet.profiles.expects_reasoning``).
    expects_reasoning: bool = True

    @property
    def think_flag(self) -> int:
        """finalize.lua's per-row flag: 1 closed reasoning, 0 expected to and did not, 2 not expected to."""
        return 1 if self.has_think_end else 0 if self.expects_reasoning else 2


class Ledger:
    """One worker's view of the job state; every method is one atomic transition or one read."""

    def __init__(self, client: aioredis.Redis, keys: Keys, worker: str, max_deliveries: int = 3) -> None:
        self.r = client
        self.keys = keys
        self.worker = worker
        self.max_deliveries = max_deliveries
        self._claim = client.register_script(lua("claim"))
        self._release = client.register_script(lua("release"))
        self._finalize = client.register_script(lua("finalize"))
        self._abandon = client.register_script(lua("abandon"))
        self._dead_letter = client.register_script(lua("dead_letter"))

    def _claim_json(self, part: str | None = None, isolated: bool = False) -> str:
        claim: dict[str, Any] = {"worker": self.worker, "part": part, "at": time.time()}
        if isolated:
            claim["isolated"] = True
        return json.dumps(claim)

    # -- transitions ----------------------------------------------------------------------------------
    async def claim(self, job: str, prompt_id: str, isolated: bool = False) -> Claim:
        k = self.keys
        state, previous = await self._claim(
            keys=[k.done(job), k.dead(job), k.claims(job), k.deliveries(job)],
            args=[
                prompt_id,
                self.worker,
                self._claim_json(isolated=isolated),
                k.heartbeat(""),
                self.max_deliveries,
                int(isolated),
            ],
        )
        state = state.decode() if isinstance(state, bytes) else state
        prev = json.loads(previous) if previous else None
        return Claim(state, prev)

    async def release(self, job: str, prompt_id: str) -> None:
        """Clean hand-back: drop our claim (keeping a named part, ownerless and settled)."""
        await self._give_back(job, prompt_id, "")

    async def crashed(self, job: str, prompt_id: str, error: str) -> int:
        """An unexpected exception ended this delivery: give our claim back and count the exception with
        ``error``. Returns the exceptions counted so far (0: the prompt is already done or dead)."""
        return await self._give_back(job, prompt_id, error[:500] or "crash")

    async def _give_back(self, job: str, prompt_id: str, error: str) -> int:
        k = self.keys
        return int(
            await self._release(
                keys=[k.claims(job), k.deliveries(job), k.done(job), k.dead(job)],
                args=[prompt_id, self.worker, error],
            )
        )

    async def mark_part(self, job: str, prompt_ids: list[str], part: str) -> None:
        value = self._claim_json(part)
        await self.r.hset(self.keys.claims(job), mapping=dict.fromkeys(prompt_ids, value))

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
    ) -> tuple[int, bool, int, int]:
        """Mark rows done; returns (new rows, alarm condition, alarm window rows, of them missing).

        A multi-turn job (``workers/turns.py``) passes ``turns`` (per row a ``NextTurn`` or None): in the
        same Lua call each row that becomes done records its answer into ``answers`` and enqueues its
        conversation's next turn into ``queue``; the next turn joins the job's submitted prompts
        (``prompts``, ``prompt_dataset``) then too. A next turn already done or dead (a re-derivation after a
        re-run of its turn) leaves ``done``/``dead`` as it is enqueued, and so do the later turns a chain that
        ends here no longer derives (``NextTurn.drop``), the counters following (as ``producer retry``)."""
        k = self.keys
        args: list[Any] = [self.worker, f"{time.time():.6f}", alarm_min_rows, alarm_share, dataset]
        for row, turn in zip(rows, turns or [None] * len(rows), strict=True):
            args += [row.prompt_id, row.completion_tokens, row.think_flag, int(row.truncated)]
            if turn is None:
                args += ["", "", "", "", ""]
            else:
                drop = json.dumps(list(turn.drop)) if turn.drop else ""
                args += [turn.answer, turn.next_prompt_id, turn.next_hash, turn.next_message, drop]
        keys = [
            k.done(job),
            k.claims(job),
            k.counters(job),
            k.dataset_counters(job, dataset),
            k.worker_counters(job),
            k.timeline(job),
            k.deliveries(job),
        ]
        if any(t is not None for t in turns or []):
            keys += [queue, k.prompts(job), k.prompt_dataset(job), answers, k.dead(job)]
        new, fire, seen, miss = await self._finalize(keys=keys, args=args)
        return int(new), bool(fire), int(seen), int(miss)

    async def dead_letter(self, task: PromptTask, error_class: str, message: str, attempts: int) -> bool:
        """Record a permanent failure; the record keeps the whole message so `producer retry` can resend it.
        False when the prompt was already dead or done (nothing changed)."""
        k = self.keys
        job, dataset = task.job, task.dataset
        record = json.dumps(
            {
                "error_class": error_class,
                "message": message[:2000],
                "attempts": attempts,
                "worker": self.worker,
                "at": time.time(),
                "dataset": dataset,
                "task": base64.b64encode(msgpack.packb(task.to_args())).decode(),
            }
        )
        return bool(
            await self._dead_letter(
                keys=[
                    k.dead(job),
                    k.claims(job),
                    k.counters(job),
                    k.dataset_counters(job, dataset),
                    k.deliveries(job),
                    k.done(job),
                ],
                args=[task.prompt_id, record],
            )
        )

    async def abandon_claims(self) -> int:
        """At start: claims under our name are a previous life's (same --name, or same hostname-pid in a
        restarted container). Our fresh heartbeat would make them look alive to other workers, whose
        redelivered copies would wait on them forever, so they lose their owner (and keep their part:
        whoever claims next still finds a committed part and only finalizes it). Returns how many."""
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
                        orphan = json.dumps({**claim, "worker": ""})
                        keys = [self.keys.claims(job)]
                        abandoned += int(await self._abandon(keys=keys, args=[prompt_id, raw, orphan]))
            except ResponseError as exc:  # e.g. WRONGTYPE: a foreign key where the claims hash belongs
                log.warning("abandon_claims: skipping job %r: %s", job, exc)
        return abandoned

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
