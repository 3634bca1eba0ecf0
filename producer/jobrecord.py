"""The settings a job runs with: resolved for a submit, checked against the job's record, and recorded in it.

A job has one tokenizer, template and sampling setup. A re-submit keeps the job's values where no flag is given
(:func:`resolve_sampling`, :func:`resolve_dataset_sampling`, :func:`inherit_context`, :func:`submit_priority`),
is refused where it would change them (:func:`check_compatible`), and :func:`build_job_record` writes what the
workers will read. Apart from :mod:`producer.submit` because this is the job's contract with its workers and with
later submits, not the order of one submit's work.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import time
from typing import Any

from producer import render
from producer.collector import Collector
from producer.feed import Input
from producer.inputs import Problem
from producer.state import Existing
from producer.submit_options import SubmitError, SubmitOptions
from thinkfleet import profiles
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.job import (
    MAX_SKIPPED_RECORDS,
    JobRecord,
    max_new_tokens_of,
    sample_overrides,
    sampling_params,
)
from thinkfleet.turns import TURNS_FIELD, regenerates_all_turns, turns_meta

#: The ``sampling_params`` key that carries ``--logprobs K`` to workers (``workers.sglang.LOGPROBS_KEY``).
LOGPROBS_KEY = "logprobs"


def resolve_sampling(opts: SubmitOptions, info: render.TokenizerInfo, record: JobRecord | None) -> dict[str, Any]:
    """Flags given win; otherwise the job's existing values; otherwise the defaults (stops from the tokenizer)."""
    given = {k: v for k, v in opts.sampling.items() if v is not None}
    if record is not None:
        base = dict(record.sampling_params)
        base["seed"] = base.pop("sampling_seed", None)
    else:
        base = {"stop_token_ids": info.stop_token_ids or None}
    known = inspect.signature(sampling_params).parameters  # a newer producer's extra keys are not ours to keep
    params = sampling_params(**{**{k: v for k, v in base.items() if v is not None and k in known}, **given})
    # --logprobs K travels to workers in sampling_params (workers/sglang.py LOGPROBS_KEY; not sent as sampling)
    logprobs = opts.logprobs if opts.logprobs is not None else base.get(LOGPROBS_KEY)
    if logprobs is not None:
        params[LOGPROBS_KEY] = int(logprobs)
    return params


def flag_names(params: dict[str, Any]) -> dict[str, Any]:
    """``sampling_params`` keyed as the sampling flags (and job file keys) are: ``sampling_seed`` → ``seed``."""
    return {("seed" if k == "sampling_seed" else k): v for k, v in params.items()}


def resolve_dataset_sampling(opts: SubmitOptions, inp: Input, params: dict[str, Any], record: JobRecord | None) -> None:
    """A dataset's own sampling and samples: its options win; otherwise the job's existing values for it (as
    :func:`resolve_sampling`); otherwise the job's. Sets ``overrides`` (what differs from the job's ``params``, kept
    in the job record's ``dataset_sampling``), ``params`` (what its rows are sent) and ``budget``."""
    name = inp.dataset.name
    before = flag_names(record.dataset_sampling.get(name, {})) if record is not None else {}
    given = {**before, **{k: v for k, v in inp.options.sampling.items() if v is not None}}
    known = inspect.signature(sampling_params).parameters
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SubmitError(f"dataset {name}: sampling keys {unknown} are not among {sorted(known)}")
    merged = sampling_params(**{**{k: v for k, v in flag_names(params).items() if k in known}, **given})
    inp.overrides = {k: v for k, v in merged.items() if params.get(k) != v}
    inp.params = {**params, **inp.overrides}
    samples = inp.options.samples
    if samples is None and record is not None:
        samples = record.dataset_samples.get(name)
    inp.samples = samples or opts.samples
    inp.budget = max(
        max_new_tokens_of({**inp.params, **sample_overrides(inp.params, k, inp.samples)}) for k in range(inp.samples)
    )


def inherit_context(limits: render.ModelLimits, record: JobRecord | None) -> render.ModelLimits:
    """A re-submit that knows no context length (no flag, no config.json) keeps the job's, as it keeps its
    sampling flags: the check goes on applying, and the record does not lose the bound workers read."""
    if limits.context_length is not None or record is None or record.context_length is None:
        return limits
    source = f"{record.context_source or 'job record'}, as first submitted"
    return dataclasses.replace(limits, context_length=record.context_length, context_source=source)


def check_compatible(
    opts: SubmitOptions,
    info: render.TokenizerInfo,
    record: JobRecord | None,
    params: dict[str, Any],
    inputs: list[Input],
    previous_turns: str | None = None,
) -> None:
    """A job has one tokenizer, template and sampling setup: a re-submit must not silently change them.
    ``previous_turns``: the job's ``--turns`` (None: unknown, not checked)."""
    if record is None:
        return
    mismatches = []
    if previous_turns is not None and previous_turns != opts.turns:
        mismatches.append(f"--turns {previous_turns} ≠ {opts.turns}")
    if record.model_family != info.model_family:
        mismatches.append(f"model family {record.model_family} ≠ {info.model_family}")
    if record.reasoning_spans != info.reasoning_spans:
        mismatches.append(f"reasoning spans {record.reasoning_spans} ≠ {info.reasoning_spans}")
    if record.tokenizer_fingerprint and record.tokenizer_fingerprint != info.fingerprint:
        mismatches.append(f"tokenizer fingerprint {record.tokenizer_fingerprint} ≠ {info.fingerprint}")
    if record.chat_template_hash and record.chat_template_hash != info.chat_template_hash:
        mismatches.append(f"chat template {record.chat_template_hash} ≠ {info.chat_template_hash}")
    if record.chat_template_kwargs != opts.chat_template_kwargs:
        mismatches.append(f"chat template kwargs {record.chat_template_kwargs} ≠ {opts.chat_template_kwargs}")
    if record.samples != opts.samples:
        mismatches.append(f"--samples {record.samples} ≠ {opts.samples}")
    if record.sampling_params and record.sampling_params != params:
        mismatches.append(f"sampling params {record.sampling_params} ≠ {params}")
    if opts.expected_model and record.expected_model and opts.expected_model != record.expected_model:
        mismatches.append(f"--expect-model {record.expected_model} ≠ {opts.expected_model}")
    for inp in inputs:
        name = inp.dataset.name
        if name not in record.datasets:
            continue  # a dataset new to the job may bring its own settings
        if record.dataset_sampling.get(name, {}) != inp.overrides:
            mismatches.append(f"dataset {name} sampling {record.dataset_sampling.get(name, {})} ≠ {inp.overrides}")
        samples = record.dataset_samples.get(name, record.samples)
        if samples != inp.samples:
            mismatches.append(f"dataset {name} samples {samples} ≠ {inp.samples}")
    if mismatches:
        raise SubmitError(
            "; ".join(mismatches)
            + f"\n  → use the same settings as the first submit, or a new --job name (job {opts.job!r} exists)"
        )


def previous_turns(settings: Settings, job: str, existing: Existing) -> str | None:
    """The ``--turns`` of an existing job: "all" when its job hash has the ``turns`` field of a multi-turn
    submit (:func:`producer.conversations.write_conversations`), else "last"; None when there is no job. A Redis
    that cannot say raises (the submit stops with one line): a re-submit with other ``--turns`` must never pass
    unchecked."""
    if existing.record is None:
        return None
    with sync_client(settings.redis_url, timeout_s=5) as client:
        raw = client.hget(settings.keys.job(job), TURNS_FIELD)
    return "all" if regenerates_all_turns(turns_meta(raw)) else "last"


def build_job_record(
    opts: SubmitOptions,
    info: render.TokenizerInfo,
    existing: Existing,
    collector: Collector,
    problems: list[Problem],
) -> JobRecord:
    per_dataset: collections.Counter[str] = collections.Counter(existing.datasets.values())
    per_dataset.update(collector.new_per_dataset)  # the job's prompts and this submit's new ones, per dataset
    now = time.time()
    record = existing.record or JobRecord(name=opts.job, created_at=now)
    record.generation = collector.generation
    record.datasets = dict(sorted(per_dataset.items()))
    record.prompts = sum(per_dataset.values())
    record.prompt_tokens += collector.new_prompt_tokens
    record.samples = opts.samples
    record.tokenizer = opts.tokenizer
    record.tokenizer_fingerprint = info.fingerprint
    record.chat_template_hash = info.chat_template_hash
    record.chat_template_kwargs = dict(opts.chat_template_kwargs)
    record.sampling_params = collector.params
    record.logprobs = collector.params.get(LOGPROBS_KEY)
    record.think_start_id = info.think_start_id
    record.think_end_id = info.think_end_id
    for name in profiles.TOOL_ROLES:
        setattr(record, name, info.tool_ids.get(name))
    record.model_family = info.model_family
    record.reasoning_spans = info.reasoning_spans
    if info.profile is not None:
        record.markers = dict(info.profile.token_ids)
        record.channel_ids = {k: list(v) for k, v in info.profile.channel_ids.items()}
    record.prompt_ends_with_think_start = info.think_start_id is not None and collector.not_ending == 0
    record.expected_model = opts.expected_model or record.expected_model
    _record_datasets(record, opts, collector)
    record.updated_at = now
    record.submissions += 1
    record.skipped = [{"location": p.location, "reason": p.reason} for p in problems[:MAX_SKIPPED_RECORDS]]
    record.skipped_count = len(problems)
    limits = collector.limits
    record.vocab_size, record.vocab_source = limits.vocab_size, limits.vocab_source
    record.context_length, record.context_source = limits.context_length, limits.context_source
    _record_images(record, collector)
    return record


def _record_images(record: JobRecord, collector: Collector) -> None:
    """Where the job's images are and which id is their placeholder, once a submit read any image: workers read
    images only from that store (workers/images.py) and render later turns' images with that placeholder."""
    for inp in collector.inputs.values():
        resolver = inp.dataset.images
        if resolver is not None and resolver.used:
            record.image_store = resolver.store.root_uri
            record.image_placeholder_id = resolver.vision.placeholder.token_id
            return


def submit_priority(opts: SubmitOptions, record: JobRecord | None) -> int:
    """The priority this submit queues at: the flag/job file's, else the job's, else 0 (kombu: 0 is highest)."""
    if opts.priority is not None:
        return opts.priority
    return int(record.priority) if record is not None else 0


def _record_datasets(record: JobRecord, opts: SubmitOptions, collector: Collector) -> None:
    """Per-dataset sampling and samples (where they differ from the job's), the job file and its priority."""
    sampling, samples = dict(record.dataset_sampling), dict(record.dataset_samples)
    for name, inp in collector.inputs.items():
        sampling[name], samples[name] = inp.overrides, inp.samples
    record.dataset_sampling = {n: o for n, o in sorted(sampling.items()) if o}
    record.dataset_samples = {n: k for n, k in sorted(samples.items()) if k != opts.samples}
    if opts.priority is not None:
        record.priority = opts.priority
    if opts.job_file is not None:
        record.job_file = _resolved_job_file(opts.job_file, collector, record)


def _resolved_job_file(job_file: dict[str, Any], collector: Collector, record: JobRecord) -> dict[str, Any]:
    """The job file as it ran: the template switches and family in effect, the job's sampling with every
    default filled, each dataset's samples and the sampling it set (the values its rows get)."""
    resolved = {
        **job_file,
        "chat_template_kwargs": dict(record.chat_template_kwargs),
        "sampling": {k: v for k, v in flag_names(collector.params).items() if k != LOGPROBS_KEY},
        "samples": record.samples,
    }
    if getattr(record, "model_family", None):
        resolved["model_family"] = record.model_family
    if record.logprobs is not None:
        resolved["logprobs"] = record.logprobs
    entries = []
    for entry in job_file.get("datasets") or []:
        inp = collector.inputs.get(entry.get("name"))
        if inp is not None:
            given = {k for k, v in (entry.get("sampling") or {}).items() if v is not None}
            own = {k: v for k, v in flag_names(inp.params).items() if k in given or k in flag_names(inp.overrides)}
            entry = {**entry, "samples": inp.samples, "sampling": own}
        entries.append(entry)
    resolved["datasets"] = entries
    return resolved
