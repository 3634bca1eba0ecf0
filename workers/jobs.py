"""What a worker needs from a job record, read once per job and cached.

The record is decoded by ``thinkfleet.state.job.JobRecord`` (one decoder, one set of defaults);
:class:`JobSpec` is the slice of it the generate → row path uses.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from thinkfleet.profiles import expects_reasoning as job_expects_reasoning
from thinkfleet.state.job import JobRecord, max_new_tokens_of
from thinkfleet.tokens import KIMI_TOKENS, SpanTokens


class UnknownJob(Exception):
    """A message names a job with no record in Redis (Redis lost without a re-submit?)."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    sampling_params: dict[str, Any]  # as the record stores them: what SGLang is sent
    tokenizer_fingerprint: str
    chat_template_hash: str
    expected_model: str | None
    tokens: SpanTokens = KIMI_TOKENS  # how spans are found: the record's profile and marker ids
    #: {dataset: sampling_params keys of that dataset} (the record's ``dataset_sampling``)
    dataset_sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the datasets the record listed when it was read (a later submit may add some: :class:`JobCache`)
    datasets: frozenset[str] = frozenset()
    #: Every row is expected to reason, whatever its prompt (a thinking-mode job of a family whose model opens
    #: reasoning itself: ``thinkfleet.profiles.expects_reasoning``); else only rows whose prompt opens it.
    expects_reasoning: bool = False
    #: The record's generation (``JobRecord.generation``; '' = a record from before generations).
    generation: str = ""

    @property
    def reasoning_spans(self) -> bool:
        """False for a job run with ``--no-reasoning-spans``: no reasoning spans, no reasoning alarm."""
        return self.tokens.reasoning_spans

    @property
    def max_new_tokens(self) -> int:
        """The record's budget, else the job record's default (``JobRecord.max_new_tokens``)."""
        return max_new_tokens_of(self.sampling_params)

    def sampling_for(self, dataset: str) -> dict[str, Any]:
        """What a row of ``dataset`` is sent, before its message's own overrides (which the caller merges
        last): the job's ``sampling_params`` ← the dataset's own (a job file's ``datasets[i].sampling``)."""
        return {**self.sampling_params, **(self.dataset_sampling.get(dataset) or {})}

    @classmethod
    def from_record(cls, record: JobRecord) -> JobSpec:
        return cls(
            name=record.name,
            sampling_params=dict(record.sampling_params),
            tokenizer_fingerprint=record.tokenizer_fingerprint,
            chat_template_hash=record.chat_template_hash,
            expected_model=record.expected_model or None,
            tokens=record.span_tokens(),
            dataset_sampling={name: dict(params) for name, params in record.dataset_sampling.items()},
            datasets=frozenset(record.datasets),
            expects_reasoning=job_expects_reasoning(
                record.model_family, record.chat_template_kwargs, record.span_tokens().reasoning_spans
            ),
            generation=record.generation,
        )


class JobCache:
    """Job specs, read once per job — and again when a message names a dataset the cached record did not
    list: a re-submit that adds a dataset (with its own sampling) writes the record in the same MULTI that
    enqueues its messages, so the record read then has it. Each (job, dataset) re-reads at most once.

    And again when a message names another generation than the cached record (``producer purge`` and a new
    ``submit``): each (job, generation) re-reads at most once; a message whose generation is still not the
    record's is of a purged job (the caller skips it, and claim.lua checks it again atomically)."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.r = client
        self.keys = keys
        self._specs: dict[str, JobSpec] = {}
        self._reread: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()

    async def get(self, job: str, dataset: str | None = None, generation: str = "") -> JobSpec:
        spec = self._specs.get(job)
        if spec is not None and self._fresh(spec, job, dataset, generation):
            return spec
        async with self._lock:
            spec = self._specs.get(job)
            if spec is None or not self._fresh(spec, job, dataset, generation):
                if generation:
                    self._reread.add((job, f"generation:{generation}"))
                record = await JobRecord.aload(self.r, self.keys, job)
                if record is None:
                    raise UnknownJob(f"job {job!r} has no record at {self.keys.job(job)}; re-run producer submit")
                self._specs[job] = JobSpec.from_record(record)
                if dataset is not None:
                    self._reread.add((job, dataset))
        return self._specs[job]

    def _fresh(self, spec: JobSpec, job: str, dataset: str | None, generation: str = "") -> bool:
        if generation and generation != spec.generation and (job, f"generation:{generation}") not in self._reread:
            return False
        return dataset is None or dataset in spec.datasets or (job, dataset) in self._reread
