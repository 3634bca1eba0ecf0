"""The job record: one Redis HASH (``Keys.job(job)``) per job, every field JSON-encoded.

Workers read it to know how to generate (``workers/jobs.py`` reads the same field names); ``producer
status`` and ``verify`` read it to know what was submitted. Fields:

=============================== ==========================================================================
``name``                        job name
``datasets``                    {dataset: prompts submitted (samples counted)}
``prompts`` / ``prompt_tokens`` totals over the datasets
``samples``                     generations per source row (``--samples``)
``tokenizer``                   the path or hub id the prompts were rendered with
``tokenizer_fingerprint``       hash of vocabulary + special tokens (workers/verify compare it)
``chat_template_hash``          hash of the chat template text
``chat_template_kwargs``        e.g. {"thinking": true}
``sampling_params``             SGLang ``sampling_params``: temperature, top_p, top_k, min_p,
                                max_new_tokens, stop_token_ids, and sampling_seed when ``--seed`` is set
``think_start_id``              ``<think>`` id (None when the tokenizer has none)
``think_end_id``                ``</think>`` id
``tool_section_begin_id`` …     ``tool_section_end_id``, ``tool_call_begin_id``,
                                ``tool_call_argument_begin_id``, ``tool_call_end_id``: tool-call markers
``prompt_ends_with_think_start`` every prompt's last id is ``think_start_id`` (so ``reasoning_start`` = 0)
``expected_model``              ``--expect-model``: workers refuse a server serving another model path
``created_at`` / ``updated_at`` unix seconds
``submissions``                 how many submits wrote this record
``skipped`` / ``skipped_count`` rows skipped by ``--skip-invalid``: [{location, reason}] (first 1000)
=============================== ==========================================================================

Per-sample seeds: with ``--seed`` and ``--samples N > 1``, each sample's message carries its own
``sampling_seed`` override (seed + sample index), so samples of one prompt differ.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import redis

from thinkfleet import kimi
from thinkfleet.keys import Keys

#: Default generation budget (the seed run's limit).
DEFAULT_MAX_NEW_TOKENS = 10_240
#: Kimi-K2.5's recommended sampling for thinking mode.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.95
#: Skipped-row records kept in the job record (the count is exact).
MAX_SKIPPED_RECORDS = 1000


@dataclass
class JobRecord:
    name: str
    datasets: dict[str, int] = field(default_factory=dict)
    prompts: int = 0
    prompt_tokens: int = 0
    samples: int = 1
    tokenizer: str = ""
    tokenizer_fingerprint: str = ""
    chat_template_hash: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_params: dict[str, Any] = field(default_factory=dict)
    think_start_id: int | None = kimi.THINK_START
    think_end_id: int | None = kimi.THINK_END
    tool_section_begin_id: int | None = None
    tool_section_end_id: int | None = None
    tool_call_begin_id: int | None = None
    tool_call_argument_begin_id: int | None = None
    tool_call_end_id: int | None = None
    prompt_ends_with_think_start: bool = False
    expected_model: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    submissions: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    skipped_count: int = 0

    # -- sampling ---------------------------------------------------------------------------------
    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)

    @property
    def stop_token_ids(self) -> list[int]:
        return [int(t) for t in self.sampling_params.get("stop_token_ids") or kimi.DEFAULT_STOP_TOKEN_IDS]

    # -- Redis ------------------------------------------------------------------------------------
    def to_hash(self) -> dict[str, str]:
        return {k: json.dumps(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> JobRecord:
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for k, v in raw.items():
            key = k.decode() if isinstance(k, bytes) else k
            if key not in known:
                continue  # a newer producer's field: ignore rather than fail
            text = v.decode() if isinstance(v, bytes) else v
            try:
                values[key] = json.loads(text)
            except ValueError:
                values[key] = text
        return cls(**values)

    @classmethod
    def load(cls, client: redis.Redis, keys: Keys, job: str) -> JobRecord | None:
        """The record of ``job``, or None when it was never submitted (or Redis lost it)."""
        raw = client.hgetall(keys.job(job))
        return cls.from_hash(raw) if raw else None

    def save(self, client: redis.Redis | redis.client.Pipeline, keys: Keys) -> None:
        """Write every field (inside the caller's MULTI when ``client`` is a pipeline)."""
        client.hset(keys.job(self.name), mapping=self.to_hash())
        client.sadd(keys.jobs, self.name)


def sampling_params(
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    top_k: int = -1,
    min_p: float = 0.0,
    stop_token_ids: list[int] | tuple[int, ...] = kimi.DEFAULT_STOP_TOKEN_IDS,
    seed: int | None = None,
) -> dict[str, Any]:
    """SGLang ``sampling_params`` for the job record (names as SGLang spells them)."""
    params: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "min_p": float(min_p),
        "stop_token_ids": [int(t) for t in stop_token_ids],
    }
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def sample_overrides(params: dict[str, Any], sample_index: int, samples: int) -> dict[str, Any]:
    """Per-message overrides: distinct seeds for the samples of one prompt when a seed is fixed."""
    if samples > 1 and params.get("sampling_seed") is not None:
        return {"sampling_seed": int(params["sampling_seed"]) + sample_index}
    return {}
