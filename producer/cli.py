"""The ``producer`` command: ``submit``, ``status``, ``wait``, ``retry``, the lifecycle commands (+ storage's
verify/export/report/compact when that package provides them)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import redis
from rich.console import Console
from rich.markup import escape

from producer.lifecycle import make_commands as make_lifecycle_commands
from producer.status import (
    DEFAULT_WINDOW_S,
    CheckClock,
    StatusReader,
    checked_status,
    confirm_chains,
    confirm_stored,
    format_duration,
)
from producer.view import status_line, status_view
from thinkfleet.cli import STATE, settings_options
from thinkfleet.profiles import FAMILIES
from thinkfleet.settings import Settings, redacted_url

if TYPE_CHECKING:
    from producer.submit import SubmitOptions

# What submit and retry need (Arrow, the tokenizers, Celery) is imported where they run: status, wait, jobs and
# --help start in a few hundred milliseconds, most of it Python, click, rich, redis and the settings
# (tests/test_scale_cli_imports.py names what they must not load).

#: ``producer wait`` exit codes.
EXIT_TIMEOUT = 124
EXIT_INCONSISTENT = 3


#: The flags that override where a job's state and rows are (thinkfleet.cli).
common_options = settings_options(STATE)


class ProducerGroup(click.Group):
    """The ``producer`` group, whose heavy commands load when they are named: ``--help`` lists them with the
    help's first paragraph kept here (:data:`LAZY_COMMANDS`; tests/test_scale_cli_imports.py checks it is still
    the command's own)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            self.add_command(load_lazy_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        listed = click.Group(self.name, {n: self.commands.get(n) or _help_stub(n) for n in self.list_commands(ctx)})
        listed.format_commands(ctx, formatter)


#: Commands whose module is heavy → (module, attribute, the first paragraph of their help).
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "retry": (
        "producer.retry",
        "retry",
        "Re-queue JOB's dead-lettered prompts (or, with --truncated, its length-stopped rows; with --missing, its "
        "prompts that have no stored row).",
    ),
}


def load_lazy_command(name: str) -> click.Command:
    module, attribute, _ = LAZY_COMMANDS[name]
    command = getattr(importlib.import_module(module), attribute)
    assert isinstance(command, click.Command), f"{module}.{attribute} is not a click command"
    return command


def _help_stub(name: str) -> click.Command:
    return click.Command(name, help=LAZY_COMMANDS[name][2])


@click.group(cls=ProducerGroup)
def cli() -> None:
    """thinkfleet producer: datasets → token ids → Redis, and job progress."""


@cli.command("submit")
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
    "(replay) or the --tool-executor's (rows {conversation}/t{i}s{j} per step; README 'Agentic conversations').",
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
@common_options
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
    from producer.submit import SubmitError, submit
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
    opts.progress = err.is_terminal if progress is None else progress
    if priority_flag is not None:
        opts.priority = priority_flag
    if break_lock and not opts.dry_run:
        _break_lock(settings, opts.job, err)
    try:
        report = _with_progress(err, settings, opts) if opts.progress else submit(settings, opts)
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
        broken = break_lock(redis.Redis.from_url(settings.redis_url), settings, job)
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
    from producer.submit import SubmitOptions

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


@cli.command("status")
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--watch", is_flag=True, help="Live view until the job finishes (Ctrl-C to leave).")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes with --watch.")
@click.option("--window", default=DEFAULT_WINDOW_S, show_default=True, help="Seconds of the current rates.")
@click.option(
    "--deep",
    is_flag=True,
    help="Look for every prompt where it is (queue, workers, sets): finds lost prompts, costs Redis a scan of the "
    "queue; checks (and repairs) the counters a plain status reads.",
)
@click.option(
    "--check-every",
    "check_every_s",
    default=300.0,
    show_default=True,
    help="With --watch: seconds between full checks (at most 1 % of Redis's time).",
)
@common_options
def status_cmd(
    job: str,
    as_json: bool,
    watch: bool,
    interval: float,
    window: float,
    deep: bool,
    check_every_s: float,
    settings: Settings,
) -> None:
    """Queued / running / done / dead counts per dataset, rates, ETA and the reasoning alarm of JOB."""
    reader = StatusReader(_redis(settings), settings, job, window, deep=deep)
    if as_json and not watch:
        click.echo(json.dumps(reader.read()))
        return
    console = Console()
    if not watch:
        console.print(status_view(reader.read()))
        return
    clock = CheckClock(check_every_s)
    outage = RedisOutage(Console(stderr=True), settings)
    try:
        if not console.is_terminal or as_json:
            # Redirected (a file, a pipe, a log): a live view writes nothing until it ends; a line per refresh.
            while True:
                st = _watch_read(reader, clock, outage)
                if st is None:
                    time.sleep(interval)
                    continue
                click.echo(json.dumps(st) if as_json else status_line(st))
                sys.stdout.flush()
                if st.get("finished"):
                    return
                time.sleep(interval)
        from rich.live import Live

        with Live(status_view(reader.read()), console=console, refresh_per_second=4) as live:
            while True:
                st = _watch_read(reader, clock, outage)
                if st is None:
                    time.sleep(interval)
                    continue
                live.update(status_view(st))
                if st.get("finished"):
                    return
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def _redis(settings: Settings) -> redis.Redis:
    """The producer's client: one connection at a time is all status and wait use (a bounded pool)."""
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.producer_redis_connections, timeout=60
    ))  # fmt: skip


def _checked_read(reader: StatusReader, clock: CheckClock) -> dict[str, Any]:
    """A counters read, with the full check when it is due (``clock``): the number of prompts in no place, counted
    in Redis (constant memory here, :func:`thinkfleet.state.places.check_places`), and the counters checked against
    the sets; the clock learns what the check cost."""
    st = reader.read()
    # Nothing on the broker while prompts are pending beyond those running: some may be lost, check early.
    suspect = st.get("broker_messages") == 0 and st.get("remaining", 0) > st.get("running", 0)
    if not (clock.due() or (suspect and clock.may_run_early())):
        return st
    started = time.monotonic()
    if st.get("exists") and st.get("mode") != "deep":
        st = checked_status(reader, st)
    # a prompt found in no place is looked for again soon (it may have been in motion), else after every_s
    clock.ran(time.monotonic() - started, soon_s=min(clock.every_s, 30.0) if st.get("unaccounted") else None)
    return st


@cli.command("wait")
@click.argument("job")
@click.option("--timeout", "timeout_s", type=float, help="Give up after this many seconds (exit 124).")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between checks.")
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON.")
@click.option(
    "--lost-after",
    "lost_after_s",
    default=300.0,
    show_default=True,
    help="Exit 3 when prompts stay unaccounted (in no queue, worker, done or dead set) this many seconds.",
)
@click.option(
    "--check-every",
    "check_every_s",
    default=300.0,
    show_default=True,
    help="Seconds between full checks for lost prompts on a large job (at most 1 % of Redis's time; a small "
    "job is checked at every poll).",
)
@common_options
def wait_cmd(
    job: str,
    timeout_s: float | None,
    interval: float,
    as_json: bool,
    lost_after_s: float,
    check_every_s: float,
    settings: Settings,
) -> None:
    """Block until every prompt of JOB is stored or dead-lettered (exit 0); 124 on timeout; 3 when
    prompts are lost (unaccounted for --lost-after seconds) or done in Redis but missing from storage, or (--turns
    all) a conversation stopped without a recorded end — its next turn never enqueued (verify's MISSING TURNS).

    Each poll reads counters (constant memory, O(1) of the queue); the places of pending prompts are scanned
    by a full check every --check-every seconds (every poll for a small job)."""
    client = _redis(settings)
    reader = StatusReader(client, settings, job)
    clock = CheckClock(min(check_every_s, lost_after_s))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    err = Console(stderr=True)
    unaccounted_since: float | None = None
    outage = RedisOutage(err, settings)
    while True:
        try:
            st = _checked_read(reader, clock)
            confirmed = bool(st["finished"])  # then storage is asked whether it agrees
            if confirmed:
                st["missing_from_storage"], examples = confirm_stored(settings, job, client)
                # The stored chains, by the rule verify applies (storage, not Redis, is the truth of where they
                # stand).
                st["missing_turns"] = confirm_chains(settings, job, client) if st.get("conversations") else []
                if st["missing_turns"]:
                    st["finished"] = False
        except REDIS_DOWN as exc:
            # A restart or failover of the job's Redis: the workers ride through it, so does wait (until --timeout).
            outage.down(exc)
            if deadline is not None and time.monotonic() >= deadline:
                err.print(f"timed out: Redis at {outage.url} did not answer ({outage.reason})")
                sys.exit(EXIT_TIMEOUT)
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
            continue
        outage.up()
        if st.get("unaccounted"):
            unaccounted_since = unaccounted_since or time.monotonic()
            if time.monotonic() - unaccounted_since >= lost_after_s:
                _emit(st, as_json)
                err.print(
                    f"[bold red]{st['unaccounted']:,} prompt(s) of {job} are in no queue, no worker, not done and "
                    f"not dead-lettered[/] (e.g. {st.get('unaccounted_ids', [])[:3]}) for {lost_after_s:.0f}s: "
                    f"they are lost. `producer submit` with the same inputs re-enqueues exactly those."
                )
                sys.exit(EXIT_INCONSISTENT)
        elif st.get("unaccounted") == 0:
            unaccounted_since = None  # a scan found every prompt (a counters read, null, says nothing)
        if not st.get("exists"):
            _emit(st, as_json)
            err.print(f"[bold red]error:[/] job {job!r} has no record in Redis; submit it first")
            sys.exit(1)
        stranded = (st.get("conversations") or {}).get("stranded")
        if st.get("remaining") == 0 and stranded:
            # Nothing pending, yet a conversation's last answer goes on to a prompt nobody enqueued: nothing will
            # ever run it (thinkfleet/chain_end.py). Not finished — and waiting longer would not change that.
            _emit(st, as_json)
            _stranded(err, job, stranded, st["conversations"].get("stranded_ids") or [])
            sys.exit(EXIT_INCONSISTENT)
        if confirmed:
            missing = st["missing_from_storage"]
            owed = st["missing_turns"]
            _emit(st, as_json)
            if missing:
                err.print(
                    f"[bold red]{missing} prompt(s) are done in Redis but not in storage[/] "
                    f"(e.g. {examples}); run `producer verify {job}`"
                )
                sys.exit(EXIT_INCONSISTENT)
            if owed:
                _stranded(err, job, len(owed), owed)
                sys.exit(EXIT_INCONSISTENT)
            return
        if deadline is not None and time.monotonic() >= deadline:
            _emit(st, as_json)
            err.print(
                f"timed out: {st['remaining']:,} of {st['total']:,} prompts not finished "
                f"(ETA {format_duration(st['eta_s'])})"
            )
            sys.exit(EXIT_TIMEOUT)
        time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))


def _stranded(err: Console, job: str, count: int, examples: list[str]) -> None:
    err.print(
        f"[bold red]{count:,} conversation(s) of {job} stopped without a recorded end[/]: their last stored turn goes "
        f"on to a prompt that was never enqueued nor dead-lettered (e.g. {examples[:3]}); nothing will run it. "
        f"`producer verify {job}` lists them (MISSING TURNS)."
    )


#: What a Redis restart or failover raises at a client (BusyLoadingError, while it loads its AOF, is a
#: ConnectionError).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class RedisOutage:
    """One line on stderr when the job's Redis stops answering and one when it answers again: ``wait`` and
    ``status --watch`` keep polling through a restart instead of dying with a traceback."""

    def __init__(self, err: Console, settings: Settings) -> None:
        self.err = err
        self.url = redacted_url(settings.redis_url)
        self.since: float | None = None
        self.reason = ""

    def down(self, exc: Exception) -> None:
        self.reason = f"{type(exc).__name__}: {exc}"
        if self.since is None:
            self.since = time.monotonic()
            self.err.print(f"[yellow]Redis at {escape(self.url)} does not answer[/] ({escape(self.reason)}); retrying")

    def up(self) -> None:
        if self.since is not None:
            self.err.print(f"Redis answers again after {time.monotonic() - self.since:.0f}s")
            self.since = None


def _watch_read(reader: StatusReader, clock: CheckClock, outage: RedisOutage) -> dict[str, Any] | None:
    """``status --watch``'s read; None while Redis does not answer (said once on stderr)."""
    try:
        st = _checked_read(reader, clock)
    except REDIS_DOWN as exc:
        outage.down(exc)
        return None
    outage.up()
    return st


def _emit(st: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(st))
    else:
        Console().print(status_view(st))


def _register_optional_commands() -> None:
    """Commands other packages own, shown under ``producer`` when they are installed."""
    try:
        from storage import cli as storage_cli
    except ImportError:
        storage_cli = None
    for name in ("verify", "export", "report", "compact"):
        command = getattr(storage_cli, name, None)
        if isinstance(command, click.Command):
            cli.add_command(command, name)


_register_optional_commands()
for _command in make_lifecycle_commands(common_options):
    cli.add_command(_command)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
