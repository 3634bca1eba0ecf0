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
(:class:`producer.collector.ManifestSpool`), written to storage in chunks once the submit has no problem. What a
re-submit reads of the job (:func:`producer.state.load_existing`) is the one part that grows with it.

This module is that order of work; each step's substance is its own module: the options and the error
(:mod:`producer.submit_options`), the inputs and their feed to the render pool (:mod:`producer.feed`), the rendered
prompts' bookkeeping (:mod:`producer.collector`), the job's settings and record (:mod:`producer.jobrecord`),
``--turns all``'s conversations (:mod:`producer.conversations`) and the report (:mod:`producer.report`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from producer import render
from producer.collector import Collector
from producer.conversations import stage_replay, write_conversations
from producer.enqueue import Stager
from producer.feed import Feed, Input, open_inputs
from producer.images import image_resolver
from producer.inputs import InputError, Problem
from producer.jobrecord import (
    build_job_record,
    check_compatible,
    inherit_context,
    previous_turns,
    resolve_dataset_sampling,
    resolve_sampling,
    submit_priority,
)
from producer.report import (
    SubmitReport,
    estimate_redis_bytes,
    packed_length_stats,
    problem_summary,
    projected_wall_s,
    think_warnings,
)
from producer.state import Existing, PromptStager, StateError, SubmitLock, commit, load_existing
from producer.submit_options import SubmitError, SubmitOptions
from thinkfleet import profiles
from thinkfleet.broker.envelope import Envelope
from thinkfleet.failpoints import failpoint
from thinkfleet.message import is_plain_name
from thinkfleet.redis_client import BULK_TIMEOUT_S, sync_client
from thinkfleet.settings import Settings

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
    client = sync_client(settings.redis_url, timeout_s=BULK_TIMEOUT_S)
    pool = render.RenderPool(
        tok, opts.tokenizer, opts.chat_template_kwargs, info.opening, opts.processes, opts.trust_remote_code
    )
    try:
        problems: list[Problem] = []
        datasets = open_inputs(opts, settings)
        images = image_resolver(settings, opts.job, opts.tokenizer, tok, dry_run=opts.dry_run, turns=opts.turns)
        for inp in datasets:  # what reads a row's images, where it has any (producer/images.py)
            inp.dataset.images = images
        if opts.dry_run:
            existing = load_existing(client, settings, opts.job, redis_required=False)
            collector = _run(opts, settings, pool, info, limits, datasets, existing, problems, None, None, on_progress)
            collector.spool.close()
        else:
            with SubmitLock(client, settings, opts.job):
                existing = load_existing(client, settings, opts.job)
                stager = Stager(client, settings.keys, opts.job, settings.queue, submit_priority(opts, existing.record))
                prompts = PromptStager(client, settings, opts.job)
                collector = None
                try:
                    collector = _run(
                        opts, settings, pool, info, limits, datasets, existing, problems, stager, prompts, on_progress
                    )
                    collector.spool.write(settings, opts.job)
                    replay = stage_replay(settings, opts, existing, collector, stager)
                    record = build_job_record(opts, info, existing, collector, problems)
                    if opts.turns == "all":  # before the commit: workers read it once turn 0 is queued
                        write_conversations(client, settings, opts, collector)
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


def _run(
    opts: SubmitOptions,
    settings: Settings,
    pool: render.RenderPool,
    info: render.TokenizerInfo,
    limits: render.ModelLimits,
    inputs: list[Input],
    existing: Existing,
    problems: list[Problem],
    stager: Stager | None,
    prompts: PromptStager | None,
    on_progress: ProgressFn | None,
) -> Collector:
    """Render everything; stage the messages of prompts that are new. Fails (nothing staged stays) on problems."""
    params = resolve_sampling(opts, info, existing.record)
    for inp in inputs:
        resolve_dataset_sampling(opts, inp, params, existing.record)
    check_compatible(opts, info, existing.record, params, inputs, previous_turns(settings, opts.job, existing))
    limits = inherit_context(limits, existing.record)
    collector = Collector(
        opts,
        existing,
        params,
        problems,
        Envelope(settings, submit_priority(opts, existing.record)),
        limits,
        pool.tok,
        inputs,
    )
    collector.prompt_stager = prompts
    feed = Feed(opts, inputs, problems)
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


def _report(
    opts: SubmitOptions, info: render.TokenizerInfo, c: Collector, problems: list[Problem], elapsed_s: float
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
        lengths=packed_length_stats(c.lengths),
        estimated_redis_bytes=estimate_redis_bytes(c.message_bytes, c.enqueued) + c.hash_bytes,
        projected_wall_s=projected_wall_s(prompts, opts.mean_output_tokens, opts.hosts, opts.server_tok_s),
        warnings=warnings,
        problems=problems,
        changed=c.changed,
        elapsed_s=elapsed_s,
        tokenizer_fingerprint=info.fingerprint,
        prompt_ends_with_think_start=info.think_start_id is not None and c.not_ending == 0,
        resumed=c.resumed,
    )
