"""The prompt pipeline: one message → claim → /generate → row → group commit → its outcome.

:class:`PromptPipeline` turns a message's args into exactly one of three outcomes, whatever is raised on
the way: *stored* (or found stored already; the row is durable, the message is acked), *dead-lettered*
with its reason and the whole message (``producer retry`` resends it) — including ``poison:<Class>`` for a
prompt whose deliveries crashed ``max_deliveries`` times —, or *handed back* (:class:`HandBack`, never
acked). The claim in Redis (thinkfleet/state/ledger.py) makes a second delivery of a prompt cost nothing;
the request attempts are workers/attempts.py's, the commit workers/committer.py's. The worker's lifecycle
(start, the consuming switch, drain) is workers/runtime.py's.

The trip reads as that: :meth:`PromptPipeline.process` admits the message (workers/admission.py: signature, job,
lifecycle, the message's own checks), takes the prompt's claim (workers/claims.py: one run per prompt per process,
suspect groups, waits on another worker's run), and :meth:`PromptPipeline._trip` generates (within
workers/limits.py's limits), builds the row, commits it and returns the outcome; every other ending is
workers/outcomes.py's. What follows a stored row (multi-turn chaining, tool steps, …) is a post-commit hook
(workers/hooks.py), registered by the runtime and entered by the committer and by :meth:`PromptPipeline._stored`
without this module knowing what it does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from storage.layout import PartPathRefused, confine_part
from storage.spans import prompt_opens_reasoning
from storage.writer import PartWriter
from thinkfleet.failpoints import failpoint
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import Ledger
from workers.admission import Admission
from workers.attempts import HandBack, RequestAttempts
from workers.claims import Claims, Poisoned, Run
from workers.committer import BadRow, Fenced, GroupCommitter, RowFailed, StorageUnavailable
from workers.health import HealthGate
from workers.hooks import Committed, PostCommitHooks
from workers.images import ImageNotSent, ImageSender
from workers.jobs import JobCache, JobSpec
from workers.limits import JobLimits, output_vocab
from workers.metrics import WorkerMetrics
from workers.outcomes import Outcomes, crash_summary
from workers.rows import build_row, final_row
from workers.sglang import PermanentError

log = logging.getLogger("thinkfleet.worker")


class PromptPipeline:
    """:meth:`handle` (a message's args) or :meth:`process` (a decoded task) → an outcome. The trip itself is
    :meth:`_trip`; who may run (admission), the claim (claims), the limits and the endings each live in their own
    module, and what follows a stored row in the post-commit hooks."""

    def __init__(
        self,
        settings: Settings,
        identity: str,
        redis: aioredis.Redis,
        ledger: Ledger,
        jobs: JobCache,
        writer: PartWriter,
        committer: GroupCommitter,
        gate: HealthGate,
        attempts: RequestAttempts,
        metrics: WorkerMetrics,
        draining: Callable[[], bool],
        hooks: PostCommitHooks | None = None,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.ledger = ledger
        self.writer = writer
        self.committer = committer
        self.gate = gate
        self.attempts = attempts
        self.metrics = metrics
        self.hooks = hooks or PostCommitHooks()
        self.outcomes = Outcomes(settings, redis, ledger, metrics)
        self.limits = JobLimits(settings, redis, jobs, gate, metrics)
        self.admission = Admission(
            settings, redis, jobs, gate, self.limits, self.outcomes, metrics, attempts.cancelled_jobs
        )
        self.claims = Claims(settings, identity, redis, ledger, committer, metrics, draining)
        #: An image prompt's images: read from the job's store once per worker, checked, sent as data: URIs.
        #: Its stores' gates (a store this host cannot read hands its prompts back) go to the heartbeat (status).
        self.images = ImageSender(settings, redis, identity, draining=draining)

    async def handle(self, args: Any, message_id: str | None = None) -> str:
        """A message's args → its outcome (the message is acked), or :class:`HandBack` (requeued). Nothing
        else escapes."""
        task: PromptTask | None = None
        try:
            failpoint("after_pop", _prompt_of(args))
            try:
                task = PromptTask.from_args(args)
            except Exception as exc:
                return await self._malformed(args, message_id, exc)
            outcome = await self.process(task)
            failpoint("before_ack", task.prompt_id)
            return outcome
        except HandBack:
            raise
        except Exception as exc:
            # Our own bug or an injected fault outside the prompt pipeline: hand back, counted as a crash.
            log.exception("unexpected error handling message %s: handing it back", message_id)
            if task is not None:
                try:
                    return await asyncio.wait_for(self._crashed(task, exc, claimed=False), 30)
                except HandBack:
                    raise
                except Exception as inner:
                    log.error("could not record the crash of %s: %s", message_id, inner)
            self.metrics.handed_back.inc()
            raise HandBack() from exc

    async def _malformed(self, args: Any, message_id: str | None, exc: Exception) -> str:
        """A message that is not a prompt task at all: no job to dead-letter it in, so it goes to the
        fleet-wide malformed list (reason and body kept), is counted, and is acked."""
        log.error("malformed message %s dead-lettered to %s: %s", message_id, self.settings.keys.malformed, exc)
        self.metrics.errors.labels("malformed_message").inc()
        await self.outcomes.malformed(message_id, f"{type(exc).__name__}: {exc}", args)
        return "malformed"

    async def push_malformed(self, record: str) -> None:
        await self.outcomes.push_malformed(record)

    async def process(self, task: PromptTask) -> str:
        """One decoded task: an outcome, or raises HandBack."""
        try:
            admitted = await self.admission.admit(task)
            if isinstance(admitted, str):
                return admitted
            taken = await self.claims.take(task, admitted.job)
            if isinstance(taken, str):
                return taken
            if isinstance(taken, Poisoned):
                return await self.outcomes.poison(task, taken.error, taken.record)
            return await self._trip(task, admitted.job, admitted.input_ids, taken)
        except HandBack:
            raise
        except RedisError as exc:
            # Past the client's retries. Failing the task would let Celery ack (drop) the message.
            log.warning("Redis unreachable while handling %s/%s, handing it back: %s", task.job, task.prompt_id, exc)
            self.metrics.errors.labels("redis").inc()
            self.metrics.handed_back.inc()
            self.claims.release_when_back(task)
            raise HandBack() from exc

    async def _trip(self, task: PromptTask, job: JobSpec, input_ids: list[int], run: Run) -> str:
        """The core trip of a claimed prompt: generate → row → commit → outcome (or finalize the row an earlier run
        committed), whatever is raised on the way."""
        try:
            failpoint("after_claim", task.prompt_id)
            # A previous run committed the part but never marked it done (a death, a hand-back after an
            # ambiguous commit, or a finalize Redis lost): finalize from that part, never generate a second row.
            part = self._confined_part(task, run.part)  # from Redis: a part of this job, or not used
            if part is not None and await asyncio.to_thread(self.writer.exists, part):
                orphan = await self._finish_orphan(task, job, input_ids, part)
                if orphan is not None:
                    return orphan
            return await self._generate_and_store(task, job, input_ids, run.epoch)
        except Fenced as exc:
            # Paused past our lease: another run holds the prompt now. Nothing of ours was counted; ack. We lived,
            # so the death its takeover charged to the prompt is taken back.
            self.metrics.errors.labels("fenced").inc()
            log.warning(
                "fenced: %s/%s ran under epoch %s, its claim is %s now: acked without storing",
                task.job, task.prompt_id, run.epoch, exc.holder,
            )  # fmt: skip
            await self.claims.came_back(task, run.epoch)
            return "fenced"
        except BadRow as exc:
            return await self.outcomes.dead(task, "bad_output", f"the row cannot be stored: {exc}", 1)
        except RowFailed as exc:  # its hooks (a next turn, a tool step) raised past their tries: it ends alone
            return await self.outcomes.dead(task, exc.error_class, exc.reason, 1)
        except (HandBack, StorageUnavailable) as exc:
            await self.claims.release(task)
            self.metrics.handed_back.inc()
            raise HandBack() from exc
        except RedisError:
            raise
        except Exception as exc:
            return await self._crashed(task, exc, claimed=True)
        finally:
            await self.claims.end(task, run)

    async def _generate_and_store(self, task: PromptTask, job: JobSpec, input_ids: list[int], epoch: int) -> str:
        sampling = {**job.sampling_for(task.dataset), **task.overrides}
        fitted = await self.limits.fit(task, sampling, input_ids, job.expected_model)
        if fitted.refused is not None:
            # Never sent: an id >= the vocabulary or an overflowing context must not reach the GPU.
            refused = fitted.refused
            return await self.outcomes.dead(task, refused.error_class, refused.message, level=logging.WARNING)
        images = None
        if task.media:
            try:
                images = await self.images.prepare(task, job, input_ids, self.gate.info or fitted.info)
            except ImageNotSent as exc:  # never sent without its images, nor with other bytes than submitted
                return await self.outcomes.dead(task, exc.error_class, exc.detail, level=logging.WARNING)
        try:
            # Every answer is validated against the vocabulary here (BadOutput, retried): a bad row never
            # reaches a commit group, where it would fail its neighbours' encode. An image prompt's answer must
            # show the prompt expanded as sent (ImageTokensMismatch: dead-lettered bad_output at once).
            vocab = output_vocab(fitted.limits)
            try:
                gen, attempts, latency = await self.attempts.run(task, input_ids, sampling, vocab, images)
            finally:
                self.images.release(images)  # the request ended: its images' bytes go back to the budget
        except PermanentError as exc:
            # bad_output keeps what the server answered (exc.answer) in the dead letter.
            n = getattr(exc, "attempts", 1)
            return await self.outcomes.dead(task, exc.error_class, exc.message, n, exc.answer, logging.WARNING)
        info = self.gate.info or fitted.info
        model = info.model_path if info else ""
        deterministic = info.deterministic if info else None
        row, final = build_row(
            task, job, input_ids, gen, sampling, self.identity, model, attempts, latency, deterministic, epoch, info
        )
        # Waits through storage failures (the commit is retried); raises StorageUnavailable only if a
        # drain gives up on it, which hands the prompt back.
        part = await self.committer.commit(task.job, task.dataset, row, final)
        self.metrics.completed.labels(task.dataset).inc()
        self.metrics.output_tokens.inc(gen.completion_tokens)
        self.metrics.note_prefix(task.prefix_reusable, gen.cached_tokens)  # a later turn's prefix cache
        return await self._stored(Committed(task, job, final, part, row), "stored")

    async def _stored(self, committed: Committed, outcome: str) -> str:
        """The row is durable and finalized: the post-commit hooks' after phase, then the outcome (a hook's
        error is logged and counted by the hooks, never the prompt's: its row is stored)."""
        await self.hooks.after_commit(committed)
        return outcome

    async def _crashed(self, task: PromptTask, exc: BaseException, claimed: bool) -> str:
        """An unexpected exception: log it with context, count the delivery as crashed, hand it back —
        or dead-letter it as ``poison:<Class>`` once ``max_deliveries`` deliveries crashed."""
        summary = crash_summary(exc)
        log.error(
            "crash while handling %s/%s (%s): %s",
            task.job,
            task.prompt_id,
            "claimed" if claimed else "before its claim",
            summary,
            exc_info=exc,
        )
        self.metrics.crashes.labels(type(exc).__name__).inc()
        self.metrics.errors.labels("crash").inc()
        crashes = await self.ledger.crashed(task.job, task.prompt_id, summary)
        if crashes == 0:  # stored or dead-lettered already (a crash after the commit): ack it
            return "already-finished"
        if crashes >= self.settings.max_deliveries:
            return await self.outcomes.poison(task, summary, {"x": crashes, "k": 0, "ik": 0})
        self.metrics.handed_back.inc()
        raise HandBack() from exc

    def _confined_part(self, task: PromptTask, part: str | None) -> str | None:
        """A claim's recorded part when it is a part of the prompt's job and dataset (storage/layout.py
        ``confine_part``); a path outside is refused — counted, logged, never read — and the prompt generated."""
        if not part:
            return None
        try:
            return confine_part(self.writer.loc, task.job, part, task.dataset)
        except PartPathRefused as exc:
            self.metrics.errors.labels("part_path_refused").inc()
            log.error("%s/%s: its claim's part is refused: %s; generating it", task.job, task.prompt_id, exc)
            return None

    async def _finish_orphan(self, task: PromptTask, job: JobSpec, input_ids: list[int], part: str) -> str | None:
        """Finalize a prompt from a committed part with the row's real counts (the row keeps the epoch it was
        written under): the outcome, or None if the row is not there (generate it)."""
        row = await asyncio.to_thread(self.writer.final_counts, task.job, task.dataset, part, task.prompt_id)
        if row is None:
            log.warning("part %s has no row for %s/%s: generating it", part, task.job, task.prompt_id)
            return None
        revision = int(row.get("revision") or 0)
        if revision < task.revision:
            # A run of an older revision (producer retry --truncated asked for this one since): never this
            # message's row — finalize would refuse it (mark_part.lua/finalize.lua fence revisions); generate.
            log.warning(
                "part %s holds revision %d of %s/%s, this message is revision %d: generating it",
                part, revision, task.job, task.prompt_id, task.revision,
            )  # fmt: skip
            return None
        if row.get("content_hash") and row["content_hash"] != task.content_hash:
            # Not this message's row: another prompt under the id (a turn re-derived from another answer since it
            # was stored — a resumed chain whose earlier turn was generated again). Finalizing it would commit a
            # turn not rendered from the committed turn before it: generate this one (its row wins by epoch).
            log.warning(
                "part %s holds %s/%s with other content (%s, the message's %s): generating it",
                part, task.job, task.prompt_id, row["content_hash"], task.content_hash,
            )  # fmt: skip
            return None
        log.info("prompt %s/%s was committed in %s by an earlier run: finalizing", task.job, task.prompt_id, part)
        # As a fresh row would be finalized (rows.final_row): an orphan of a thinking-off job is no alarm row.
        opens = prompt_opens_reasoning(input_ids, job.tokens)
        truncated = row["finish_reason"] == "length"
        epoch = int(row.get("epoch") or 0)
        counts = int(row["completion_tokens"]), bool(row["has_think_end"])
        final = final_row(task, job, *counts, truncated, opens, epoch, revision)
        # (its quality flags are not read back: status's live flag counts leave out a recovered orphan; verify, the
        # report and the card count it from storage)
        finalized = await self.committer.finalize_orphan(task.job, task.dataset, part, final)
        if task.prompt_id in finalized.fenced:
            raise Fenced(finalized.fenced[task.prompt_id])
        return await self._stored(Committed(task, job, final, part, None), "already-stored")


def _prompt_of(args: Any) -> str | None:
    """The prompt id of a raw message's args, if it has one (failpoints key on it)."""
    try:
        return str(args[2])
    except Exception:
        return None
