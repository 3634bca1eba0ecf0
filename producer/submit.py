"""``producer submit``: datasets → prompt token ids → Redis, all or nothing, idempotent.

Order of work (each step says why):
1. Load the tokenizer and read every input: a bad file or column fails here, before any rendering.
2. Take the job's submit lock and read what already exists — queued or running messages, the done set
   ∪ storage's stored ids (storage is the truth), dead letters, the prompts' content hashes — so a
   re-submit enqueues only what is missing and notices content that changed.
3. Render on every core; new prompts' messages are staged in Redis as they come (hiding the enqueue
   behind tokenization), never onto the queue.
4. Any problem without ``--skip-invalid``: drop the staging list and fail, naming file:line and the fix.
5. Write the storage manifest, then one MULTI: prompts/dataset hashes, job record, counters, and the
   move of the staged messages onto the queue. Workers see the job record before the first message.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from producer import render
from producer.enqueue import Envelope, Stager, queued_prompt_ids, running_prompt_ids
from producer.inputs import Columns, Dataset, InputError, Problem, read_dataset
from producer.job import MAX_SKIPPED_RECORDS, JobRecord, sample_overrides, sampling_params
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings

#: prompt_id of sample k when --samples > 1: "<dataset>/<id>#<k>".
SAMPLE_SEP = "#"
#: The submit lock expires after this long if a submit dies holding it.
LOCK_TTL_S = 3600
#: Problems printed in a failure message (the count is exact).
SHOWN_PROBLEMS = 20
#: Redis bytes per queued message beyond its JSON (list entry + node share) and per prompt in the two
#: prompt hashes beyond key/value bytes: measured with INFO memory by bench/bench_producer.py.
LIST_ENTRY_OVERHEAD_B = 12
HASH_ENTRY_OVERHEAD_B = 60


class SubmitError(Exception):
    """The submit cannot proceed; the message says what to do. Nothing was enqueued."""


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
    chat_template_kwargs: dict[str, Any] = field(default_factory=lambda: {"thinking": True})
    think_start_id: int | None = None
    think_end_id: int | None = None
    max_prompt_tokens: int | None = None
    #: sampling flags as given on the command line; None = not given (default, or the job's value).
    sampling: dict[str, Any] = field(default_factory=dict)
    expected_model: str | None = None
    skip_invalid: bool = False
    dry_run: bool = False
    processes: int | None = None
    hosts: int = 1
    server_tok_s: float = 860.0
    mean_output_tokens: float = 1416.0
    progress: bool = False


@dataclass
class DatasetReport:
    rows: int = 0
    prompts: int = 0  # messages of this submission (samples counted), valid ones
    enqueued: int = 0
    already_done: int = 0
    already_queued: int = 0
    dead: int = 0
    skipped: int = 0
    prompt_tokens: int = 0


@dataclass
class SubmitReport:
    job: str
    dry_run: bool
    datasets: dict[str, DatasetReport]
    enqueued: int
    prompt_tokens_enqueued: int
    lengths: dict[str, float]
    estimated_redis_bytes: int
    projected_wall_s: float
    warnings: list[str]
    problems: list[Problem]
    changed: int
    elapsed_s: float
    tokenizer_fingerprint: str
    prompt_ends_with_think_start: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "dry_run": self.dry_run,
            "enqueued": self.enqueued,
            "prompt_tokens_enqueued": self.prompt_tokens_enqueued,
            "datasets": {k: vars(v) for k, v in self.datasets.items()},
            "prompt_length": self.lengths,
            "estimated_redis_bytes": self.estimated_redis_bytes,
            "projected_wall_s": self.projected_wall_s,
            "warnings": self.warnings,
            "skipped": [{"location": p.location, "reason": p.reason} for p in self.problems],
            "changed": self.changed,
            "elapsed_s": round(self.elapsed_s, 3),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "prompt_ends_with_think_start": self.prompt_ends_with_think_start,
        }


@dataclass
class _Existing:
    """What Redis and storage already hold for the job."""

    record: JobRecord | None = None
    hashes: dict[str, str] = field(default_factory=dict)
    datasets: dict[str, str] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)
    queued: set[str] = field(default_factory=set)


def submit(settings: Settings, opts: SubmitOptions, on_progress: Any = None) -> SubmitReport:
    """Run one submit; raises :class:`SubmitError` (nothing enqueued) on any problem it is not told to skip."""
    started = time.monotonic()
    if opts.samples < 1:
        raise SubmitError("--samples must be at least 1")
    if opts.dataset_names and len(opts.dataset_names) != len(opts.paths):
        raise SubmitError(f"{len(opts.dataset_names)} --dataset-name for {len(opts.paths)} inputs; give one per PATH")
    try:
        tok = render.load_tokenizer(opts.tokenizer, opts.trust_remote_code)
    except render.TokenizerError as e:
        raise SubmitError(str(e)) from e
    info = render.describe_tokenizer(tok, opts.tokenizer, opts.think_start_id, opts.think_end_id)

    problems: list[Problem] = []
    client = redis.Redis.from_url(settings.redis_url)
    lock_token = None
    # The pool forks now, while this process holds only the tokenizer (not the datasets).
    pool = render.RenderPool(
        tok, opts.tokenizer, opts.chat_template_kwargs, info.think_start_id, opts.processes, opts.trust_remote_code
    )
    try:
        datasets = _read_all(opts, problems)
        if not opts.dry_run:
            lock_token = _lock(client, settings, opts.job)
        existing = _load_existing(client, settings, opts.job, reachable_required=not opts.dry_run)
        params = _sampling(opts, info, existing.record)
        _check_compatible(opts, info, existing.record, params)
        stager = None if opts.dry_run else Stager(client, settings.keys, opts.job, settings.queue)
        try:
            outcome = _render_and_stage(opts, settings, pool, datasets, existing, params, problems, stager, on_progress)
            if problems and not opts.skip_invalid:
                raise SubmitError(_problem_summary(problems))
            if stager is not None:
                _commit(client, settings, opts, info, existing, params, outcome, problems, stager)
        except BaseException:
            if stager is not None:
                stager.discard()
            raise
    finally:
        pool.close()
        if lock_token is not None:
            _unlock(client, settings, opts.job, lock_token)
        client.close()
    return _report(opts, info, outcome, problems, time.monotonic() - started)


# -- steps -------------------------------------------------------------------------------------------------
def _read_all(opts: SubmitOptions, problems: list[Problem]) -> list[Dataset]:
    datasets: list[Dataset] = []
    names: dict[str, Path] = {}
    for i, path in enumerate(opts.paths):
        name = opts.dataset_names[i] if opts.dataset_names else None
        try:
            ds = read_dataset(path, name, opts.columns, opts.split, problems)
        except InputError as e:
            raise SubmitError(str(e)) from e
        if ds.name in names:
            raise SubmitError(f"{path}: dataset name {ds.name!r} is also {names[ds.name]}; give each a --dataset-name")
        names[ds.name] = path
        datasets.append(ds)
    return datasets


def _lock(client: redis.Redis, settings: Settings, job: str) -> str:
    token = f"{uuid.uuid4().hex}@{time.time():.0f}"
    try:
        ok = client.set(settings.keys.submit_lock(job), token, nx=True, ex=LOCK_TTL_S)
    except redis.RedisError as e:
        raise SubmitError(f"cannot reach Redis at {settings.redis_url}: {e}") from e
    if not ok:
        holder = client.get(settings.keys.submit_lock(job))
        raise SubmitError(
            f"another submit of job {job!r} is running ({holder!r}); wait for it, or if it died, "
            f"delete {settings.keys.submit_lock(job)} (it expires after {LOCK_TTL_S} s)"
        )
    return token


_UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _unlock(client: redis.Redis, settings: Settings, job: str, token: str) -> None:
    client.eval(_UNLOCK, 1, settings.keys.submit_lock(job), token)


def _load_existing(client: redis.Redis, settings: Settings, job: str, reachable_required: bool) -> _Existing:
    keys = settings.keys
    try:
        record = JobRecord.load(client, keys, job)
        existing = _Existing(record=record)
        existing.hashes = {k.decode(): v.decode() for k, v in client.hgetall(keys.prompts(job)).items()}
        existing.datasets = {k.decode(): v.decode() for k, v in client.hgetall(keys.prompt_dataset(job)).items()}
        existing.done = {m.decode() for m in client.smembers(keys.done(job))}
        existing.dead = {k.decode() for k in client.hkeys(keys.dead(job))}
        existing.queued = queued_prompt_ids(client, settings, job) | running_prompt_ids(client, settings, job)
    except redis.RedisError as e:
        if reachable_required:
            raise SubmitError(f"cannot reach Redis at {settings.redis_url}: {e}") from e
        existing = _Existing()  # a dry run without Redis: everything counts as new
    existing.stored = stored_prompt_ids(settings, job)
    return existing


def stored_prompt_ids(settings: Settings, job: str) -> set[str]:
    """Prompt ids with a committed row in storage (empty when storage has nothing for the job yet)."""
    try:
        from storage.reader import stored_prompt_ids as read_stored
    except ImportError:
        return set()
    return set(read_stored(settings.output_uri, job, s3_endpoint_url=settings.s3_endpoint_url))


def _sampling(opts: SubmitOptions, info: render.TokenizerInfo, record: JobRecord | None) -> dict[str, Any]:
    """Flags given win; otherwise the job's existing values; otherwise the defaults."""
    given = {k: v for k, v in opts.sampling.items() if v is not None}
    if record is not None:
        base = dict(record.sampling_params)
        seed = base.pop("sampling_seed", None)
        base.setdefault("seed", seed)
    else:
        base = {"stop_token_ids": info.stop_token_ids or None}
    merged = {**{k: v for k, v in base.items() if v is not None}, **given}
    return sampling_params(**merged)


def _check_compatible(
    opts: SubmitOptions, info: render.TokenizerInfo, record: JobRecord | None, params: dict[str, Any]
) -> None:
    if record is None:
        return
    fix = f"use the same settings as the first submit, or a new --job name (job {opts.job!r} exists)"
    mismatches = []
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
    if mismatches:
        raise SubmitError("; ".join(mismatches) + f"\n  → {fix}")


@dataclass
class _Outcome:
    reports: dict[str, DatasetReport]
    rows: list[dict[str, Any]]  # manifest rows of every valid prompt of this submission
    lengths: list[int]
    message_bytes: int
    enqueued: int
    tokens_enqueued: int
    not_ending: int
    first_not_ending: str | None
    changed: int


def _items(datasets: list[Dataset]) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    for ds in datasets:
        for p in ds.prompts:
            yield p.messages, p.tools


def _render_and_stage(
    opts: SubmitOptions,
    settings: Settings,
    pool: render.RenderPool,
    datasets: list[Dataset],
    existing: _Existing,
    params: dict[str, Any],
    problems: list[Problem],
    stager: Stager | None,
    on_progress: Any,
) -> _Outcome:
    envelope = Envelope(settings)
    out = _Outcome({d.name: DatasetReport(rows=d.rows) for d in datasets}, [], [], 0, 0, 0, 0, None, 0)
    finished = existing.done | existing.stored
    flat = [(ds.name, p) for ds in datasets for p in ds.prompts]
    position = 0
    for results in pool.render(_items(datasets)):
        tasks: list[PromptTask] = []
        batch_tokens = 0
        for result in results:
            dataset, prompt = flat[position]
            position += 1
            if isinstance(result, str):
                problems.append(Problem(prompt.location, f"{result}; fix the row or pass --skip-invalid"))
                continue
            blob, n_tokens, digest, ends = result
            batch_tokens += n_tokens
            if opts.max_prompt_tokens and n_tokens > opts.max_prompt_tokens:
                problems.append(
                    Problem(
                        prompt.location,
                        f"prompt is {n_tokens} tokens, over --max-prompt-tokens {opts.max_prompt_tokens}; "
                        "shorten it, raise the limit, or pass --skip-invalid",
                    )
                )
                continue
            if not ends:
                out.not_ending += 1
                out.first_not_ending = out.first_not_ending or prompt.location
            out.lengths.append(n_tokens)
            report = out.reports[dataset]
            for k in range(opts.samples):
                pid = prompt.prompt_id if opts.samples == 1 else f"{prompt.prompt_id}{SAMPLE_SEP}{k}"
                old = existing.hashes.get(pid)
                if old is not None and old != digest:
                    out.changed += 1
                    problems.append(
                        Problem(
                            prompt.location,
                            f"content changed since job {opts.job!r} was first submitted ({pid}: {old} → {digest}); "
                            "use a new --job name, or --skip-invalid to keep the first version",
                        )
                    )
                    continue
                report.prompts += 1
                report.prompt_tokens += n_tokens
                out.rows.append(
                    {
                        "prompt_id": pid,
                        "dataset": dataset,
                        "row_index": prompt.row_index,
                        "sample_index": k,
                        "content_hash": digest,
                        "prompt_tokens": n_tokens,
                    }
                )
                if pid in finished:
                    report.already_done += 1
                elif pid in existing.dead:
                    report.dead += 1
                elif pid in existing.queued:
                    report.already_queued += 1
                else:
                    report.enqueued += 1
                    out.tokens_enqueued += n_tokens
                    tasks.append(
                        PromptTask(
                            opts.job,
                            dataset,
                            pid,
                            prompt.row_index,
                            digest,
                            blob,
                            k,
                            0,
                            sample_overrides(params, k, opts.samples),
                        )
                    )
        if tasks:
            messages = envelope.encode_many(tasks)
            out.message_bytes += sum(len(m) for m in messages)
            out.enqueued += len(messages)
            if stager is not None:
                stager.push(messages)
        if on_progress is not None:
            on_progress(len(results), batch_tokens)
    for ds in datasets:
        out.reports[ds.name].skipped = sum(1 for p in problems if p.location.startswith(str(ds.source)))
    return out


def _commit(
    client: redis.Redis,
    settings: Settings,
    opts: SubmitOptions,
    info: render.TokenizerInfo,
    existing: _Existing,
    params: dict[str, Any],
    outcome: _Outcome,
    problems: list[Problem],
    stager: Stager,
) -> None:
    keys, job = settings.keys, opts.job
    write_manifest(settings, job, outcome.rows)
    dataset_of = dict(existing.datasets)
    dataset_of.update((r["prompt_id"], r["dataset"]) for r in outcome.rows)
    per_dataset: dict[str, int] = {}
    for name in dataset_of.values():
        per_dataset[name] = per_dataset.get(name, 0) + 1
    now = time.time()
    record = existing.record or JobRecord(name=job, created_at=now)
    record.datasets = per_dataset
    record.prompts = len(dataset_of)
    record.prompt_tokens += sum(r["prompt_tokens"] for r in outcome.rows if r["prompt_id"] not in existing.hashes)
    record.samples = opts.samples
    record.tokenizer = opts.tokenizer
    record.tokenizer_fingerprint = info.fingerprint
    record.chat_template_hash = info.chat_template_hash
    record.chat_template_kwargs = dict(opts.chat_template_kwargs)
    record.sampling_params = params
    record.think_start_id = info.think_start_id
    record.think_end_id = info.think_end_id
    for name in render.TOOL_TOKENS:
        setattr(record, name, info.tool_ids.get(name))
    record.prompt_ends_with_think_start = info.think_start_id is not None and outcome.not_ending == 0
    record.expected_model = opts.expected_model or record.expected_model
    record.updated_at = now
    record.submissions += 1
    record.skipped = [{"location": p.location, "reason": p.reason} for p in problems[:MAX_SKIPPED_RECORDS]]
    record.skipped_count = len(problems)

    rows = outcome.rows
    with client.pipeline(transaction=True) as pipe:
        for start in range(0, len(rows), 5000):
            chunk = rows[start : start + 5000]
            pipe.hset(keys.prompts(job), mapping={r["prompt_id"]: r["content_hash"] for r in chunk})
            pipe.hset(keys.prompt_dataset(job), mapping={r["prompt_id"]: r["dataset"] for r in chunk})
        # done is a cache of storage: refill it after a Redis loss. A stored prompt with a message queued
        # (a `retry --truncated` revision) is not done until that revision is stored.
        newly_known = sorted(existing.stored - existing.done - existing.queued - existing.dead)
        for start in range(0, len(newly_known), 5000):
            pipe.sadd(keys.done(job), *newly_known[start : start + 5000])
        record.save(pipe, keys)
        for name, count in per_dataset.items():
            pipe.hset(keys.dataset_counters(job, name), "submitted", count)
        pipe.hset(keys.counters(job), "submitted", len(dataset_of))
        stager.commit(pipe)
        pipe.execute()


def write_manifest(settings: Settings, job: str, rows: list[dict[str, Any]]) -> None:
    """Tell storage what was submitted (``verify`` finds missing prompts against it)."""
    try:
        from storage.manifest import write_submitted
    except ImportError:
        return
    write_submitted(settings.output_uri, job, rows, s3_endpoint_url=settings.s3_endpoint_url)


# -- reporting -----------------------------------------------------------------------------------------------
def _problem_summary(problems: list[Problem]) -> str:
    lines = [f"{len(problems)} problem(s); nothing was enqueued:"]
    lines += [f"  {p}" for p in problems[:SHOWN_PROBLEMS]]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"  … and {len(problems) - SHOWN_PROBLEMS} more")
    lines.append("  → fix these rows, or pass --skip-invalid to skip them (they are recorded in the job record)")
    return "\n".join(lines)


def length_stats(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {"count": 0}
    ordered = sorted(lengths)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "count": len(ordered),
        "min": ordered[0],
        "median": statistics.median(ordered),
        "mean": round(statistics.fmean(ordered), 1),
        "p99": p99,
        "max": ordered[-1],
    }


def _report(
    opts: SubmitOptions, info: render.TokenizerInfo, outcome: _Outcome, problems: list[Problem], elapsed_s: float
) -> SubmitReport:
    warnings = []
    thinking = opts.chat_template_kwargs.get("thinking", True) is not False
    if thinking and info.think_start_id is None:
        warnings.append(
            "thinking is on but the tokenizer has no <think> token: reasoning spans cannot be found; "
            "pass --think-start-id/--think-end-id"
        )
    elif thinking and outcome.not_ending:
        warnings.append(
            f"thinking is on but {outcome.not_ending} prompt(s) do not end with <think> (id {info.think_start_id}), "
            f"e.g. {outcome.first_not_ending}: this chat template does not open the reasoning block "
            "(K2-Thinking style?) — outputs will start with <think> and reasoning_start will not be 0; "
            "check the tokenizer and --chat-template-kwargs"
        )
    prompts = sum(r.prompts for r in outcome.reports.values())
    hash_bytes = sum(2 * (len(r["prompt_id"]) + HASH_ENTRY_OVERHEAD_B) + 16 + len(r["dataset"]) for r in outcome.rows)
    estimated = outcome.message_bytes + LIST_ENTRY_OVERHEAD_B * outcome.enqueued + hash_bytes
    total_out = prompts * opts.mean_output_tokens
    projected = total_out / max(1e-9, opts.hosts * opts.server_tok_s)
    return SubmitReport(
        job=opts.job,
        dry_run=opts.dry_run,
        datasets=outcome.reports,
        enqueued=outcome.enqueued,
        prompt_tokens_enqueued=outcome.tokens_enqueued,
        lengths=length_stats(outcome.lengths),
        estimated_redis_bytes=estimated,
        projected_wall_s=projected,
        warnings=warnings,
        problems=problems,
        changed=outcome.changed,
        elapsed_s=elapsed_s,
        tokenizer_fingerprint=info.fingerprint,
        prompt_ends_with_think_start=info.think_start_id is not None and outcome.not_ending == 0,
    )
