"""What a worker needs from a job record, read once per job and cached."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from thinkfleet import kimi
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
    think_start_id: int = kimi.THINK_START
    think_end_id: int = kimi.THINK_END
    tool_section_begin_id: int = kimi.TOOL_CALLS_SECTION_BEGIN
    tool_section_end_id: int = kimi.TOOL_CALLS_SECTION_END
    tool_call_begin_id: int = kimi.TOOL_CALL_BEGIN
    tool_call_end_id: int = kimi.TOOL_CALL_END
    stop_token_ids: tuple[int, ...] = kimi.DEFAULT_STOP_TOKEN_IDS

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
    stops = tuple(int(t) for t in (sampling.get("stop_token_ids") or kimi.DEFAULT_STOP_TOKEN_IDS))
    return JobSpec(
        name=job,
        sampling_params=sampling,
        tokenizer_fingerprint=str(record.get("tokenizer_fingerprint") or ""),
        chat_template_hash=str(record.get("chat_template_hash") or ""),
        expected_model=record.get("expected_model") or None,
        think_start_id=int(record.get("think_start_id") or kimi.THINK_START),
        think_end_id=int(record.get("think_end_id") or kimi.THINK_END),
        tool_section_begin_id=int(record.get("tool_section_begin_id") or kimi.TOOL_CALLS_SECTION_BEGIN),
        tool_section_end_id=int(record.get("tool_section_end_id") or kimi.TOOL_CALLS_SECTION_END),
        tool_call_begin_id=int(record.get("tool_call_begin_id") or kimi.TOOL_CALL_BEGIN),
        tool_call_end_id=int(record.get("tool_call_end_id") or kimi.TOOL_CALL_END),
        stop_token_ids=stops,
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
