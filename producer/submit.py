"""``producer submit``: datasets → prompt token ids → Redis, all or nothing, idempotent.

Order of work (each step says why):
1. Load the tokenizer and fork the render pool (children get the tokenizer, not the datasets).
2. Read every input: a bad file or column fails here, before any rendering.
3. Take the job's submit lock and read what exists (:mod:`producer.state`), so a re-submit enqueues
   only what is missing and notices content that changed.
4. Render on every core; each prompt is checked against the model's limits (:func:`render.model_limits`:
   every id below the vocabulary size, prompt + max_new_tokens below the context length — an id beyond
   the vocabulary crashes a GPU server, an over-long row only comes back as a 400); new prompts' messages
   are staged in Redis as they come (hiding the enqueue behind tokenization), never directly onto the queue.
5. Any problem without ``--skip-invalid``: drop the staging list and fail, naming file:line and the fix.
6. Write the storage manifest, then one MULTI: prompt hashes, job record, counters, and the move of
   the staged messages onto the queue.

Memory stays flat with the dataset's size: the inputs are read lazily and rendered a bounded window of batches at
a time (:meth:`render.RenderPool.render`); each prompt's message and its prompt hashes are staged in Redis as they
come (:class:`producer.state.PromptStager`), and its manifest row is spooled to a local temporary file
(:class:`_ManifestSpool`), written to storage in chunks once the submit has no problem. What a re-submit reads of
the job (:func:`producer.state.load_existing`) is the one part that grows with it.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import pickle
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from producer import render
from producer.chains import ChainReplay, plan_replay, replay_candidates
from producer.enqueue import Stager
from producer.inputs import Columns, Dataset, InputError, Problem, Prompt, iter_prompts, open_dataset
from producer.report import (
    HASH_ENTRY_OVERHEAD_B,
    DatasetReport,
    SubmitReport,
    estimate_redis_bytes,
    length_stats,
    problem_summary,
    projected_wall_s,
    think_warnings,
)
from producer.state import (
    Existing,
    PromptStager,
    StateError,
    SubmitLock,
    commit,
    load_existing,
    write_manifest,
)
from thinkfleet import profiles
from thinkfleet.broker.envelope import Envelope
from thinkfleet.failpoints import failpoint
from thinkfleet.message import PromptTask, is_plain_name, unpack_ids
from thinkfleet.settings import Settings
from thinkfleet.signing import signer_for
from thinkfleet.state.job import (
    MAX_SKIPPED_RECORDS,
    JobRecord,
    max_new_tokens_of,
    sample_overrides,
    sampling_params,
)
from thinkfleet.turns import TURNS_FIELD, regenerates_all_turns, turns_meta

#: prompt_id of sample k when --samples > 1: "<dataset>/<id>#<k>".
SAMPLE_SEP = "#"


class SubmitError(Exception):
    """The submit cannot proceed; the message says what to do. Nothing was enqueued."""


@dataclass(frozen=True)
class DatasetOptions:
    """One input of a submit: a job file's ``datasets:`` entry (the PATH form makes one per PATH).
    ``None`` (and an empty ``sampling``) = the job's value in :class:`SubmitOptions`."""

    path: str  # a local path, s3://bucket/key, or a Hugging Face dataset id (local cache)
    name: str | None = None
    columns: Columns | None = None
    split: str | None = None
    samples: int | None = None
    #: this dataset's sampling overrides, keyed as the sampling flags are (max_new_tokens, …, seed)
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubmitOptions:
    paths: list[Path]
    job: str
    tokenizer: str
    dataset_names: list[str] = field(default_factory=list)
    columns: Columns = field(default_factory=Columns)
    split: str | None = None
    samples: int = 1
    trust_remote_code: bool = False
    #: Merged over the model profile's thinking switch (Kimi ``{"thinking": true}``, Qwen3
    #: ``{"enable_thinking": true}``, …); the merged kwargs are what the job record keeps.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: ``--model-family`` (thinkfleet.profiles.FAMILIES); None = detected from the tokenizer.
    model_family: str | None = None
    #: False (``--no-reasoning-spans``): run although the tokenizer lacks the profile's reasoning markers;
    #: rows get empty reasoning spans and the reasoning alarm is off.
    reasoning_spans: bool = True
    #: ``--turns``: "last" regenerates the final assistant turn; "all" every turn, chained by the workers
    #: (turn 0 of each conversation is enqueued here as ``{prompt_id}/t0``; :mod:`thinkfleet.turns`).
    turns: str = "last"
    #: ``--tool-results`` (job file ``tool_results``; with ``--turns all``): "replay" regenerates through tool
    #: calls, feeding back the dataset's recorded results (thinkfleet/tool_steps.py); None = cut at the first tool.
    tool_results: str | None = None
    #: ``tool_mismatch``: "chain_end" (a call unlike the dataset's ends the chain) or "keep_recorded".
    tool_mismatch: str = "chain_end"
    #: ``max_tool_steps``: tool-calling answers fed back per turn at most.
    max_tool_steps: int = 8
    #: ``--tool-executor`` (``tool_results: executor``): ``module:function``, ``file.py:function`` or an http(s)
    #: URL, run by the workers that store the steps (workers/tool_exec.py; they must trust it).
    tool_executor: str | None = None
    think_start_id: int | None = None
    think_end_id: int | None = None
    max_prompt_tokens: int | None = None
    #: the served context length (``--context-length``); None = from the model's config.json, if any.
    context_length: int | None = None
    #: sampling flags as given on the command line; None = not given (the job's value, or the default).
    sampling: dict[str, Any] = field(default_factory=dict)
    #: ``--logprobs K``: rows store logprobs (top K alternatives); None = the job's (a new job: none).
    logprobs: int | None = None
    expected_model: str | None = None
    skip_invalid: bool = False
    dry_run: bool = False
    processes: int | None = None
    hosts: int = 1
    server_tok_s: float = 860.0
    mean_output_tokens: float = 1416.0
    #: the inputs one by one (a job file's ``datasets``); empty = ``paths`` with the shared flags.
    datasets: list[DatasetOptions] = field(default_factory=list)
    #: the job file, resolved (names and defaults filled, flags applied): kept in the job record.
    job_file: dict[str, Any] | None = None
    #: the job file's ``priority`` (kept in the job record); None = the job's, else 0.
    priority: int | None = None

    def inputs(self) -> list[DatasetOptions]:
        """Every input with its own options: ``datasets``, else one per PATH."""
        if self.datasets:
            return list(self.datasets)
        return [
            DatasetOptions(str(p), self.dataset_names[i] if self.dataset_names else None)
            for i, p in enumerate(self.paths)
        ]


#: Called after each rendered batch with (prompts, prompt tokens) — the CLI's progress bar.
ProgressFn = Callable[[int, int], None]


def submit(settings: Settings, opts: SubmitOptions, on_progress: ProgressFn | None = None) -> SubmitReport:
    """Run one submit; raises :class:`SubmitError` (nothing enqueued) on any problem it is not told to skip."""
    started = time.monotonic()
    if not is_plain_name(opts.job):
        # The job name builds Redis keys ({prefix}:job:{job}:…) and the output directory: `x:claims`
        # would write into job x's claims, and workers refuse such messages (bad_job_name) anyway.
        raise SubmitError(
            f"job name {opts.job!r} is not plain: use letters, digits, '.', '_', '-' (at most 128, starting "
            "with a letter or digit)"
        )
    if not opts.max_prompt_tokens or opts.max_prompt_tokens > settings.max_prompt_tokens:
        # Workers refuse longer prompts (oversize): refuse them here, naming the row.
        opts = dataclasses.replace(opts, max_prompt_tokens=settings.max_prompt_tokens)
    if opts.dataset_names and len(opts.dataset_names) != len(opts.paths):
        raise SubmitError(f"{len(opts.dataset_names)} --dataset-name for {len(opts.paths)} inputs; give one per PATH")
    if opts.datasets and opts.paths:
        raise SubmitError("give the inputs as PATHs or as a job file's datasets, not both")
    if not opts.inputs():
        raise SubmitError("no inputs: give PATH… or a job file with datasets")
    if opts.turns not in ("last", "all"):
        raise SubmitError(f"--turns {opts.turns!r}: use last or all")
    if opts.turns == "all" and (opts.samples != 1 or any((d.samples or 1) != 1 for d in opts.inputs())):
        raise SubmitError("--turns all takes one sample per conversation: drop --samples")
    if opts.tool_results is not None:
        _check_tool_options(opts)
    try:
        tok = render.load_tokenizer(opts.tokenizer, opts.trust_remote_code)
    except render.TokenizerError as e:
        raise SubmitError(str(e)) from e
    try:
        info = render.describe_tokenizer(
            tok, opts.tokenizer, opts.think_start_id, opts.think_end_id, opts.model_family, opts.reasoning_spans
        )
    except profiles.ProfileError as e:
        raise SubmitError(str(e)) from e
    assert info.profile is not None
    # The profile's thinking switch, with the caller's kwargs over it: what renders and what is recorded.
    opts = dataclasses.replace(
        opts, chat_template_kwargs={**info.profile.profile.thinking_kwargs, **opts.chat_template_kwargs}
    )
    limits = render.model_limits(tok, opts.tokenizer, opts.context_length)
    client = redis.Redis.from_url(settings.redis_url)
    pool = render.RenderPool(
        tok, opts.tokenizer, opts.chat_template_kwargs, info.opening, opts.processes, opts.trust_remote_code
    )
    try:
        problems: list[Problem] = []
        datasets = _open_all(opts, settings)
        if opts.dry_run:
            existing = load_existing(client, settings, opts.job, redis_required=False)
            collector = _run(opts, settings, pool, info, limits, datasets, existing, problems, None, None, on_progress)
            collector.spool.close()
        else:
            with SubmitLock(client, settings, opts.job):
                existing = load_existing(client, settings, opts.job)
                stager = Stager(client, settings.keys, opts.job, settings.queue, _priority(opts, existing.record))
                prompts = PromptStager(client, settings, opts.job)
                collector = None
                try:
                    collector = _run(
                        opts, settings, pool, info, limits, datasets, existing, problems, stager, prompts, on_progress
                    )
                    collector.spool.write(settings, opts.job)
                    replay = _replay(settings, opts, existing, collector, stager)
                    record = _job_record(opts, info, existing, collector, problems)
                    if opts.turns == "all":  # before the commit: workers read it once turn 0 is queued
                        _write_conversations(client, settings, opts, collector)
                    failpoint("submit_after_stage")
                    commit(
                        client,
                        settings,
                        record,
                        prompts,
                        existing,
                        stager,
                        collector.revived,
                        collector.stored_hint,
                        replay,
                    )
                except BaseException:
                    stager.discard()
                    prompts.discard()
                    raise
                finally:
                    if collector is not None:
                        collector.spool.close()
    except StateError as e:
        raise SubmitError(str(e)) from e
    finally:
        pool.close()
        client.close()
    return _report(opts, info, collector, problems, time.monotonic() - started)


@dataclass
class _Input:
    """An opened dataset and what its rows get: the job's options, or its own (:class:`DatasetOptions`)."""

    dataset: Dataset
    options: DatasetOptions
    columns: Columns
    split: str | None
    samples: int = 1  # resolved in _run (a re-submit keeps the job's value)
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling_params keys that differ from the job's
    params: dict[str, Any] = field(default_factory=dict)  # the job's sampling_params ← overrides
    budget: int = 0  # the largest max_new_tokens any sample of a row gets


def _open_all(opts: SubmitOptions, settings: Settings) -> list[_Input]:
    inputs: list[_Input] = []
    names: dict[str, str] = {}
    for d in opts.inputs():
        split = d.split if d.split is not None else opts.split
        try:
            ds = open_dataset(d.path, d.name, settings.s3_endpoint_url, split)
        except InputError as e:
            raise SubmitError(str(e)) from e
        if ds.name in names:
            raise SubmitError(
                f"{d.path}: dataset name {ds.name!r} is also {names[ds.name]}; give each a --dataset-name "
                "(job file: name)"
            )
        names[ds.name] = d.path
        inputs.append(_Input(ds, d, d.columns or opts.columns, split))
    return inputs


class _Feed:
    """The inputs, read lazily by the render pool's task thread while earlier batches render.

    Each prompt is remembered in ``pending`` as it is handed out; results come back in the same order.
    A file-level error stops the feed and is re-raised by the caller once rendering has drained.
    """

    def __init__(self, opts: SubmitOptions, inputs: list[_Input], problems: list[Problem]) -> None:
        self.opts, self.inputs, self.problems = opts, inputs, problems
        self.pending: collections.deque[tuple[str, Prompt]] = collections.deque()
        self.error: Exception | None = None
        #: --turns all: conversation id → its turns (thinkfleet.turns.plan_conversation) and source
        self.conversations: dict[str, dict[str, Any]] = {}
        self.cut_at_tool = 0

    def __iter__(self) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
        try:
            for inp in self.inputs:
                for prompt in iter_prompts(inp.dataset, inp.columns, inp.split, self.problems):
                    if self.opts.turns == "all":
                        prompt = self._first_turn(inp.dataset.name, prompt)
                    self.pending.append((inp.dataset.name, prompt))
                    yield prompt.messages, prompt.tools
        except Exception as e:  # raised in the pool's thread: hand it to the caller instead
            self.error = e

    def _first_turn(self, dataset: str, prompt: Prompt) -> Prompt:
        """--turns all: the conversation's turn 0 (history up to its first user message), ``{id}/t0``."""
        from thinkfleet.tool_steps import plan_agentic
        from thinkfleet.turns import plan_conversation, turn_id

        # An agentic job (tool_results set) keeps the recorded calls and results: nothing is cut at a tool call.
        agentic = self.opts.tool_results is not None
        plan = plan_agentic(prompt.messages) if agentic else plan_conversation(prompt.messages)
        if plan is None:  # no user turn: rendered as it is (one turn), as --turns last would
            plan = {"messages": prompt.messages, "users": [len(prompt.messages) - 1], "turn_count": 1,
                    "cut_at_tool": False}  # fmt: skip
        self.cut_at_tool += int(plan["cut_at_tool"])
        plan.update(dataset=dataset, row_index=prompt.row_index, tools=prompt.tools)
        self.conversations[prompt.prompt_id] = plan
        first = plan["messages"][: plan["users"][0] + 1]
        return dataclasses.replace(prompt, prompt_id=turn_id(prompt.prompt_id, 0), messages=first)

    def take(self, n: int) -> list[tuple[str, Prompt]]:
        return [self.pending.popleft() for _ in range(n)]


def _run(
    opts: SubmitOptions,
    settings: Settings,
    pool: render.RenderPool,
    info: render.TokenizerInfo,
    limits: render.ModelLimits,
    inputs: list[_Input],
    existing: Existing,
    problems: list[Problem],
    stager: Stager | None,
    prompts: PromptStager | None,
    on_progress: ProgressFn | None,
) -> _Collector:
    """Render everything; stage the messages of prompts that are new. Fails (nothing staged stays) on problems."""
    params = _sampling(opts, info, existing.record)
    for inp in inputs:
        _dataset_sampling(opts, inp, params, existing.record)
    _check_compatible(opts, info, existing.record, params, inputs, _previous_turns(settings, opts.job, existing))
    limits = _inherit_context(limits, existing.record)
    collector = _Collector(
        opts, existing, params, problems, Envelope(settings, _priority(opts, existing.record)), limits, pool.tok, inputs
    )
    collector.prompt_stager = prompts
    feed = _Feed(opts, inputs, problems)
    collector.feed = feed
    for results in pool.render(feed):
        messages = collector.add_batch(feed.take(len(results)), results)
        if stager is not None and messages:
            stager.push(messages)
        if on_progress is not None:
            on_progress(len(results), collector.batch_tokens)
    if isinstance(feed.error, InputError):
        raise SubmitError(str(feed.error)) from feed.error
    if feed.error is not None:
        raise feed.error
    for inp in inputs:
        collector.reports[inp.dataset.name].rows = inp.dataset.rows
    if problems and not opts.skip_invalid:
        raise SubmitError(problem_summary(problems))
    return collector


#: The ``sampling_params`` key that carries ``--logprobs K`` to workers (``workers.sglang.LOGPROBS_KEY``).
LOGPROBS_KEY = "logprobs"


def _sampling(opts: SubmitOptions, info: render.TokenizerInfo, record: JobRecord | None) -> dict[str, Any]:
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


def _dataset_sampling(opts: SubmitOptions, inp: _Input, params: dict[str, Any], record: JobRecord | None) -> None:
    """A dataset's own sampling and samples: its options win; otherwise the job's existing values for it (as
    :func:`_sampling`); otherwise the job's. Sets ``overrides`` (what differs from the job's ``params``, kept
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


def _inherit_context(limits: render.ModelLimits, record: JobRecord | None) -> render.ModelLimits:
    """A re-submit that knows no context length (no flag, no config.json) keeps the job's, as it keeps its
    sampling flags: the check goes on applying, and the record does not lose the bound workers read."""
    if limits.context_length is not None or record is None or record.context_length is None:
        return limits
    source = f"{record.context_source or 'job record'}, as first submitted"
    return dataclasses.replace(limits, context_length=record.context_length, context_source=source)


def _check_compatible(
    opts: SubmitOptions,
    info: render.TokenizerInfo,
    record: JobRecord | None,
    params: dict[str, Any],
    inputs: list[_Input],
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


def _previous_turns(settings: Settings, job: str, existing: Existing) -> str | None:
    """The ``--turns`` of an existing job: "all" when its job hash has the ``turns`` field of a multi-turn
    submit (:func:`_write_conversations`), else "last"; None when there is no job or Redis cannot say."""
    if existing.record is None:
        return None
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        with client:
            raw = client.hget(settings.keys.job(job), TURNS_FIELD)
    except (redis.RedisError, OSError):
        return None
    return "all" if regenerates_all_turns(turns_meta(raw)) else "last"


class _Collector:
    """Turns rendered prompts into manifest rows, statistics and the messages of prompts to enqueue."""

    def __init__(
        self,
        opts: SubmitOptions,
        existing: Existing,
        params: dict[str, Any],
        problems: list[Problem],
        envelope: Envelope,
        limits: render.ModelLimits,
        tok: Any,
        inputs: list[_Input],
    ) -> None:
        self.opts, self.existing, self.params, self.problems = opts, existing, params, problems
        self.envelope, self.limits, self.tok = envelope, limits, tok
        #: each dataset's sampling, samples and budget (the largest max_new_tokens any sample of a row gets).
        self.inputs = {inp.dataset.name: inp for inp in inputs}
        self.finished = existing.finished
        self.reports: dict[str, DatasetReport] = collections.defaultdict(DatasetReport)
        #: manifest rows (every valid prompt of this submission), spooled to a local file until the submit commits
        self.spool = _ManifestSpool(keep=not opts.dry_run)  # a dry run writes no manifest: nothing to spool
        self.prompt_stager: PromptStager | None = None  # where the prompt hashes go (None: a dry run)
        self.lengths = array("I")  # prompt lengths in tokens (4 bytes a prompt)
        self.new_per_dataset: collections.Counter[str] = collections.Counter()  # prompts new to the job
        self.new_prompt_tokens = 0
        self.hash_bytes = 0  # what the prompt hashes will cost Redis (the report's estimate)
        self.kept_conversations: set[str] = set()  # --turns all: conversations with a valid turn 0
        self.revived: list[tuple[str, str]] = []  # (prompt_id, dataset): done, but lost with a damaged part
        self.lost = existing.lost
        self.stored_hint: dict[str, str] = {}  # dataset of stored prompts (the done refill after a Redis loss)
        self.message_bytes = self.enqueued = self.tokens_enqueued = 0
        #: --turns all: conversations whose stored turns the workers finalize again (producer/chains.py)
        self.resumed = 0
        self.not_ending = self.changed = self.batch_tokens = 0
        self.first_not_ending: str | None = None
        self.feed: _Feed | None = None  # the inputs being rendered (--turns all: their conversations)
        #: The record's generation: kept from the existing record, else a new one (a first submit, or after purge).
        self.generation = (existing.record.generation if existing.record else "") or uuid.uuid4().hex[:16]

    def add_batch(self, prompts: list[tuple[str, Prompt]], results: list[render.Result]) -> list[bytes]:
        tasks: list[PromptTask] = []
        self.batch_tokens = 0
        for (dataset, prompt), result in zip(prompts, results, strict=True):
            if isinstance(result, str):
                self.problems.append(Problem(prompt.location, f"{result}; fix the row or pass --skip-invalid"))
                continue
            self.batch_tokens += result[1]
            tasks.extend(self._add(dataset, prompt, *result))
        messages = self.envelope.encode_many(tasks) if tasks else []
        self.message_bytes += sum(map(len, messages))
        self.enqueued += len(messages)
        return messages

    def _add(
        self, dataset: str, prompt: Prompt, blob: bytes, n_tokens: int, digest: str, ends: bool, max_id: int
    ) -> list[PromptTask]:
        opts, inp = self.opts, self.inputs[dataset]
        if opts.max_prompt_tokens and n_tokens > opts.max_prompt_tokens:
            reason = f"prompt is {n_tokens} tokens, over --max-prompt-tokens {opts.max_prompt_tokens}"
            self.problems.append(Problem(prompt.location, f"{reason}; shorten it, raise the limit, or --skip-invalid"))
            return []
        unfit = render.check_prompt(n_tokens, max_id, inp.budget, self.limits)
        if unfit is not None:
            if max_id >= self.limits.vocab_size:  # rare: unpack the ids to name the first one out of range
                unfit = render.check_prompt(n_tokens, max_id, inp.budget, self.limits, unpack_ids(blob, None), self.tok)
            self.problems.append(Problem(prompt.location, f"{unfit} (--skip-invalid skips and records it)"))
            return []
        if not ends:
            self.not_ending += 1
            self.first_not_ending = self.first_not_ending or prompt.location
        self.lengths.append(n_tokens)
        report = self.reports[dataset]
        tasks = []
        for k in range(inp.samples):
            pid = prompt.prompt_id if inp.samples == 1 else f"{prompt.prompt_id}{SAMPLE_SEP}{k}"
            old = self.existing.hashes.get(pid)
            if old is not None and old != digest:
                self.changed += 1
                self.problems.append(Problem(
                    prompt.location,
                    f"content changed since job {opts.job!r} was first submitted ({pid}: {old} → {digest}); "
                    "use a new --job name, or --skip-invalid to keep the first version",
                ))  # fmt: skip
                continue
            report.prompts += 1
            report.prompt_tokens += n_tokens
            self._row({"prompt_id": pid, "dataset": dataset, "row_index": prompt.row_index,
                       "sample_index": k, "content_hash": digest, "prompt_tokens": n_tokens,
                       # the source conversation, kept in the manifest for `export --format messages`
                       "messages": prompt.messages, "tools": prompt.tools})  # fmt: skip
            if pid in self.finished:
                report.already_done += 1
            elif pid in self.existing.dead:
                report.dead += 1
            elif pid in self.existing.queued:
                report.already_queued += 1
            else:
                report.enqueued += 1
                self.tokens_enqueued += n_tokens
                overrides = sample_overrides(inp.params, k, inp.samples)
                tasks.append(
                    PromptTask(opts.job, dataset, pid, prompt.row_index, digest, blob, k, 0, overrides, self.generation)
                )
        return tasks

    def _row(self, row: dict[str, Any]) -> None:
        """A valid prompt of this submission: spooled for the manifest, its hashes staged, its numbers kept."""
        pid, dataset = row["prompt_id"], row["dataset"]
        self.spool.add(row)
        if self.prompt_stager is not None:
            self.prompt_stager.add(pid, row["content_hash"], dataset)
        self.hash_bytes += 2 * (len(pid) + HASH_ENTRY_OVERHEAD_B) + 16 + len(dataset)
        if pid not in self.existing.datasets:
            self.new_per_dataset[dataset] += 1
        if pid not in self.existing.hashes:
            self.new_prompt_tokens += row["prompt_tokens"]
        if pid in self.lost:
            self.revived.append((pid, dataset))
        if pid in self.existing.stored:
            self.stored_hint[pid] = dataset
        if self.opts.turns == "all":
            from thinkfleet.turns import split_turn_id

            self.kept_conversations.add(split_turn_id(pid)[0])  # type: ignore[index]


class _ManifestSpool:
    """Manifest rows kept in a local temporary file (pickled chunks) until the submit is sure to commit, then
    written to storage a chunk per manifest file: memory holds one chunk, not the submission."""

    #: Rows held in memory before they are spooled to the file (a few MB with their source messages).
    CHUNK = 5_000
    #: Rows per manifest file written to storage (the write holds this many, and their Arrow table, at once).
    FILE_ROWS = 25_000

    def __init__(self, keep: bool = True) -> None:
        # closed by close() (the submit's finally), not a with-block: the spool lives across the render loop.
        # On disk it takes about what the dataset's messages take in its own files.
        self._file = tempfile.TemporaryFile(prefix="thinkfleet-manifest-")  # noqa: SIM115
        self._chunk: list[dict[str, Any]] = []
        self.keep = keep
        self.rows = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        if not self.keep:
            return
        self._chunk.append(row)
        if len(self._chunk) >= self.CHUNK:
            self._dump()

    def _dump(self) -> None:
        if self._chunk:
            pickle.dump(self._chunk, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._chunk = []

    def chunks(self) -> Iterator[list[dict[str, Any]]]:
        self._dump()
        self._file.seek(0)
        while True:
            try:
                yield pickle.load(self._file)  # our own file, written above: trusted
            except EOFError:
                return

    def write(self, settings: Settings, job: str) -> None:
        """Every row to storage's manifest, :data:`FILE_ROWS` per file (a submission of no rows writes one empty
        file, as a submit always wrote one)."""
        rows: list[dict[str, Any]] = []
        wrote = False
        for chunk in self.chunks():
            rows += chunk
            if len(rows) >= self.FILE_ROWS:
                write_manifest(settings, job, rows)
                rows, wrote = [], True
        if rows or not wrote:
            write_manifest(settings, job, rows)

    def close(self) -> None:
        self._chunk = []
        self._file.close()


def _replay(
    settings: Settings, opts: SubmitOptions, existing: Existing, collector: _Collector, stager: Stager
) -> ChainReplay:
    """--turns all: the stored turns Redis does not count done (a purge, a Redis lost entirely) are finalized
    again by the workers, from their parts and in chain order (producer/chains.py): each conversation's earliest
    one is enqueued again (counted as enqueued and as ``resumed``), never refilled into done."""
    if opts.turns != "all":
        return ChainReplay()
    finished = existing.done | existing.dead | existing.queued
    candidates = replay_candidates(existing.stored, finished, collector.kept_conversations)
    replay = plan_replay(settings, opts.job, candidates, collector.generation)
    if replay.heads:
        messages = collector.envelope.encode_many(replay.heads)
        stager.push(messages)
        collector.enqueued += len(messages)
        collector.message_bytes += sum(map(len, messages))
    collector.resumed = len(replay.heads)
    return replay


def _write_conversations(client: redis.Redis, settings: Settings, opts: SubmitOptions, collector: _Collector) -> None:
    """--turns all: every conversation of the job (workers render its later turns from it) and the job hash's
    ``turns`` field (the mode, the conversations, their turns, how many a tool call cut short)."""
    from thinkfleet.turns import conversations_key

    feed = collector.feed
    assert feed is not None
    key = conversations_key(settings.keys, opts.job)
    kept = collector.kept_conversations
    signer = signer_for(settings)  # with a key, workers render later turns only from what the producer signed
    convs = {
        c: json.dumps(signer.sign_doc("conversation", opts.job, c, v) if signer else v, ensure_ascii=False)
        for c, v in feed.conversations.items()
        if c in kept
    }
    items = list(convs.items())
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, len(items), 1000):
            pipe.hset(key, mapping=dict(items[start : start + 1000]))
        pipe.execute()
    known = client.hlen(key)
    turns = sum(_turn_counts(client, key))
    meta = {
        "mode": "all",
        "conversations": known,
        "turns": turns,
        "cut_at_tool": feed.cut_at_tool,
        "trust_remote_code": opts.trust_remote_code,
        "note": "conversations are regenerated up to their first tool call (later turns need tool results)",
    }
    if opts.tool_results is not None:  # an agentic job: tool results fed back (thinkfleet/tool_steps.py)
        meta.update(tool_results=opts.tool_results, tool_mismatch=opts.tool_mismatch)
        meta["max_tool_steps"] = opts.max_tool_steps
        if opts.tool_executor:
            meta["executor"] = opts.tool_executor
        meta["note"] = "conversations are regenerated through their tool calls (thinkfleet/tool_steps.py)"
    if signer is not None:
        meta = signer.sign_doc("turns", opts.job, "", meta)
    client.hset(settings.keys.job(opts.job), "turns", json.dumps(meta))


def _check_tool_options(opts: SubmitOptions) -> None:
    from thinkfleet.tool_steps import MISMATCH_POLICIES, TOOL_RESULT_MODES

    if opts.turns != "all":
        raise SubmitError("--tool-results needs --turns all (tool results feed the turns after a call)")
    if opts.tool_results not in TOOL_RESULT_MODES:
        raise SubmitError(f"--tool-results {opts.tool_results!r}: use {' or '.join(TOOL_RESULT_MODES)}")
    if opts.tool_mismatch not in MISMATCH_POLICIES:
        raise SubmitError(f"tool_mismatch {opts.tool_mismatch!r}: use {' or '.join(MISMATCH_POLICIES)}")
    if (opts.tool_results == "executor") != bool(opts.tool_executor):
        raise SubmitError("--tool-results executor takes --tool-executor SPEC (module:function, file.py:function, URL)")
    if opts.max_tool_steps < 1:
        raise SubmitError(f"max_tool_steps {opts.max_tool_steps}: give at least 1")


def _turn_counts(client: redis.Redis, key: str) -> Iterator[int]:
    for _conv, raw in client.hscan_iter(key, count=1000):
        yield int(json.loads(raw)["turn_count"])


def _job_record(
    opts: SubmitOptions,
    info: render.TokenizerInfo,
    existing: Existing,
    collector: _Collector,
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
    return record


def _priority(opts: SubmitOptions, record: JobRecord | None) -> int:
    """The priority this submit queues at: the flag/job file's, else the job's, else 0 (kombu: 0 is highest)."""
    if opts.priority is not None:
        return opts.priority
    return int(record.priority) if record is not None else 0


def _record_datasets(record: JobRecord, opts: SubmitOptions, collector: _Collector) -> None:
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


def _resolved_job_file(job_file: dict[str, Any], collector: _Collector, record: JobRecord) -> dict[str, Any]:
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


def _report(
    opts: SubmitOptions, info: render.TokenizerInfo, c: _Collector, problems: list[Problem], elapsed_s: float
) -> SubmitReport:
    for name, report in c.reports.items():
        source = str(c.inputs[name].dataset.source) if name in c.inputs else name
        report.skipped = sum(1 for p in problems if p.location.startswith(source))
    c.reports = dict(c.reports)
    resolution = info.profile
    warnings = list(resolution.warnings) if resolution is not None else []
    profile = resolution.profile if resolution is not None else profiles.KIMI
    if info.reasoning_spans and profile.prompt_opens_reasoning:
        # A template of this family ends the prompt with the think-start marker in thinking mode.
        thinking = all(opts.chat_template_kwargs.get(k, True) is not False for k in profile.thinking_kwargs)
        warnings += think_warnings(thinking, info.think_start_id, c.not_ending, c.first_not_ending)
    if (no_context := c.limits.context_warning()) is not None:
        warnings.append(no_context)
    prompts = sum(r.prompts for r in c.reports.values())
    return SubmitReport(
        job=opts.job,
        dry_run=opts.dry_run,
        datasets=c.reports,
        enqueued=c.enqueued,
        prompt_tokens_enqueued=c.tokens_enqueued,
        lengths=_length_stats(c.lengths),
        estimated_redis_bytes=estimate_redis_bytes(c.message_bytes, c.enqueued, []) + c.hash_bytes,
        projected_wall_s=projected_wall_s(prompts, opts.mean_output_tokens, opts.hosts, opts.server_tok_s),
        warnings=warnings,
        problems=problems,
        changed=c.changed,
        elapsed_s=elapsed_s,
        tokenizer_fingerprint=info.fingerprint,
        prompt_ends_with_think_start=info.think_start_id is not None and c.not_ending == 0,
        resumed=c.resumed,
    )


def _length_stats(lengths: array) -> dict[str, float]:
    """:func:`producer.report.length_stats` of a packed array, without a Python int per prompt."""
    if not lengths:
        return length_stats([])
    a = np.sort(np.frombuffer(lengths, dtype=np.uint32))
    return {
        "count": int(a.size),
        "min": int(a[0]),
        "median": float(np.median(a)) if a.size % 2 == 0 else int(a[a.size // 2]),
        "mean": round(float(a.mean()), 1),
        "p99": int(a[min(a.size - 1, int(0.99 * a.size))]),
        "max": int(a[-1]),
    }
