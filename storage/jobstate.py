"""What storage's tools read about a job from Redis: its record, submitted set and dead letters.

Redis is a cache of the truth for completion (storage is the truth), but it is the only record of
what was submitted and what failed for good — unless Redis was lost, in which case the storage
manifest stands in for the submitted set. Every read here tolerates an unreachable Redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from storage.spans import SpanTokens
from thinkfleet import kimi
from thinkfleet.settings import Settings


@dataclass
class JobState:
    redis_ok: bool
    record: dict[str, Any] = field(default_factory=dict)  # the job record, JSON fields decoded
    submitted: dict[str, str] = field(default_factory=dict)  # prompt_id → content hash
    prompt_dataset: dict[str, str] = field(default_factory=dict)  # prompt_id → dataset
    dead: dict[str, dict[str, Any]] = field(default_factory=dict)  # prompt_id → dead-letter record
    error: str | None = None  # why Redis could not be read


def load_job_state(settings: Settings, job: str, timeout_s: float = 5.0) -> JobState:
    keys = settings.keys
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
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
        record={k.decode(): _json_or_text(v) for k, v in record.items()},
        submitted={k.decode(): v.decode() for k, v in prompts.items()},
        prompt_dataset={k.decode(): v.decode() for k, v in datasets.items()},
        dead={k.decode(): _as_dict(_json_or_text(v)) for k, v in dead.items()},
    )


def span_tokens(record: dict[str, Any]) -> SpanTokens:
    """The marker ids a job's rows were spanned with (the record's, else Kimi's)."""
    sampling = record.get("sampling_params") or {}
    stops = sampling.get("stop_token_ids") if isinstance(sampling, dict) else None

    def pick(name: str, default: int) -> int:
        value = record.get(name)
        return int(value) if value not in (None, "") else default

    return SpanTokens(
        think_start_id=pick("think_start_id", kimi.THINK_START),
        think_end_id=pick("think_end_id", kimi.THINK_END),
        tool_section_begin_id=pick("tool_section_begin_id", kimi.TOOL_CALLS_SECTION_BEGIN),
        tool_section_end_id=pick("tool_section_end_id", kimi.TOOL_CALLS_SECTION_END),
        tool_call_begin_id=pick("tool_call_begin_id", kimi.TOOL_CALL_BEGIN),
        tool_call_end_id=pick("tool_call_end_id", kimi.TOOL_CALL_END),
        stop_token_ids=tuple(int(t) for t in stops) if stops else kimi.DEFAULT_STOP_TOKEN_IDS,
    )


def _json_or_text(raw: bytes) -> Any:
    text = raw.decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {"message": str(value)}
