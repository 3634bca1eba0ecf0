"""What a worker needs from a job record, read once per job and cached."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields
from typing import Any

import redis.asyncio as aioredis

from storage.spans import KIMI_TOKENS, SpanTokens
from thinkfleet.keys import Keys


class UnknownJob(Exception):
    """A message names a job with no record in Redis (Redis lost without a re-submit?)."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    sampling_params: dict[str, Any]
    tokenizer_fingerprint: str
    chat_template_hash: str
    expected_model: str | None
    tokens: SpanTokens = KIMI_TOKENS  # the marker ids spans are found with

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params.get("max_new_tokens") or 128)


def _decode(raw: dict[bytes, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in raw.items():
        text = v.decode()
        try:
            out[k.decode()] = json.loads(text)
        except ValueError:
            out[k.decode()] = text
    return out


def spec_from_record(job: str, record: dict[str, Any]) -> JobSpec:
    sampling = dict(record.get("sampling_params") or {})

    def token(name: str) -> int:
        # A producer that found no such token in its tokenizer stores None: keep Kimi's default.
        value = record.get(name)
        return int(value) if value is not None else getattr(KIMI_TOKENS, name)

    return JobSpec(
        name=job,
        sampling_params=sampling,
        tokenizer_fingerprint=str(record.get("tokenizer_fingerprint") or ""),
        chat_template_hash=str(record.get("chat_template_hash") or ""),
        expected_model=record.get("expected_model") or None,
        tokens=SpanTokens(
            **{f.name: token(f.name) for f in fields(SpanTokens) if f.name != "stop_token_ids"},
            stop_token_ids=tuple(int(t) for t in (sampling.get("stop_token_ids") or KIMI_TOKENS.stop_token_ids)),
        ),
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
                raw = await self.r.hgetall(self.keys.job(job))
                if not raw:
                    raise UnknownJob(f"job {job!r} has no record at {self.keys.job(job)}; re-run producer submit")
                self._specs[job] = spec_from_record(job, _decode(raw))
        return self._specs[job]
