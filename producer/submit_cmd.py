"""``producer submit``: the command line of a submit — its flags, a job file merged under them, the progress bar
and the printed report — turned into :class:`producer.submit_options.SubmitOptions` for :func:`producer.submit.submit`.

Apart from :mod:`producer.cli` (the group) because it is the one command that reads a job file and drives the
render pool; apart from :mod:`producer.submit` because that is the submit without a terminal (tests and benches
call it directly). What the submit needs (Arrow, the tokenizers, the job-file parser) is imported inside the
functions that run it, so registering this command costs ``producer --help``, ``status`` and ``wait`` nothing
(tests/test_scale_cli_imports.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import redis
from rich.console import Console
from rich.markup import escape

from thinkfleet.cli import STATE, settings_options
from thinkfleet.profiles import FAMILIES
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings

if TYPE_CHECKING:
    from producer.submit_options import SubmitOptions


@click.command("submit")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--job", help="Job name (re-submitting the same job enqueues only what is missing). [job file: job]")
@click.option("--tokenizer", help="Tokenizer directory or hub id (local cache only). [job file: tokenizer]")
@click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer's own code (Kimi's needs it).")
@click.option(
    "--chat-template-kwargs",
    default=None,
    help='JSON merged over the model family\'s thinking switch (kimi/deepseek {"thinking": true}, '
    'qwen3/glm45 {"enable_thinking": true}, harmony {"reasoning_effort": "medium"}).',
)
@click.option(
    "--model-family",
    type=click.Choice(FAMILIES),
    help="Reasoning/tool-call markers and thinking switch of this model family [detected from the tokenizer].",
)
@click.option(
    "--no-reasoning-spans",
    is_flag=True,
    help="Run although the tokenizer lacks the family's reasoning markers: null reasoning spans, no alarm.",
)
@click.option(
    "--turns",
    type=click.Choice(["last", "all"]),
    default="last",
    show_default=True,
    help="last: regenerate the final assistant turn; all: every assistant turn, each rendered from the model's "
    "own earlier answers (rows {conversation}/t{i}; turns after a tool call are not generated).",
)
@click.option(
    "--tool-results",
    type=click.Choice(["replay", "executor"]),
    default=None,
    help="With --turns all: regenerate through tool calls, feeding back the dataset's recorded tool results "
    "(replay) or the --tool-executor's (rows {conversation}/t{i}s{j} per step; docs/conversations.md).",
)
@click.option(
    "--tool-executor",
    help="tool_results executor: module:function, path/to/file.py:function or an http(s) URL (workers must list it "
    "in THINKFLEET_TOOL_EXECUTORS).",
)
@click.option(
    "--tool-mismatch",
    type=click.Choice(["chain_end", "keep_recorded"]),
    default="chain_end",
    show_default=True,
    help="A model call unlike the dataset's (function, count): end the chain there, or feed the recorded results.",
)
@click.option("--max-tool-steps", type=int, default=8, show_default=True, help="Tool-calling steps per turn at most.")
@click.option("--think-start-id", type=int, help="Override the <think> id read from the tokenizer.")
@click.option("--think-end-id", type=int, help="Override the </think> id read from the tokenizer.")
@click.option("--dataset-name", "dataset_names", multiple=True, help="Dataset name per PATH (default: file stem).")
@click.option("--messages-column", help="Column of OpenAI messages (default: 'messages' if present).")
@click.option("--conversations-column", help="Column of ShareGPT turns (default: 'conversations').")
@click.option("--prompt-column", help="Column of plain prompts (default: 'prompt').")
@click.option("--system-column", help="Column of system prompts for --prompt/--conversations rows.")
@click.option("--tools-column", help="Column of tool declarations (default: 'tools' if present).")
@click.option("--id-column", default="id", show_default=True, help="Stable row id column; '' = row numbers.")
@click.option("--split", help="Split of a save_to_disk DatasetDict.")
@click.option("--samples", default=1, show_default=True, type=click.IntRange(1), help="Generations per prompt.")
@click.option("--max-prompt-tokens", type=int, help="Rows with longer prompts are problems.")
@click.option(
    "--context-length",
    type=click.IntRange(2),
    help="The servers' context length (as SGLang's --context-length) [config.json next to --tokenizer]; "
    "rows with prompt + max_new_tokens ≥ it are problems. Lower it by the draft slots when serving with EAGLE.",
)
@click.option("--max-new-tokens", type=int, help="Generation budget [10240].")
@click.option("--temperature", type=float, help="[1.0]")
@click.option("--top-p", type=float, help="[0.95]")
@click.option("--top-k", type=int, help="[-1]")
@click.option("--min-p", type=float, help="[0.0]")
@click.option("--seed", type=int, help="SGLang sampling_seed (samples get seed + index).")
@click.option("--stop-token-ids", help="Comma-separated ids [tokenizer eos ∪ generation_config eos].")
@click.option(
    "--logprobs",
    type=click.IntRange(0),
    help="Store each output token's logprob and the top-K alternatives' (0: the sampled token's only).",
)
@click.option("--expect-model", help="Model path workers' servers must serve.")
@click.option("--skip-invalid", is_flag=True, help="Skip bad rows (recorded in the job record) instead of failing.")
@click.option("--dry-run", is_flag=True, help="Tokenize and report; enqueue nothing.")
@click.option("--processes", type=int, help="Tokenizer processes [all cores].")
@click.option("--hosts", default=1, show_default=True, type=click.IntRange(1), help="Dry run: GPU hosts.")
@click.option("--server-tok-s", default=860.0, show_default=True, help="Dry run: output tokens/s per host.")
@click.option("--mean-output-tokens", default=1416.0, show_default=True, help="Dry run: tokens per answer.")
@click.option("--progress/--no-progress", default=None, help="Progress bar [on a terminal].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--priority",
    "priority_flag",
    type=int,
    help="Job priority 0 (highest, default) … 9: workers take lower numbers first. [job file: priority]",
)
@click.option(
    "--break-lock",
    is_flag=True,
    help="Break a dead submit's lock of this job first: its process is gone (same host), or the lock is ≥ 60 s old.",
)
@settings_options(STATE)
def submit_cmd(
    paths: tuple[Path, ...],
    as_json: bool,
    progress: bool | None,
    priority_flag: int | None,
    break_lock: bool,
    settings: Settings,
    **flags: Any,
) -> None:
    """Tokenize PATH… with the model's chat template and enqueue the prompts of job JOB.

    One JOB.yaml argument is a job file (docs/examples/job.yaml): every dataset with its own columns,
    samples and sampling; flags given next to it override its top-level values."""
    from producer.jobfile import JOB_FILE_SUFFIXES, is_job_file
    from producer.submit import submit
    from producer.submit_options import SubmitError
    from producer.view import submit_report

    err = Console(stderr=True)
    if is_job_file(paths):
        opts = _job_file_options(paths[0], flags, err)
    elif any(p.suffix.lower() in JOB_FILE_SUFFIXES for p in paths):
        raise click.UsageError("a job file is submitted alone: producer submit JOB.yaml [flags]")
    else:
        for name in ("job", "tokenizer"):
            if not flags[name]:
                raise click.UsageError(f"Missing option '--{name}' (or give a job file: producer submit JOB.yaml)")
        opts = _submit_options(list(paths), flags)
    show_progress = err.is_terminal if progress is None else progress
    if priority_flag is not None:
        opts.priority = priority_flag
    if break_lock and not opts.dry_run:
        _break_lock(settings, opts.job, err)
    try:
        report = _with_progress(err, settings, opts) if show_progress else submit(settings, opts)
    except SubmitError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, markup=True, soft_wrap=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report.to_json()))
        for w in report.warnings:
            err.print(f"[bold red]WARNING:[/] {w}", soft_wrap=True)
    else:
        Console().print(submit_report(report, opts.hosts, opts.server_tok_s, opts.mean_output_tokens))


def _break_lock(settings: Settings, job: str, err: Console) -> None:
    from producer.state import StateError, break_lock

    try:
        broken = break_lock(sync_client(settings.redis_url), settings, job)
    except (StateError, redis.RedisError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    if broken:
        err.print(f"[yellow]warning:[/] broke the submit lock of job {job} held by {escape(broken)}", soft_wrap=True)


def _job_file_options(path: Path, flags: dict[str, Any], err: Console) -> SubmitOptions:
    """A job file → options: its values, overridden by the flags given on the command line."""
    from click.core import ParameterSource

    from producer.jobfile import DATASET_FLAGS, JobFileError, apply_flags, dataset_options, submit_flags
    from producer.jobfile import load as load_job_file
    from producer.jobfile import resolved as resolved_job_file

    ctx = click.get_current_context()
    given = {n: v for n, v in flags.items() if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)}
    try:
        for param in ctx.command.params:
            if param.name in given and param.name in DATASET_FLAGS:
                raise JobFileError(
                    [f"{param.opts[0]} describes PATH inputs: set `{DATASET_FLAGS[param.name]}:` in each "
                     f"datasets entry of {path} instead"]
                )  # fmt: skip
        jf = apply_flags(load_job_file(path), given, path)
        file_flags, warnings = submit_flags(jf, set(flags), path)
        _check_as_flags(ctx, file_flags, set(given), path)
    except JobFileError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    for w in warnings:
        err.print(f"[yellow]note:[/] {escape(w)}", highlight=False, soft_wrap=True)
    opts = _submit_options([], {**flags, **file_flags})
    opts.datasets = dataset_options(jf)
    opts.job_file = resolved_job_file(jf)
    opts.priority = jf.priority
    return opts


def _check_as_flags(ctx: click.Context, values: dict[str, Any], given: set[str], path: Path) -> None:
    """The file's values pass the checks their flags make (a --model-family choice, an --samples range)."""
    from producer.jobfile import FLAG_KEYS, JobFileError

    params = {p.name: p for p in ctx.command.params}
    problems = []
    for name, value in values.items():
        if value is None or name in given or name not in params:
            continue
        try:
            values[name] = params[name].type_cast_value(ctx, value)
        except click.BadParameter as e:
            problems.append(f"{path}: {'.'.join(FLAG_KEYS[name])}: {e.message}; fix the value")
    if problems:
        raise JobFileError(problems)


def _submit_options(paths: list[Path], f: dict[str, Any]) -> SubmitOptions:
    from producer.inputs import Columns
    from producer.submit_options import SubmitOptions

    kwargs: dict[str, Any] = {}  # merged over the model family's thinking switch by submit
    if f["chat_template_kwargs"]:
        try:
            given = json.loads(f["chat_template_kwargs"])
        except ValueError as e:
            raise click.BadParameter(f"not JSON: {e}", param_hint="--chat-template-kwargs") from e
        if not isinstance(given, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--chat-template-kwargs")
        kwargs.update(given)
    stops = None
    if f["stop_token_ids"]:
        try:
            stops = [int(t) for t in f["stop_token_ids"].replace(" ", "").split(",") if t]
        except ValueError as e:
            raise click.BadParameter(
                "comma-separated integers, e.g. 163586,163585", param_hint="--stop-token-ids"
            ) from e
    return SubmitOptions(
        paths=paths,
        job=f["job"],
        tokenizer=f["tokenizer"],
        dataset_names=list(f["dataset_names"]),
        columns=Columns(
            messages=f["messages_column"],
            conversations=f["conversations_column"],
            prompt=f["prompt_column"],
            system=f["system_column"],
            tools=f["tools_column"],
            id=f["id_column"],
        ),
        split=f["split"],
        samples=f["samples"],
        trust_remote_code=f["trust_remote_code"],
        chat_template_kwargs=kwargs,
        model_family=f["model_family"],
        reasoning_spans=not f["no_reasoning_spans"],
        turns=f.get("turns") or "last",
        tool_results=f.get("tool_results"),
        tool_mismatch=f.get("tool_mismatch") or "chain_end",
        max_tool_steps=f.get("max_tool_steps") or 8,
        tool_executor=f.get("tool_executor"),
        think_start_id=f["think_start_id"],
        think_end_id=f["think_end_id"],
        max_prompt_tokens=f["max_prompt_tokens"],
        context_length=f["context_length"],
        sampling={
            "max_new_tokens": f["max_new_tokens"],
            "temperature": f["temperature"],
            "top_p": f["top_p"],
            "top_k": f["top_k"],
            "min_p": f["min_p"],
            "seed": f["seed"],
            "stop_token_ids": stops,
        },
        logprobs=f["logprobs"],
        expected_model=f["expect_model"],
        skip_invalid=f["skip_invalid"],
        dry_run=f["dry_run"],
        processes=f["processes"],
        hosts=f["hosts"],
        server_tok_s=f["server_tok_s"],
        mean_output_tokens=f["mean_output_tokens"],
    )


def _with_progress(console: Console, settings: Settings, opts: SubmitOptions) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from producer.inputs import count_rows
    from producer.submit import submit

    columns = (
        TextColumn("[bold]tokenizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:,.0f} prompts/s"),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    counts = [count_rows(d.path) for d in opts.inputs()]
    total = None if None in counts else sum(c or 0 for c in counts)
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("render", total=total, rate=0.0, tokens=0)
        # The rate counts from the first rendered batch: tokenizer loading and the pool start are not rendering.
        state: dict[str, float] = {"n": 0, "tokens": 0, "first_at": 0.0, "first_n": 0}

        def on_progress(n: int, tokens: int) -> None:
            now = time.monotonic()
            if not state["first_at"]:
                state["first_at"], state["first_n"] = now, n
            state["n"] += n
            state["tokens"] += tokens
            elapsed = now - state["first_at"]
            rate = (state["n"] - state["first_n"]) / elapsed if elapsed > 0 else 0.0
            bar.update(task, advance=n, rate=rate, tokens=int(state["tokens"]))

        return submit(settings, opts, on_progress=on_progress)
