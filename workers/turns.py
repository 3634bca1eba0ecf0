"""Multi-turn regeneration (``producer submit --turns all``): turn i+1 is rendered from turn i's stored row.

The producer enqueues turn 0 of each conversation (prompt id ``{conversation}/t0``: the history up to the first
user message) and keeps every conversation in Redis (``Keys.conversations``; the job hash's ``turns`` field says
the job is multi-turn; turn ids, plans and histories are in :mod:`thinkfleet.turns`). When a worker commits turn
i, it decodes the model's answer from the stored ids by their span columns
(:func:`storage.conversations.output_message`: reasoning_content, content, tool_calls), puts it in place of the
dataset's assistant turn, renders turn i+1 with the job's own tokenizer and chat template (its fingerprint
checked against the job record first) and hands the message to ``Ledger.finalize``, which marks turn i done,
records the answer (``answers_key``) and enqueues turn i+1 in ONE Lua call. Everything the next message holds is
computed from stored data only (the conversation, the answers of turns < i recorded by earlier finalizes, turn
i's row in its part), so the recovery of a worker that died between the part write and the finalize (orphan part
→ finalize) enqueues the same turn i+1. The worker enters this module through one door, :class:`TurnChaining`, a
post-commit hook (workers/hooks.py) whose finalize writes ride in that Lua call.

The template decides what of the history it keeps: the answer always carries ``reasoning_content`` (Kimi's
K2-Thinking template drops it for turns before the last plain assistant turn).

What the worker runs and believes here is its own choice: the tokenizer is loaded only from the worker's allowed
roots (``THINKFLEET_TOKENIZER_ROOTS``, default the served model directory), resolved, with its own code only when
both the job asks for it and the worker allows it (``THINKFLEET_TRUST_REMOTE_CODE``; workers/jobs.py refuses such
jobs' messages before they run). With a signing key (thinkfleet/signing.py) the job record and its ``turns`` field,
every conversation record and every recorded answer must carry a valid signature (answers and next-turn messages
are signed by the worker that derives them); one that does not ends its chain with the reason in its answer record.

A chain ends early when the model's answer of turn i calls a tool (the next user turn would follow a call with
no result): the answer record says ``"chain_end": "tool_call"`` — unless the job is agentic (``tool_results`` set:
the results are fed back and the turn goes on step by step, workers/tool_steps.py). Conversations whose dataset
history has tool calls were cut at the submit (turns up to the first tool call: the conversation record's
``cut_at_tool``).

Whatever :meth:`TurnChainer.plan` decides for a row — its successor, or why the chain ends there — is also written
into the row itself (its ``chain_end`` column, :attr:`NextTurn.chain_end`: thinkfleet/chain_end.py), before the part
is written: storage alone says where every conversation stands, which ``producer verify`` and ``wait`` check.

A re-run of turn i (``producer retry --truncated``: revision r > 0) re-derives the turns after it. The answer
record keeps the revision it was decoded from (``"revision"``), and turn i+1 is enqueued one revision above its
own recorded answer (0 when it has none), so its new row wins the committed view; ``finalize`` takes it out of
``done``/``dead`` as it enqueues it, and its own finalize re-derives turn i+2 the same way. The re-run's
``max_new_tokens`` (its override, read back from the row's ``sampling_params``) goes with the re-derived turns.
When the re-run ends the chain early (a tool call, an error), the later turns leave ``done``/``dead``
(``NextTurn.drop``); their stored rows are superseded (``thinkfleet.turns.beyond_chain_ends``).
Later turns are queued at the job's priority (:meth:`TurnChainer.placement`), their messages saying it: onto this
worker's host list, offered first to this host whose server has their prefix cached (thinkfleet/broker/affinity.py),
or the shared queue. Each carries how much of its prompt that server computed (``prefix_reusable``, the longest
common prefix with turn i's prompt + output ids), which its row stores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import redis.asyncio as aioredis

from storage.schema import CHAIN_END
from thinkfleet.broker.affinity import HostAffinity, Placement
from thinkfleet.chain_end import END_RENDER_ERROR, end_of
from thinkfleet.keys import Keys
from thinkfleet.message import MessageRefused, PromptTask, content_hash, pack_ids
from thinkfleet.signing import signer_for
from thinkfleet.state.job import JobRecord
from thinkfleet.template import TokenizerError, fingerprint, load_tokenizer, render_ids
from thinkfleet.tool_steps import agentic
from thinkfleet.turns import (
    TURNS_FIELD,
    answer_message,
    answer_revision,
    answers_key,
    conversations_key,
    regenerates_all_turns,
    split_step_id,
    split_turn_id,
    turn_id,
    turn_messages,
    turns_meta,
)
from thinkfleet.vision import ImageRef
from workers.hooks import CommitGroup, FinalizeWrites, PostCommitHook, StoredRow
from workers.jobs import JobCache, JobSpec, UnknownJob, confined_tokenizer, tokenizer_roots

log = logging.getLogger(__name__)

#: The row columns a multi-turn job fills (null for single-turn jobs).
CONVERSATION_ID, TURN_INDEX, TURN_COUNT = "conversation_id", "turn_index", "turn_count"
#: An agentic job's (thinkfleet/tool_steps.py): the step of the turn, and whether its calls' arguments differ
#: from the dataset's.
STEP_INDEX, TOOL_ARGS_DIFFER = "step_index", "tool_args_differ"
ROW_COLUMNS = (
    "prompt_id",
    "revision",
    "sampling_params",
    "input_ids",
    "output_ids",
    "reasoning_start",
    "reasoning_end",
    "answer_start",
    "answer_end",
    "tool_call_spans",
)


# -- the worker's side --------------------------------------------------------------------------------------
class TurnError(Exception):
    """Turn i+1 cannot be rendered here (tokenizer mismatch, no conversation record)."""


class RenderFailed(TurnError):
    """Turn i+1's (or step j+1's) message cannot be built from a history the job's chat template or the message
    encoding refuses (a system message after the first, roles that do not alternate, a value JSON cannot hold): a
    fault of that conversation, so its chain ends ``render_error: …`` (thinkfleet/chain_end.py) — never the commit."""

    def __init__(self, next_id: str, exc: BaseException) -> None:
        from workers.outcomes import crash_summary

        super().__init__(f"{next_id}: {crash_summary(exc)}")


@dataclass(frozen=True)
class NextTurn:
    """What ``Ledger.finalize`` records for one finalized turn."""

    prompt_id: str  # turn i
    answer: str  # JSON of turn i's answer (with chain_end when no turn follows)
    next_prompt_id: str = ""  # "" when the conversation ends here
    next_hash: str = ""
    next_message: bytes = b""
    #: Later turns a chain that ends here no longer derives: out of done/dead (their rows are superseded).
    drop: tuple[str, ...] = ()

    @property
    def chain_end(self) -> str:
        """The row's ``chain_end`` column (thinkfleet/chain_end.py): "" when it enqueues its successor, else the
        answer record's reason, else ``complete`` — the same decision the finalize carries, stored with the row."""
        if not self.answer:
            return ""  # a fenced run's (workers/tool_steps.py): it records nothing, and mark_part refuses its row
        reason = json.loads(self.answer).get("chain_end") if not self.next_prompt_id else None
        return end_of(self.next_prompt_id, str(reason) if reason else None)


class _JobTurns:
    """What one generation of a job's record renders its next turns with: the record, its ``turns`` field, the
    tokenizer (loaded and checked against the record's fingerprint) and the tool markers."""

    def __init__(self, record: JobRecord, tok: Any, meta: dict[str, Any] | None = None) -> None:
        from storage.conversations import ToolMarkers

        self.record, self.tok, self.markers = record, tok, ToolMarkers.of(record)
        #: The record's ``turns`` field (its agentic settings: thinkfleet/tool_steps.py).
        self.meta: dict[str, Any] = dict(meta or {})


class TurnChainer:
    """Computes, for rows of a multi-turn job, their turn columns and the next turn's message.

    What it knows of a job is keyed by (job, generation): the record in force is asked of :class:`JobCache`
    (``current``: its generation read each time, the record re-read when it changed), so a worker that lived
    through ``producer purge`` and a new submit derives later turns with the new record and generation — a turn
    derived with the purged one would be skipped as superseded, and its chain never go on."""

    def __init__(
        self, client: aioredis.Redis, keys: Keys, settings: Any, writer: Any = None, jobs: JobCache | None = None
    ) -> None:
        self.r, self.keys, self.settings, self.writer = client, keys, settings, writer
        #: The worker's ledger (set by the runtime): an agentic step's executor call is fenced by its claim there.
        self.ledger: Any = None
        self.queue: str = settings.queue
        self.signer = signer_for(settings)
        #: The worker's job records (shared with the pipeline), re-read per generation.
        self.jobs = jobs if jobs is not None else JobCache(client, keys, self.signer)
        #: (job, generation) → what that record renders with.
        self._jobs: dict[tuple[str, str], _JobTurns] = {}
        #: (tokenizer path, fingerprint, remote code) → the loaded tokenizer: a new generation of the same job
        #: (a purge and the same submit) does not load it again.
        self._toks: dict[tuple[str, str, bool], Any] = {}
        self._loading = asyncio.Lock()
        #: The model directory this node's server serves (the default tokenizer root); set by the runtime.
        self.served_model: Any = lambda: None
        #: Where next turns are offered (this worker's host list, thinkfleet/broker/affinity.py); set by the runtime.
        #: None: the shared queue.
        self.affinity: HostAffinity | None = None
        self._envelopes: dict[int, Any] = {}

    async def _current(self, job: str) -> JobSpec | None:
        """The job's record in force now (checked), None when it has none (purged, or Redis lost it);
        :class:`MessageRefused` when it is not the producer's."""
        try:
            return await self.jobs.current(job)
        except UnknownJob:
            return None

    async def multi_turn(self, job: str) -> bool:
        try:
            spec = await self._current(job)
        except MessageRefused:
            # Not the producer's record: its rows still chain, and each chain ends saying why (_job refuses it).
            return regenerates_all_turns(turns_meta(await self.r.hget(self.keys.job(job), TURNS_FIELD)))
        return spec is not None and spec.multi_turn

    async def meta(self, job: str) -> dict[str, Any]:
        """The ``turns`` field of the job's record in force ({} without one)."""
        try:
            spec = await self._current(job)
        except MessageRefused:
            return {}
        return dict(spec.turns) if spec is not None else {}

    async def conversation(self, job: str, conv: str, checked: bool = False) -> dict[str, Any]:
        """The conversation record; ``checked``: its signature verified (with a key) — what a next turn is
        rendered from."""
        raw = await self.r.hget(conversations_key(self.keys, job), conv)
        if raw is None:
            raise TurnError(f"job {job}: no conversation record for {conv!r}")
        record = json.loads(raw)
        if checked and self.signer is not None and not self.signer.doc_valid("conversation", job, conv, record):
            raise TurnError(f"job {job}: conversation {conv!r} does not match its signature (not the producer's)")
        return record

    def _sign_answer(self, job: str, prompt_id: str, answer: dict[str, Any]) -> str:
        if self.signer is not None:
            answer = self.signer.sign_doc("answer", job, prompt_id, answer)
        return json.dumps(answer, ensure_ascii=False)

    async def _job(self, job: str) -> _JobTurns:
        """What the job's record in force renders with, by (job, generation)."""
        try:
            spec = await self._current(job)
        except MessageRefused as exc:
            raise TurnError(str(exc)) from exc
        if spec is None or spec.record is None:
            raise TurnError(f"job {job}: no job record")
        at = (job, spec.generation)
        if at not in self._jobs:
            # One load at a time: orphan finalizes run concurrently (a re-submit's resumed chains reach a fresh
            # worker all at once), and transformers' lazy imports fail when two threads import it at once
            # (ImportError: cannot import name 'AutoTokenizer'), a crash that lost the head's part.
            async with self._loading:
                if at not in self._jobs:
                    record, turns = spec.record, spec.turns
                    remote = bool(turns.get("trust_remote_code"))
                    path = self._tokenizer_path(record, remote)
                    trust = remote and bool(getattr(self.settings, "trust_remote_code", False))
                    key = (path, record.tokenizer_fingerprint, trust)
                    if key not in self._toks:
                        self._toks[key] = await asyncio.to_thread(_load_checked, record, trust, path)
                    self._jobs[at] = _JobTurns(record, self._toks[key], turns)
        return self._jobs[at]

    def _tokenizer_path(self, record: JobRecord, remote_code: bool) -> str:
        """The job's tokenizer path resolved inside this worker's roots, or TurnError (the pipeline refuses such a
        job's messages before they run: this is the last line, for a record changed since)."""
        if remote_code and not getattr(self.settings, "trust_remote_code", False):
            raise TurnError(f"job {record.name}: remote_code_refused: its tokenizer's own code is not run here")
        roots = tokenizer_roots(getattr(self.settings, "tokenizer_roots", ""), self.served_model())
        path = confined_tokenizer(record.tokenizer, roots)
        if path is None:
            raise TurnError(f"job {record.name}: tokenizer_refused: {record.tokenizer!r} is outside {roots}")
        return path

    async def priority(self, job: str) -> int:
        """The priority of the job's record in force, as a kombu step (0 without a record): later turns queue
        at it."""
        try:
            spec = await self._current(job)
        except MessageRefused:
            spec = None
        record = spec.record if spec is not None else None
        return _priority_step(record.priority if record is not None else 0)

    async def queue_for(self, job: str) -> str:
        """The shared list ``finalize`` pushes the job's next turns onto without affinity: its priority list (as its
        submit queued)."""
        from thinkfleet.broker.keys import priority_list

        return priority_list(self.queue, await self.priority(job))

    async def placement(self, job: str) -> Placement:
        """Where ``finalize`` pushes the job's next turns: this worker's host list at the job's priority, offered
        (thinkfleet/broker/affinity.py: this host's server has their prefix cached), or the shared queue."""
        if self.affinity is None:
            return Placement(await self.queue_for(job))
        return await self.affinity.place(await self.priority(job))

    async def annotate(self, job: str, rows: list[dict[str, Any]]) -> None:
        """Fill the turn columns of a multi-turn job's rows (before they are written)."""
        if not await self.multi_turn(job):
            return
        meta = await self.meta(job)
        for row in rows:
            parts = split_turn_id(row["prompt_id"])
            if parts is None:
                continue
            conv = await self.conversation(job, parts[0])
            row[CONVERSATION_ID], row[TURN_INDEX], row[TURN_COUNT] = parts[0], parts[1], int(conv["turn_count"])
            if agentic(meta):
                row[STEP_INDEX] = (split_step_id(row["prompt_id"]) or ("", 0, 0))[2]

    async def plan(self, job: str, dataset: str, rows: list[dict[str, Any]]) -> list[NextTurn | None]:
        """Per row: None (not a turn of a multi-turn job) or what its finalize records and enqueues."""
        if not await self.multi_turn(job):
            return [None] * len(rows)
        out = []
        for row in rows:
            nxt = await self._next_or_end(job, dataset, row)
            if nxt is not None:  # how the chain goes on or ends is stored with the row (storage outlives Redis)
                row[CHAIN_END] = nxt.chain_end
            out.append(nxt)
        return out

    async def plan_stored(self, job: str, dataset: str, part: str, prompt_id: str) -> NextTurn | None:
        """:meth:`plan` for a row already in a committed part (the orphan recovery)."""
        if not await self.multi_turn(job) or split_turn_id(prompt_id) is None:
            return None
        row = await asyncio.to_thread(self._read_row, job, dataset, part, prompt_id)
        if row is None:
            raise TurnError(f"part {part} has no row for {prompt_id}")
        return await self._next_or_end(job, dataset, row)

    async def _next_or_end(self, job: str, dataset: str, row: dict[str, Any]) -> NextTurn | None:
        """:meth:`_next`; a turn that cannot be rendered here ends its chain, saying why in its answer record
        (a Redis error propagates: the commit is retried); one whose history the template refuses ends it
        ``render_error: …`` (:class:`RenderFailed`)."""
        try:
            return await self._next(job, dataset, row)
        except TurnError as exc:
            log.error("multi-turn chain of %s/%s ends: %s", job, row["prompt_id"], exc)
            await self.r.hincrby(self.keys.counters(job), "turn_chain_errors", 1)
            reason = f"{END_RENDER_ERROR}: {exc}" if isinstance(exc, RenderFailed) else f"error: {exc}"
            return NextTurn(row["prompt_id"], self._sign_answer(job, row["prompt_id"], {"chain_end": reason}))

    def _read_row(self, job: str, dataset: str, part: str, prompt_id: str) -> dict[str, Any] | None:
        import pyarrow.compute as pc

        loc = self.writer.loc
        path = loc.path(part)
        if loc.fs.get_file_info(path).type == pafs.FileType.File:
            with loc.fs.open_input_file(path) as f:
                table = pq.read_table(f, columns=list(ROW_COLUMNS))
        else:  # compacted since
            from storage.reader import read_committed

            table = read_committed(loc.uri(loc.root), job, columns=list(ROW_COLUMNS), datasets=[dataset])
        table = table.filter(pc.equal(table["prompt_id"], prompt_id))
        return table.to_pylist()[0] if table.num_rows else None

    async def _next(self, job: str, dataset: str, row: dict[str, Any]) -> NextTurn | None:
        parts = split_turn_id(row["prompt_id"])
        if parts is None:
            return None
        conv_id, turn = parts
        conv = await self.conversation(job, conv_id, checked=True)
        jt = await self._job(job)
        if agentic(jt.meta):
            return await self._agentic_next(jt, job, dataset, row, conv)
        answer = _answer(jt, row)
        revision = int(row.get("revision") or 0)
        recorded = {**answer, "revision": revision} if revision else answer
        count = int(conv["turn_count"])
        if turn + 1 >= count:
            return NextTurn(row["prompt_id"], self._sign_answer(job, row["prompt_id"], recorded))
        if answer.get("tool_calls"):
            # The next user turn would follow a call with no result: the chain ends here, and says so (a
            # re-run that now ends here takes the turns it no longer derives out of done).
            ended = {**recorded, "chain_end": "tool_call"}
            later = tuple(turn_id(conv_id, k) for k in range(turn + 1, count))
            return NextTurn(row["prompt_id"], self._sign_answer(job, row["prompt_id"], ended), drop=later)
        next_id = turn_id(conv_id, turn + 1)
        earlier = [turn_id(conv_id, k) for k in range(turn)]
        *raw, following = await self.r.hmget(answers_key(self.keys, job), [*earlier, next_id])
        if any(r is None for r in raw):
            raise TurnError(f"{row['prompt_id']}: an earlier turn's answer is not recorded")
        records = [json.loads(r) for r in raw]
        if self.signer is not None:
            for pid, rec in zip(earlier, records, strict=True):
                if not self.signer.doc_valid("answer", job, pid, rec):
                    raise TurnError(f"{pid}: its recorded answer does not match its signature (not a worker's)")
        answers = [answer_message(r) for r in records] + [answer]
        messages = turn_messages(conv, answers)
        digest, message = await self.render_next(jt, job, dataset, row, conv, next_id, messages, following)
        return NextTurn(row["prompt_id"], self._sign_answer(job, row["prompt_id"], recorded), next_id, digest, message)

    async def render_next(
        self,
        jt: _JobTurns,
        job: str,
        dataset: str,
        row: dict[str, Any],
        conv: dict[str, Any],
        next_id: str,
        messages: list[dict[str, Any]],
        following: bytes | None,
    ) -> tuple[str, bytes]:
        """:meth:`next_message` of ``messages`` rendered with the job's template: :class:`RenderFailed` when the
        template or the message encoding refuses them (the chain ends saying why; a TurnError stays one)."""
        try:
            ids = await asyncio.to_thread(self._render, jt, messages, conv.get("tools"))
            return await self.next_message(jt, job, dataset, row, conv, next_id, ids, following)
        except TurnError:
            raise
        except Exception as exc:  # the user's template and data: whatever they raise is this conversation's
            raise RenderFailed(next_id, exc) from exc

    async def next_message(
        self,
        jt: _JobTurns,
        job: str,
        dataset: str,
        row: dict[str, Any],
        conv: dict[str, Any],
        next_id: str,
        ids: list[int],
        following: bytes | None,
    ) -> tuple[str, bytes]:
        """The next turn's (or step's) content hash and encoded message, from its rendered ``ids`` and the answer
        record ``following`` already holds for ``next_id`` (None: none yet). An image conversation's message carries
        the images its history holds (:func:`history_images`), each once, as the one placeholder it was rendered
        with: the ids are rendered from the messages, never from an earlier turn's expanded ids."""
        media = history_images(jt.record, conv, ids, next_id)
        digest = content_hash(ids, [m.sha256 for m in media]) if media else content_hash(ids)
        # A re-derivation (turn i+1 has an answer: a row of it is stored) goes one revision above that row.
        # Only finalize writes answers, and turn i+1's is not written before turn i's finalize enqueues it:
        # the orphan recovery computes the same revision.
        next_revision = answer_revision(json.loads(following)) + 1 if following is not None else 0
        # A turn an earlier chain dropped had its revision raised there (finalize.lua): derived again, it goes at
        # that revision at least, or its claim would take the new message for a leftover copy and skip it.
        raised = await self.r.hget(self.keys.revisions(job), next_id)
        next_revision = max(next_revision, int(raised or 0))
        # What of it turn i's server has computed (the template decides: Kimi's drops earlier reasoning, so usually
        # turn i's prompt; a tool step may keep it all): the row's prefix_reusable_tokens, the cache's hit rate.
        reusable = shared_prefix([*row["input_ids"], *row["output_ids"]], ids)
        task = PromptTask(
            job,
            dataset,
            next_id,
            int(conv["row_index"]),
            digest,
            pack_ids(ids),
            revision=next_revision,
            overrides=_carried(jt.record, dataset, row),
            generation=jt.record.generation,
            prefix_reusable=reusable,
            media=media,
        )
        # the priority of the record this turn is derived with (its generation's), as that record's submit queued
        return digest, self._encode(task, _priority_step(jt.record.priority))

    async def _agentic_next(
        self, jt: _JobTurns, job: str, dataset: str, row: dict[str, Any], conv: dict[str, Any]
    ) -> NextTurn:
        """An agentic job's step (``tool_results`` set): chained by :class:`workers.tool_steps.StepChainer`, the
        chainer a worker runs; this one renders plain turns only."""
        raise TurnError(f"{row['prompt_id']}: an agentic job's steps need workers.tool_steps.StepChainer")

    def _render(self, jt: _JobTurns, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        return render_ids(jt.tok, messages, tools, dict(jt.record.chat_template_kwargs))

    def _encode(self, task: PromptTask, priority: int) -> bytes:
        if priority not in self._envelopes:
            from thinkfleet.broker.envelope import Envelope  # loads Celery: only for a multi-turn job

            self._envelopes[priority] = Envelope(self.settings, priority)
        return self._envelopes[priority].encode(task)


class TurnChaining(PostCommitHook):
    """Multi-turn chaining as a post-commit hook: a turn's row gets its turn columns before the write, and its
    finalize records its answer and enqueues the next turn (exactly once: in the finalize's own Lua call)."""

    name = "turn-chaining"

    def __init__(self, chainer: TurnChainer) -> None:
        self.chainer = chainer

    async def before_write(self, group: CommitGroup) -> FinalizeWrites | None:
        # Turn columns before the write; the next turns from the rows as they will be stored.
        await self.chainer.annotate(group.job, group.rows)
        return await self._writes(group.job, await self.chainer.plan(group.job, group.dataset, group.rows))

    async def before_orphan_finalize(self, row: StoredRow) -> FinalizeWrites | None:
        # The next turn from the stored row: what the run that wrote it would have enqueued.
        return await self._writes(
            row.job, [await self.chainer.plan_stored(row.job, row.dataset, row.part, row.prompt_id)]
        )

    async def _writes(self, job: str, nexts: list[NextTurn | None]) -> FinalizeWrites | None:
        rows = {n.prompt_id: n for n in nexts if n is not None}
        if not rows:
            return None  # no turn of a multi-turn job among them: the plain finalize
        answers = answers_key(self.chainer.keys, job)
        if not any(n.next_prompt_id for n in rows.values()):  # nothing enqueued: no placement to choose
            return FinalizeWrites(await self.chainer.queue_for(job), answers, rows)
        place = await self.chainer.placement(job)  # (offers are counted by the finalize that makes them: ledger.py)
        return FinalizeWrites(place.queue, answers, rows, place.offers)


def history_images(record: JobRecord, conv: dict[str, Any], ids: list[int], prompt_id: str) -> tuple[ImageRef, ...]:
    """The images of a later turn's rendered ``ids``: the conversation's first k images (the producer recorded them
    in order, ``conv["images"]``), k the placeholders the template rendered, each at its placeholder. A history
    only grows, so its images are always the first ones; :class:`TurnError` when the ids hold more placeholders
    than the conversation has images (an answer that spelled the placeholder token)."""
    refs = conv.get("images") or []
    pid = record.image_placeholder_id
    if not refs or pid is None:
        return ()
    positions = [i for i, t in enumerate(ids) if t == pid]
    if len(positions) > len(refs):
        raise TurnError(
            f"{prompt_id}: its rendered history holds {len(positions)} image placeholder(s) ({pid}) for the "
            f"conversation's {len(refs)} image(s): an answer spelled the placeholder token"
        )
    return tuple(
        dataclasses.replace(ImageRef.from_wire(ref), position=p) for ref, p in zip(refs, positions, strict=False)
    )


def shared_prefix(before: Sequence[int], ids: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences."""
    import numpy as np

    a, b = np.asarray(before, dtype=np.int64), np.asarray(ids, dtype=np.int64)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _priority_step(priority: int | None) -> int:
    from thinkfleet.broker.keys import priority_step

    return priority_step(priority)


def _carried(record: JobRecord, dataset: str, row: dict[str, Any]) -> dict[str, Any]:
    """The overrides turn i+1 inherits from turn i's row: its ``max_new_tokens`` where it is not the job's (a
    ``producer retry --truncated --max-new-tokens`` re-run's budget goes with the turns it re-derives)."""
    try:
        sent = json.loads(row.get("sampling_params") or "{}")
    except (TypeError, ValueError):
        return {}
    budget = sent.get("max_new_tokens") if isinstance(sent, dict) else None
    base = {**record.sampling_params, **(record.dataset_sampling.get(dataset) or {})}
    return {"max_new_tokens": int(budget)} if budget is not None and budget != base.get("max_new_tokens") else {}


def _answer(jt: _JobTurns, row: dict[str, Any]) -> dict[str, Any]:
    from storage.conversations import output_message

    spans = [(s["start"], s["end"]) if isinstance(s, dict) else tuple(s) for s in row.get("tool_call_spans") or []]
    return output_message(
        jt.tok,
        list(row["output_ids"]),
        (int(row["reasoning_start"]), int(row["reasoning_end"])),
        (int(row["answer_start"]), int(row["answer_end"])),
        spans,
        jt.markers,
    )


def _load_checked(record: JobRecord, trust_remote_code: bool, path: str | None = None) -> Any:
    """The job's tokenizer from its path on this node (``path``: as resolved inside the worker's roots), refused
    unless its fingerprint is the job's."""
    try:
        tok = load_tokenizer(path or record.tokenizer, trust_remote_code)
    except TokenizerError as exc:
        raise TurnError(f"job {record.name}: {exc}") from exc
    found = fingerprint(tok, tok.get_vocab())
    if record.tokenizer_fingerprint and found != record.tokenizer_fingerprint:
        raise TurnError(
            f"job {record.name}: the tokenizer at {record.tokenizer} has fingerprint {found}, the job's is "
            f"{record.tokenizer_fingerprint}: not rendering its next turns with another tokenizer"
        )
    return tok
