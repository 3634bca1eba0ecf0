"""What a prompt must fit before it is sent: the vocabulary and context of the server that will run it, or the job
record's when the server reports none, and the model the job expects.

The limits come from the server (workers/health.py reads them whenever it reopens) and fall back to what the
producer recorded from the model's config at submit. A job's first prompt in this worker runs its preflight once
per record generation (a purged and re-submitted job may name another tokenizer): the record's fallbacks, and the
warning that seeds are ignored by a server without deterministic inference.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from workers.attempts import HandBack
from workers.health import HealthGate
from workers.jobs import JobCache
from workers.metrics import WorkerMetrics
from workers.sglang import PermanentError, RequestLimits, ServerInfo, check_request

log = logging.getLogger("thinkfleet.worker")


@dataclass(frozen=True)
class JobCheck:
    """What a job's preflight read once from its record: the fallback limits when the server reports none."""

    vocab_size: int | None
    context_length: int | None
    vocab_source: str = ""
    context_source: str = ""


@dataclass(frozen=True)
class Fitted:
    """A request checked against the limits it must fit: ``refused`` set when it must never be sent."""

    limits: RequestLimits
    refused: PermanentError | None
    info: ServerInfo | None  # the server's info the limits were read from


def output_vocab(limits: RequestLimits) -> int | None:
    """The bound output ids are checked against: the model's vocabulary (the server's, or config.json's from the
    job record). ``len(tokenizer)`` is no bound for what the model emits (its embedding may be larger: Qwen3's
    151,936 rows for 151,669 tokens), so then only int32 is checked."""
    if limits.vocab_size and "len(tokenizer)" not in (limits.vocab_source or ""):
        return limits.vocab_size
    return None


class JobLimits:
    """The limits of each job's prompts in this worker, its preflight run once per job generation."""

    def __init__(
        self, settings: Settings, redis: aioredis.Redis, jobs: JobCache, gate: HealthGate, metrics: WorkerMetrics
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.jobs = jobs
        self.gate = gate
        self.metrics = metrics
        self._checks: dict[str, JobCheck] = {}
        self._lock = asyncio.Lock()  # one preflight (and one warning) per job

    async def fit(
        self, task: PromptTask, sampling: dict[str, Any], input_ids: list[int], expected_model: str
    ) -> Fitted:
        """The request's limits and, when it must not be sent, why (an id >= the vocabulary, an overflowing
        context: neither may reach the GPU). A server serving another model than the job expects hands it back."""
        info = self.gate.info
        if expected_model and info and info.model_path != expected_model:
            log.error(
                "job %s expects model %s but %s serves %s: refusing",
                task.job, expected_model, self.settings.sglang_url, info.model_path,
            )  # fmt: skip
            self.metrics.errors.labels("model_mismatch").inc()
            await asyncio.sleep(self.settings.health_interval_s)
            raise HandBack()
        max_new = sampling.get("max_new_tokens")
        max_new = int(max_new) if max_new is not None else None
        limits = await self.limits(task, sampling, info)
        # an image prompt's placeholders count as the tokens the server expands them into (its context check's)
        images = sum(m.tokens - 1 for m in task.media)
        refused = check_request(input_ids, max_new, limits, images)
        if refused is not None and refused.error_class == "context_overflow":
            # The server may have restarted with a longer context since the gate read it (it reads it only when
            # it reopens): read it once more, and dead-letter only what the server's present context refuses.
            fresh = await self.gate.refresh_info(info)
            if fresh is not info:
                info = fresh
                limits = await self.limits(task, sampling, info)
                refused = check_request(input_ids, max_new, limits, images)
        return Fitted(limits, refused, info)

    async def limits(self, task: PromptTask, sampling: dict[str, Any], info: ServerInfo | None) -> RequestLimits:
        """The limits a prompt of ``task``'s job must fit: the server's, else the job record's."""
        key = f"{task.job}\0{task.generation}"
        check = self._checks.get(key)
        if check is None:
            async with self._lock:
                check = self._checks.get(key) or await self._preflight(task, key, sampling, info)
        vocab = info.vocab_size if info and info.vocab_size else None
        context = info.context_length if info and info.context_length else None
        return RequestLimits(
            vocab_size=vocab or check.vocab_size,
            vocab_source="reported by the server" if vocab else f"from the job record{check.vocab_source}",
            context_length=context or check.context_length,
            context_source="reported by the server" if context else f"from the job record{check.context_source}",
            max_req_input_len=info.max_req_input_len if info else None,
            context_check_inclusive=info.context_check_inclusive if info else True,
            version=info.version if info else None,
        )

    async def _preflight(
        self, task: PromptTask, key: str, sampling: dict[str, Any], info: ServerInfo | None
    ) -> JobCheck:
        job = task.job
        # the record as read (and checked) for the job's spec, of the message's generation
        record = (await self.jobs.get(job, task.dataset, task.generation)).record
        vocab = getattr(record, "vocab_size", None)
        context = getattr(record, "context_length", None)
        vocab_from = getattr(record, "vocab_source", "")
        context_from = getattr(record, "context_source", "")
        check = JobCheck(
            vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
            context_length=context if isinstance(context, int) and context > 0 else None,
            vocab_source=f": {vocab_from}" if vocab_from else "",
            context_source=f": {context_from}" if context_from else "",
        )
        self._checks[key] = check
        seeded = sampling.get("sampling_seed") is not None
        deterministic = info.deterministic if info else None
        if seeded and deterministic is False:
            log.error(
                "\n%s\nNONDETERMINISTIC SEEDS for job %s: its sampling_params carry sampling_seed=%s, but %s does not "
                "run --enable-deterministic-inference,\nso SGLang ignores the seed: rows are NOT reproducible from "
                "their seed (each row records deterministic=false).\nRestart SGLang with "
                "--enable-deterministic-inference (a throughput cost) if reproducibility matters.\n%s",
                "!" * 78,
                job,
                sampling.get("sampling_seed"),
                self.settings.sglang_url,
                "!" * 78,
            )
            await self.redis.hset(self.settings.keys.counters(job), "nondeterministic_seeds", 1)
        elif seeded and deterministic is None:
            log.warning(
                "job %s sends sampling_seed but %s does not report whether deterministic inference is on: "
                "rows record deterministic=null",
                job,
                self.settings.sglang_url,
            )
        return check
