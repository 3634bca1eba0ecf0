"""What a worker needs from a job record, read once per job and cached.

The record is decoded by ``thinkfleet.state.job.JobRecord`` (one decoder, one set of defaults);
:class:`JobSpec` is the slice of it the generate → row path uses.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.keys import Keys
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
    tokens: SpanTokens = KIMI_TOKENS  # the marker ids spans are found with

    @property
    def max_new_tokens(self) -> int:
        """The record's budget, else the job record's default (``JobRecord.max_new_tokens``)."""
        return max_new_tokens_of(self.sampling_params)

    @classmethod
    def from_record(cls, record: JobRecord) -> JobSpec:
        return cls(
            name=record.name,
            sampling_params=dict(record.sampling_params),
            tokenizer_fingerprint=record.tokenizer_fingerprint,
            chat_template_hash=record.chat_template_hash,
            expected_model=record.expected_model or None,
            tokens=record.span_tokens(),
        )


class JobCache:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.r = client
        self.keys = keys
        self._specs: dict[str, JobSpec] = {}
        self._lock = asyncio.Lock()

    async def get(self, job: str) -> JobSpec:
        spec = self._specs.get(job)
        if spec is not None:
            return spec
        async with self._lock:
            if job not in self._specs:
                record = await JobRecord.aload(self.r, self.keys, job)
                if record is None:
                    raise UnknownJob(f"job {job!r} has no record at {self.keys.job(job)}; re-run producer submit")
                self._specs[job] = JobSpec.from_record(record)
        return self._specs[job]
