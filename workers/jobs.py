"""What a worker needs from a job record, read once per job and cached — and what it refuses to believe.

The record is decoded by ``thinkfleet.state.job.JobRecord`` (one decoder, one set of defaults);
:class:`JobSpec` is the slice of it the generate → row path uses.

Trust (the record is written by whoever can write Redis):

- with a signing key (thinkfleet/signing.py) the record and its ``turns`` field must carry the producer's
  signature (:func:`load_job`), else :class:`~thinkfleet.message.MessageRefused` ``unsigned_job`` /
  ``bad_job_signature``: the caller dead-letters the message, whole, and reads the record again for the next one;
- a ``--turns all`` job makes the worker load the job's tokenizer (workers/turns.py). Whether that tokenizer may
  run its own code is the *worker's* setting (``THINKFLEET_TRUST_REMOTE_CODE``, off), and where it may be loaded
  from too (``THINKFLEET_TOKENIZER_ROOTS``, default: the model directory this node's server serves):
  :func:`tokenizer_refusal` says ``remote_code_refused`` / ``tokenizer_refused`` for a job asking for more.
  Those messages are dead-lettered, not handed back: every worker of a fleet configured alike would refuse them
  the same way, so a hand-back would circle them forever with the reason nowhere to be seen, while a dead letter
  keeps the whole message and its reason in the job (``producer status``), and ``producer retry`` resends them
  once the fleet allows the job — nothing is lost.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from thinkfleet.message import MessageRefused
from thinkfleet.profiles import expects_reasoning as job_expects_reasoning
from thinkfleet.signing import Signer
from thinkfleet.state.job import JobRecord, max_new_tokens_of
from thinkfleet.tokens import KIMI_TOKENS, SpanTokens
from thinkfleet.turns import TURNS_FIELD, regenerates_all_turns, turns_meta

#: The job hash's field holding the record's generation (``JobRecord.generation``).
GENERATION_FIELD = "generation"


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
    #: A ``--turns all`` job: workers load its tokenizer (``tokenizer``) to render later turns, with its own code
    #: when the job asks for it (``remote_code``, the ``turns`` field's trust_remote_code) and the worker allows it.
    multi_turn: bool = False
    tokenizer: str = ""
    remote_code: bool = False
    #: The record's ``turns`` field as read and checked (its mode and agentic settings: thinkfleet/tool_steps.py).
    turns: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: The record as read (and, with a signing key, verified): what else of it a worker needs (vocabulary, context).
    record: JobRecord | None = field(default=None, compare=False, repr=False)

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
    def from_record(cls, record: JobRecord, turns: dict[str, Any] | None = None) -> JobSpec:
        turns = turns or {}
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
            multi_turn=regenerates_all_turns(turns),
            tokenizer=record.tokenizer,
            remote_code=bool(turns.get("trust_remote_code")),
            turns=dict(turns),
            record=record,
        )


class JobCache:
    """Job specs, read once per job — and again when a message names a dataset the cached record did not
    list: a re-submit that adds a dataset (with its own sampling) writes the record in the same MULTI that
    enqueues its messages, so the record read then has it. Each (job, dataset) re-reads at most once.

    And again when a message names another generation than the cached record (``producer purge`` and a new
    ``submit``): each (job, generation) re-reads at most once; a message whose generation is still not the
    record's is of a purged job (the caller skips it, and claim.lua checks it again atomically)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, signer: Signer | None = None) -> None:
        self.r = client
        self.keys = keys
        self.signer = signer
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
                loaded = await load_job(self.r, self.keys, job, self.signer)  # MessageRefused: never cached
                if loaded is None:
                    raise UnknownJob(f"job {job!r} has no record at {self.keys.job(job)}; re-run producer submit")
                self._specs[job] = JobSpec.from_record(*loaded)
                # Marked only now that the record read is cached: :meth:`_fresh` runs outside the lock, and a
                # mark made before the read finished let a message that came meanwhile take the *old* spec for
                # the reread one — a re-submit's messages were then skipped as a purged generation's and acked.
                if generation:
                    self._reread.add((job, f"generation:{generation}"))
                if dataset is not None:
                    self._reread.add((job, dataset))
        return self._specs[job]

    async def current(self, job: str) -> JobSpec:
        """The spec of the record in force now, for work no message names a generation for (a turn derived from
        a stored row): the record's generation is read (one HGET) and the record re-read when it is not the
        cached one's — a worker that lived through ``producer purge`` and a new submit derives with the new
        record, never the one it cached first. :class:`UnknownJob` when there is no record."""
        raw = await self.r.hget(self.keys.job(job), GENERATION_FIELD)
        if raw is None and not await self.r.exists(self.keys.job(job)):
            # purged (or Redis lost it): the cached record is no longer any job's
            raise UnknownJob(f"job {job!r} has no record at {self.keys.job(job)}; re-run producer submit")
        generation = JobRecord.from_hash({GENERATION_FIELD: raw}).generation if raw is not None else ""
        return await self.get(job, generation=generation)

    def _fresh(self, spec: JobSpec, job: str, dataset: str | None, generation: str = "") -> bool:
        if generation and generation != spec.generation and (job, f"generation:{generation}") not in self._reread:
            return False
        return dataset is None or dataset in spec.datasets or (job, dataset) in self._reread


# -- reading a record it can trust ----------------------------------------------------------------------------
def check_job_hash(job: str, raw: dict[Any, Any], signer: Signer | None) -> tuple[JobRecord, dict[str, Any]]:
    """A job hash as ``HGETALL`` returned it → (record, turns meta); with ``signer`` both must carry the producer's
    signature (:class:`MessageRefused` ``unsigned_job`` / ``bad_job_signature``)."""
    turns = turns_meta(raw.get(TURNS_FIELD.encode(), raw.get(TURNS_FIELD)))
    if signer is not None:
        signer.check_record(job, raw)
        if turns and not signer.doc_valid("turns", job, "", turns):
            raise MessageRefused(
                "bad_job_signature",
                f"job {job}: its turns field (--turns all: mode, trust_remote_code) does not match its signature",
            )
    return JobRecord.from_hash(raw, name=job), turns


async def load_job(
    client: aioredis.Redis, keys: Keys, job: str, signer: Signer | None
) -> tuple[JobRecord, dict[str, Any]] | None:
    """The record of ``job`` and its turns meta, checked (:func:`check_job_hash`); None when there is none."""
    raw = await client.hgetall(keys.job(job))
    if not raw:
        return None
    return check_job_hash(job, raw, signer)


# -- the tokenizer a worker may load ---------------------------------------------------------------------------
def tokenizer_roots(configured: str, served_model: str | None) -> list[str]:
    """Where a job's tokenizer may come from: ``THINKFLEET_TOKENIZER_ROOTS`` (os.pathsep-separated), else the
    model directory this node's server serves (when it is a directory here), resolved (symlinks, ``..``)."""
    roots = [r for r in configured.split(os.pathsep) if r.strip()] if configured else []
    if not roots and served_model and os.path.isabs(served_model) and os.path.isdir(served_model):
        roots = [served_model]
    return [os.path.realpath(os.path.expanduser(r.strip())) for r in roots]


def confined_tokenizer(path: str, roots: Sequence[str]) -> str | None:
    """``path`` resolved (symlinks and ``..``) when it lies in one of ``roots``, else None (a relative path or a
    hub id, which would load from a cache anyone may write, is never inside)."""
    if not path or not os.path.isabs(path):
        return None
    real = os.path.realpath(path)
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    return None


def tokenizer_refusal(spec: JobSpec, trust_remote_code: bool, roots: Sequence[str]) -> MessageRefused | None:
    """Why this worker refuses a ``--turns all`` job's tokenizer (None: it may load it, or the job needs none)."""
    if not spec.multi_turn:
        return None
    if spec.remote_code and not trust_remote_code:
        return MessageRefused(
            "remote_code_refused",
            f"job {spec.name} asks workers to run its tokenizer's own code (--trust-remote-code) and this worker "
            "does not allow it: set THINKFLEET_TRUST_REMOTE_CODE=1 on the workers you trust with that code, then "
            f"`producer retry {spec.name}`",
        )
    if confined_tokenizer(spec.tokenizer, roots) is None:
        where = ", ".join(roots) if roots else "none (set THINKFLEET_TOKENIZER_ROOTS, or serve a model directory)"
        return MessageRefused(
            "tokenizer_refused",
            f"job {spec.name} names the tokenizer {spec.tokenizer[:300]!r}, outside the directories this worker "
            f"loads tokenizers from ({where}): add its directory to THINKFLEET_TOKENIZER_ROOTS, then "
            f"`producer retry {spec.name}`",
        )
    return None
