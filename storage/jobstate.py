"""What storage's tools read about a job from Redis: its record, submitted set and dead letters.

Redis is a cache of the truth for completion (storage is the truth), but it is the only record of
what was submitted and what failed for good — unless Redis was lost, in which case the storage
manifest stands in for the submitted set. Every read here tolerates an unreachable Redis.

The job record is decoded by ``thinkfleet.state.job.JobRecord`` (the one decoder, with its defaults);
``JobState.record`` is that record as a dict, empty when the job has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.tokens import SpanTokens


@dataclass
class JobState:
    redis_ok: bool
    record: dict[str, Any] = field(default_factory=dict)  # JobRecord.to_dict(), {} when there is none
    submitted: dict[str, str] = field(default_factory=dict)  # prompt_id → content hash
    prompt_dataset: dict[str, str] = field(default_factory=dict)  # prompt_id → dataset
    dead: dict[str, dict[str, Any]] = field(default_factory=dict)  # prompt_id → dead-letter record
    error: str | None = None  # why Redis could not be read


def load_job_state(settings: Settings, job: str, timeout_s: float = 5.0) -> JobState:
    keys = settings.keys
    try:
        client = sync_client(settings.redis_url, timeout_s=timeout_s, connect_timeout_s=timeout_s)
        with client:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(keys.job(job))
            pipe.hgetall(keys.prompts(job))
            pipe.hgetall(keys.prompt_dataset(job))
            pipe.hgetall(keys.dead(job))
            record, prompts, datasets, dead = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        return JobState(redis_ok=False, error=f"{type(exc).__name__}: {exc}")
    return JobState(
        redis_ok=True,
        record=JobRecord.from_hash(record, name=job).to_dict() if record else {},
        submitted={k.decode(): v.decode() for k, v in prompts.items()},
        prompt_dataset={k.decode(): v.decode() for k, v in datasets.items()},
        dead={k.decode(): _as_dict(_json_or_text(v)) for k, v in dead.items()},
    )


def span_tokens(record: dict[str, Any] | JobRecord) -> SpanTokens:
    """How a job's rows were spanned: ``JobRecord.span_tokens`` of its record — its model profile's
    scheme (think markers or harmony channels, :mod:`thinkfleet.profiles`) with the ids its tokenizer gave.

    Takes ``JobState.record`` (a dict, empty when Redis had no record: read as a pre-profile Kimi job)
    or a ``JobRecord``.
    """
    if not isinstance(record, JobRecord):
        record = JobRecord.from_dict(record)
    return record.span_tokens()


def _json_or_text(raw: bytes) -> Any:
    text = raw.decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {"message": str(value)}
