"""The job record: one Redis HASH (``Keys.job(job)``) per job, every field JSON-encoded.

``producer submit`` writes it; workers read it to know how to generate (``workers/jobs.py``), and
``producer status``/``verify``/``export`` to know what was submitted. :class:`JobRecord` is the one
decoder (``from_hash``/``load``/``aload``), so every reader sees the same defaults. Fields, with the
value a reader gets when the field is absent:

================================ =================== ======================================================
field                            absent →            what
================================ =================== ======================================================
``name``                         the key's job       job name
``datasets``                     {}                  {dataset: prompts submitted (samples counted)}
``prompts`` / ``prompt_tokens``  0                   totals over the datasets
``samples``                      1                   generations per source row (``--samples``)
``tokenizer``                    ""                  the path or hub id the prompts were rendered with
``tokenizer_fingerprint``        ""                  hash of vocabulary + special tokens (workers/verify
                                                     compare it)
``chat_template_hash``           ""                  hash of the chat template text
``chat_template_kwargs``         {}                  e.g. {"thinking": true}
``sampling_params``              {}                  SGLang ``sampling_params``: temperature, top_p, top_k,
                                                     min_p, max_new_tokens, stop_token_ids, and
                                                     sampling_seed when ``--seed`` is set
``model_family``                 "kimi"              the model profile (``thinkfleet.profiles``): kimi, qwen3,
                                                     deepseek, glm45, harmony, none — detected from the
                                                     tokenizer or ``--model-family``
``reasoning_spans``              true                false: ``--no-reasoning-spans`` (the tokenizer lacks the
                                                     profile's reasoning markers, or the user said so): rows
                                                     carry null reasoning spans and the alarm is off
``think_start_id``               Kimi's 163606 (*)   ``<think>`` id; null when the tokenizer has none
``think_end_id``                 Kimi's 163607 (*)   ``</think>`` id (harmony: ``<|end|>``, which closes the
                                                     analysis message); null when the tokenizer has none
``tool_section_begin_id`` …      Kimi's 163595 … (*) ``tool_section_end_id``, ``tool_call_begin_id``,
                                                     ``tool_call_argument_begin_id``, ``tool_call_end_id``:
                                                     tool-call markers of the profile (harmony:
                                                     ``<|channel|>``, ``<|message|>``, ``<|call|>``); null
                                                     when the tokenizer has none
``markers``                      {}                  every token string of the profile the tokenizer has →
                                                     its id, as submit read and checked it (harmony's
                                                     ``<|start|>``, ``<|message|>``, ``<|return|>`` are read
                                                     from here)
``channel_ids``                  {}                  harmony: channel name → its ids (``analysis``, …)
``prompt_ends_with_think_start`` false               every prompt opens reasoning: it ends with
                                                     ``think_start_id``, or with it and a newline
                                                     (``<think>\\n``: storage.spans.prompt_opens_reasoning),
                                                     so ``reasoning_start`` = 0
``expected_model``               null                ``--expect-model``: workers refuse a server serving
                                                     another model path
``created_at`` / ``updated_at``  0 (unknown)         unix seconds (a new ``JobRecord(...)`` gets now)
``submissions``                  0                   how many submits wrote this record
``skipped`` / ``skipped_count``  [] / 0              rows skipped by ``--skip-invalid``: [{location,
                                                     reason}] (first 1000)
``vocab_size``                   null (unknown)      every prompt id is below it (the producer refused the
                                                     rest): ``config.json`` ``vocab_size`` (the model's
                                                     embedding size) when the tokenizer path has one, else
                                                     ``len(tokenizer)``; workers refuse ids at or above it
``vocab_source``                 ""                  where ``vocab_size`` came from, e.g. ``config.json
                                                     text_config.vocab_size`` or ``len(tokenizer)``
``context_length``               null (unknown)      the model's context length: every prompt has
                                                     prompt tokens + max_new_tokens < it (SGLang's rule);
                                                     null = nothing known, nothing checked
``context_source``               ""                  ``--context-length`` or ``config.json
                                                     [text_config.]max_position_embeddings`` (…); "" when
                                                     unknown
``dataset_sampling``             {}                  {dataset: sampling_params keys set for that dataset
                                                     (a job file's ``datasets[i].sampling``)}: its rows
                                                     get ``sampling_params`` ← these (← the message's
                                                     overrides); datasets without any are absent
``dataset_samples``              {}                  {dataset: generations per row} where a dataset's
                                                     ``samples`` differs from ``samples``
``job_file``                     null                the job file (``producer submit job.yaml``) as it
                                                     ran: names and defaults filled, flags applied
``priority``                     0                   the job file's ``priority`` (kept for scheduling)
``logprobs``                     null                ``--logprobs K``: rows carry the sampled token's logprob
                                                     and (K > 0) the top-K alternatives; null = none asked.
                                                     Workers read K from ``sampling_params["logprobs"]``
                                                     (never forwarded to SGLang's ``sampling_params``)
``image_store``                  ""                  image prompts: the root URI of the job's image store
                                                     (storage/images.py); workers read images only from it
                                                     ("": a record from before it, the default store)
``image_placeholder_id``         null                image prompts: the id of the one placeholder the chat
                                                     template renders per image (docs/vision.md)
================================ =================== ======================================================

Marker ids: absent vs null. ``producer submit`` always writes ``model_family`` and every marker field,
each id read from the job's tokenizer (``thinkfleet.profiles.resolve``). (*) A record *without*
``model_family`` is from before model profiles (or written by hand, like the test fleet's): those jobs
were Kimi jobs, so an absent marker reads as Kimi's id — the one place Kimi's ids are a default. In a
record *with* ``model_family`` an absent marker reads as null. A field *present* with null means "this
tokenizer has no such token" and stays None: spans then find no such marker (``thinkfleet.tokens``),
rather than looking for Kimi's ids in another model's output. A null in a field that is not nullable
(say ``sampling_params``) reads as its default.

:meth:`JobRecord.span_tokens` is the one place a job's markers become span rules: the profile's scheme
(think markers, or harmony channels) with the record's ids; reasoning spans off → no think markers.

Sampling defaults: :attr:`JobRecord.max_new_tokens` is ``sampling_params["max_new_tokens"]``, else
:data:`DEFAULT_MAX_NEW_TOKENS`; :attr:`JobRecord.stop_token_ids` is ``sampling_params["stop_token_ids"]``
(when non-empty), else Kimi's ``<|im_end|>``, ``[EOS]``. The producer always writes both.

Per-sample seeds: with ``--seed`` and ``--samples N > 1``, each sample's message carries its own
``sampling_seed`` override (seed + sample index), so samples of one prompt differ.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import redis
import redis.asyncio as aioredis

from thinkfleet import kimi, profiles
from thinkfleet.keys import Keys
from thinkfleet.tokens import SpanTokens

#: Default generation budget, in tokens (the seed run's limit).
DEFAULT_MAX_NEW_TOKENS = 10_240
#: Kimi-K2.5's recommended sampling temperature for thinking mode.
DEFAULT_TEMPERATURE = 1.0
#: Kimi-K2.5's recommended nucleus-sampling top_p for thinking mode.
DEFAULT_TOP_P = 0.95
#: Skipped-row records kept in the job record (the count is exact).
MAX_SKIPPED_RECORDS = 1000

#: The marker-id fields: absent → Kimi's id, present null → None (no such token).
MARKER_FIELDS: tuple[str, ...] = (
    "think_start_id",
    "think_end_id",
    "tool_section_begin_id",
    "tool_section_end_id",
    "tool_call_begin_id",
    "tool_call_argument_begin_id",
    "tool_call_end_id",
)
#: Fields where a stored null is a value; elsewhere null reads as the field's default.
NULLABLE_FIELDS: frozenset[str] = frozenset({*MARKER_FIELDS, "expected_model", "logprobs", "image_placeholder_id"})
_STAMP_FIELDS = ("created_at", "updated_at")


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
    tool_section_begin_id: int | None = kimi.TOOL_CALLS_SECTION_BEGIN
    tool_section_end_id: int | None = kimi.TOOL_CALLS_SECTION_END
    tool_call_begin_id: int | None = kimi.TOOL_CALL_BEGIN
    tool_call_argument_begin_id: int | None = kimi.TOOL_CALL_ARGUMENT_BEGIN
    tool_call_end_id: int | None = kimi.TOOL_CALL_END
    model_family: str = profiles.LEGACY_FAMILY
    reasoning_spans: bool = True
    markers: dict[str, int] = field(default_factory=dict)
    channel_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_ends_with_think_start: bool = False
    expected_model: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    submissions: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    skipped_count: int = 0
    vocab_size: int | None = None
    vocab_source: str = ""
    context_length: int | None = None
    context_source: str = ""
    dataset_sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    dataset_samples: dict[str, int] = field(default_factory=dict)
    job_file: dict[str, Any] | None = None
    priority: int = 0
    logprobs: int | None = None
    #: Minted when the record is created (a first submit, or the first after ``producer purge``); every message
    #: carries it. Workers reload a record whose generation changed and refuse messages of another ('' = a
    #: record of a version before generations: not checked).
    generation: str = ""
    #: Image prompts (docs/vision.md): where the job's images are (workers read nowhere else) and the placeholder id.
    image_store: str = ""
    image_placeholder_id: int | None = None

    # -- sampling ---------------------------------------------------------------------------------
    @property
    def max_new_tokens(self) -> int:
        return max_new_tokens_of(self.sampling_params)

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids_of(self.sampling_params)

    def span_tokens(self) -> SpanTokens:
        """How this job's rows are spanned: its profile's scheme with the marker ids its record holds
        (None where the tokenizer has no such token; no think markers when reasoning spans are off)."""
        return profiles.span_tokens(
            self.model_family,
            {role: getattr(self, role) for role in MARKER_FIELDS},
            self.stop_token_ids,
            reasoning_spans=self.reasoning_spans,
            token_ids=self.markers,
            channel_ids=self.channel_ids,
        )

    def profile(self) -> profiles.ModelProfile | None:
        """The job's model profile (None for a family this version does not know)."""
        return profiles.PROFILES.get(self.model_family)

    # -- decoding ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any], name: str = "") -> JobRecord:
        """A record from already-decoded field values, with this module's defaults for the rest.

        Unknown fields (a newer producer's) are ignored rather than failing; ``name`` stands in
        when the values carry none.
        """
        known = {f.name for f in fields(cls)}
        kept: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                continue
            if value is None and key not in NULLABLE_FIELDS:
                continue  # a null where a value belongs: the default
            if key in MARKER_FIELDS and value is not None:
                value = int(value)
            kept[key] = value
        if "model_family" in kept:  # a profiled record: an absent marker is no marker, not Kimi's
            for marker in MARKER_FIELDS:
                kept.setdefault(marker, None)
        kept.setdefault("name", name)
        for stamp in _STAMP_FIELDS:  # unknown, not "now": every decode of one hash gives one record
            kept.setdefault(stamp, 0.0)
        return cls(**kept)

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str], name: str = "") -> JobRecord:
        """Decode a job HASH as Redis returns it (bytes or str keys/values, each JSON-encoded).

        A value that is not JSON is kept as its text (a hand-written field).
        """
        values: dict[str, Any] = {}
        for k, v in raw.items():
            key = k.decode() if isinstance(k, bytes) else k
            text = v.decode() if isinstance(v, bytes) else v
            try:
                values[key] = json.loads(text)
            except ValueError:
                values[key] = text
        return cls.from_dict(values, name=name)

    @classmethod
    def load(cls, client: redis.Redis, keys: Keys, job: str) -> JobRecord | None:
        """The record of ``job``, or None when it was never submitted (or Redis lost it)."""
        raw = client.hgetall(keys.job(job))
        return cls.from_hash(raw, name=job) if raw else None

    @classmethod
    async def aload(cls, client: aioredis.Redis, keys: Keys, job: str) -> JobRecord | None:
        """:meth:`load` for ``redis.asyncio``."""
        raw = await client.hgetall(keys.job(job))
        return cls.from_hash(raw, name=job) if raw else None

    # -- encoding ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, decoded (what ``from_dict`` takes back)."""
        return asdict(self)

    def to_hash(self) -> dict[str, str]:
        return {k: json.dumps(v) for k, v in asdict(self).items()}

    def save(self, client: redis.Redis | redis.client.Pipeline, keys: Keys, signer: Any = None) -> None:
        """Write every field (inside the caller's MULTI when ``client`` is a pipeline); with ``signer``
        (thinkfleet.signing.Signer) the ``signature`` field that signs them, else none (an older one is dropped)."""
        fields = self.to_hash()
        if signer is not None:
            client.hset(keys.job(self.name), mapping=signer.sign_record_hash(self.name, fields))
        else:
            client.hset(keys.job(self.name), mapping=fields)
            client.hdel(keys.job(self.name), "signature")
        client.sadd(keys.jobs, self.name)


def max_new_tokens_of(params: Mapping[str, Any]) -> int:
    """The generation budget of a job's ``sampling_params``: its own, else :data:`DEFAULT_MAX_NEW_TOKENS`."""
    return int(params.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)


def stop_token_ids_of(params: Mapping[str, Any]) -> list[int]:
    """The stop ids of a job's ``sampling_params``: its own when non-empty, else Kimi's."""
    return [int(t) for t in params.get("stop_token_ids") or kimi.DEFAULT_STOP_TOKEN_IDS]


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
