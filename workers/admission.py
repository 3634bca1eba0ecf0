"""Before a claim: may this message run here, and on which ids?

A decoded message is admitted — its job's spec and its verified prompt ids — or ends here without touching its
prompt's claim: refused unsigned (the malformed list), dead-lettered (an unknown job, a record the producer did not
sign, a tokenizer this worker may not run, ids the message's own checks refuse), skipped
(a message of a purged job's older generation), parked (its job is paused) or dead-lettered ``cancelled``. Each of
those is a decision about the *message*, taken before the prompt's run begins (workers/pipeline.py), so none of them
holds a claim.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.message import MessageLimits, MessageRefused, PromptTask
from thinkfleet.settings import Settings
from thinkfleet.signing import signer_for
from thinkfleet.state.counters import STALE_GENERATION
from thinkfleet.state.lifecycle import CANCELLED, CANCELLED_CLASS, PAUSED
from thinkfleet.state.scripts import lua
from workers.attempts import HandBack
from workers.health import HealthGate
from workers.jobs import JobCache, JobSpec, UnknownJob, tokenizer_refusal, tokenizer_roots
from workers.limits import JobLimits
from workers.metrics import WorkerMetrics
from workers.outcomes import Outcomes

log = logging.getLogger("thinkfleet.worker")


@dataclass(frozen=True)
class Admitted:
    """A message that may run: its job's spec and its prompt ids, checked."""

    job: JobSpec
    input_ids: list[int]


class Admission:
    """:meth:`admit` a decoded message: :class:`Admitted`, or the outcome it ended with (or :class:`HandBack`)."""

    def __init__(
        self,
        settings: Settings,
        redis: aioredis.Redis,
        jobs: JobCache,
        gate: HealthGate,
        limits: JobLimits,
        outcomes: Outcomes,
        metrics: WorkerMetrics,
        cancelled_jobs: set[str],
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.jobs = jobs
        self.gate = gate
        self.limits = limits
        self.outcomes = outcomes
        self.metrics = metrics
        #: Jobs seen cancelled (shared with workers/attempts.py, which stops their requests' retries).
        self.cancelled_jobs = cancelled_jobs
        #: With a signing key (thinkfleet/signing.py), only work the producer signed runs here.
        self.signer = signer_for(settings)
        self._envelope: Any = None  # thinkfleet.broker.envelope.Envelope, built when a paused job's message is parked
        self._park_one: Any = None

    async def admit(self, task: PromptTask) -> Admitted | str:
        if self.signer is not None:
            try:
                self.signer.check_task(task)
            except MessageRefused as exc:
                return await self._refused_unsigned(task, exc)
        try:
            job = await self.jobs.get(task.job, task.dataset, task.generation)
        except UnknownJob as exc:
            return await self.outcomes.dead(task, "unknown_job", str(exc))
        except MessageRefused as exc:
            # The job record is not the one the producer signed (unsigned_job / bad_job_signature): nothing of it
            # is used; the message is kept whole in the dead letter (producer retry, once the record is re-signed).
            return await self.outcomes.dead(task, exc.error_class, exc.detail)
        if task.generation and job.generation and task.generation != job.generation:
            return await self._stale_generation(task, job)
        lifecycle = await self._job_lifecycle(task)
        if lifecycle is not None:
            return lifecycle
        roots = self._tokenizer_roots() if job.multi_turn else []
        if roots is None:
            log.warning(
                "%s/%s: no server info yet (the model directory it serves): handed back", task.job, task.prompt_id
            )
            self.metrics.handed_back.inc()
            raise HandBack()
        try:
            # What the worker runs is its own choice (workers/jobs.py): a --turns all job's tokenizer code and path.
            refusal = tokenizer_refusal(job, self.settings.trust_remote_code, roots)
            if refusal is not None:
                raise refusal
            # The message's own checks (thinkfleet/message.py): overrides whitelist, ids decoded within
            # max_prompt_tokens, corrupt blob, content hash recomputed, ids below the vocabulary.
            vocab = (await self.limits.limits(task, job.sampling_params, self.gate.info)).vocab_size
            input_ids = task.verified_ids(MessageLimits(self.settings.max_prompt_tokens, vocab))
        except MessageRefused as exc:
            # Resending it cannot help: dead-lettered with the check it failed (the whole message kept).
            return await self.outcomes.dead(task, exc.error_class, exc.detail)
        # An image prompt's images are read and checked after its claim (workers/images.py, in the trip).
        return Admitted(job, input_ids)

    async def _stale_generation(self, task: PromptTask, job: JobSpec) -> str:
        """A message of the job as it was before `producer purge` and a new submit: never run with the new record
        (its sampling, tokenizer, output may differ); the new submit enqueued its own."""
        log.warning(
            "%s/%s: message of job generation %s, the job is generation %s now (purged and re-submitted): "
            "skipped", task.job, task.prompt_id, task.generation, job.generation,
        )  # fmt: skip
        self.metrics.skipped.inc()
        # Counted where `producer status` reads it: a skip is never silent (the new submit re-enqueued it).
        await self.redis.hincrby(self.settings.keys.counters(task.job), STALE_GENERATION, 1)
        return "already-superseded"

    async def _job_lifecycle(self, task: PromptTask) -> str | None:
        """An outcome for a message of a paused job (parked, acked) or a cancelled one (dead-lettered
        ``cancelled``); None when the job is active (producer pause/resume/cancel, thinkfleet/state/lifecycle.py)."""
        keys = self.settings.keys
        state = await self.redis.get(keys.job_state(task.job))
        if state is None:
            self.cancelled_jobs.discard(task.job)
            return None
        if state == PAUSED.encode():
            if self._envelope is None:
                from thinkfleet.broker.envelope import Envelope

                self._envelope = await asyncio.to_thread(Envelope, self.settings)
            if self._park_one is None:
                self._park_one = self.redis.register_script(lua("park_one"))
            raw = self._envelope.encode(task)
            if await self._park_one(keys=[keys.job_state(task.job), keys.parked(task.job)], args=[raw]):
                log.info("job %s is paused: parked %s", task.job, task.prompt_id)
                return "parked"
            return None  # resumed meanwhile
        if state == CANCELLED.encode():
            self.cancelled_jobs.add(task.job)
            # one line per message of a cancelled job would flood the log: producer status counts them
            return await self.outcomes.dead(
                task, CANCELLED_CLASS, "job cancelled (producer cancel)", level=logging.DEBUG
            )
        return None

    async def _refused_unsigned(self, task: PromptTask, exc: MessageRefused) -> str:
        """A message the producer did not sign (or that changed since): recorded in the fleet-wide malformed list
        with its reason and args, counted, acked — and nothing of the job it names is touched, so a forged copy of
        a real prompt can never take that prompt out of the queue's reach (a dead letter would)."""
        log.error("refused message %s: %s", task.task_id, exc)
        self.metrics.errors.labels(exc.error_class).inc()
        try:
            args: Any = task.to_args()
        except Exception:
            args = "<unrepresentable>"
        await self.outcomes.malformed(task.task_id, f"{exc.error_class}: {exc.detail}", args)
        return "refused"

    def _tokenizer_roots(self) -> list[str] | None:
        """Where this worker loads a --turns all job's tokenizer from; None while the default (the served model
        directory) is unknown (no server info yet)."""
        info = self.gate.info
        if not self.settings.tokenizer_roots and (info is None or not info.model_path):
            return None
        return tokenizer_roots(self.settings.tokenizer_roots, info.model_path if info else None)
