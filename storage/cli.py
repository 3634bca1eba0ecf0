"""Click commands for storage's side of ``producer``: verify, export, report, compact.

``producer/cli.py`` registers these in its group; each also runs on its own. Common options override
:class:`thinkfleet.settings.Settings` (env ``THINKFLEET_*``), and ``--json`` prints one JSON
document for scripts.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click

from thinkfleet.cli import STATE, settings_options
from thinkfleet.settings import Settings

#: ``--redis-url --output-uri --key-prefix --queue --s3-endpoint-url``, folded into a ``settings`` arg.
common_options = settings_options(STATE)


def _print_json(payload: Any) -> None:
    click.echo(json.dumps(payload, indent=2, sort_keys=True, default=str))


@click.command("verify")
@click.argument("job")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
@click.option(
    "--live",
    is_flag=True,
    help="While the job runs: check that every submitted prompt is done, dead-lettered, queued or running "
    "(Redis only, storage is not read); exit 1 naming the unaccounted ones.",
)
def verify(settings: Settings, job: str, as_json: bool, live: bool) -> None:
    """Check that every submitted prompt of JOB is stored exactly once, with sound spans.

    Every part is decoded first with its page checksums verified; a damaged one is quarantined (moved to
    JOB/_quarantine/) and named. Exits 1 on any missing, duplicated, malformed or stale row, on a row whose
    input_ids do not hash to its content_hash or whose ids_crc32 does not match its ids, on a quarantined part
    whose prompts are not stored again, on the reasoning alarm, or when there is no submitted set to check
    against; fenced rows (a stale claim's writes, left out of the committed view) are reported only. With
    --live, exits 1 when a submitted prompt is in no place (not stored, not dead-lettered, not on the
    queue, not delivered to a live worker), and 2 when that cannot be checked (no such job, Redis
    unreachable, a RabbitMQ broker).
    """
    if live:
        from storage.verify_live import format_live_report, verify_live

        live_report = verify_live(settings, job)
        if as_json:
            _print_json(live_report.to_dict())
        else:
            click.echo(format_live_report(live_report))
        if live_report.error:
            raise SystemExit(2)
        if not live_report.ok:
            raise SystemExit(1)
        return

    from storage.verify import verify_job
    from storage.verify_report import format_report

    report = verify_job(settings, job)
    if as_json:
        _print_json(report.to_dict())
    else:
        click.echo(format_report(report))
    if not report.ok:
        raise SystemExit(1)


@click.command("export")
@click.argument("job")
@common_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["eagle3", "specforge", "hf", "messages", "conversations"]),
    default="eagle3",
    show_default=True,
    help="eagle3: token ids + loss mask (Parquet, or JSONL if --out ends in .jsonl); "
    "specforge: JSONL {input_ids, loss_mask} for SpecForge data.prompts_path and speculators prepare-data; "
    "hf: a Hugging Face dataset (save_to_disk) with ids, spans and metadata; "
    "messages: OpenAI/TRL chat JSONL (source conversation + the generated turn); "
    "conversations: the same under SpecForge's 'conversations' key.",
)
@click.option(
    "--out",
    "out",
    default=None,
    help="Local path or s3://bucket/key [./JOB-FORMAT.jsonl|.parquet, hf: ./JOB-hf]. "
    "With --shard-rows: X.jsonl → X-00000.jsonl…, or a directory of part-00000.*.",
)
@click.option(
    "--shard-rows",
    type=click.IntRange(min=1),
    default=None,
    help="At most N rows per output file [--follow: 1000].",
)
@click.option(
    "--follow",
    is_flag=True,
    help="While the job runs: write each committed row once, as it commits, into rolling shards in the --out "
    "directory (each closed atomically, with its cursor); a restart goes on where the last closed shard ends. "
    "Ends when the job is finished (producer wait's condition) or after --until-idle. docs/exports.md: "
    "Training while generating.",
)
@click.option(
    "--reader",
    default=None,
    metavar="NAME",
    help="--follow: register as reader NAME, so the job's log is kept until this reader has it in a closed shard.",
)
@click.option(
    "--until-idle",
    "until_idle_s",
    type=click.FloatRange(min=0),
    default=None,
    metavar="S",
    help="--follow: also end after S seconds with no new row.",
)
@click.option(
    "--shard-seconds",
    "shard_s",
    type=click.FloatRange(min=0),
    default=None,
    metavar="S",
    help="--follow: close a shard at most S seconds after its first row [5]; also whenever the feed is idle.",
)
@click.option("--drop-truncated", is_flag=True, help="Leave out rows that did not end on a stop (length, abort).")
@click.option(
    "--drop-flag",
    "drop_flags",
    default="",
    metavar="FLAG[,FLAG…]",
    help="Leave out rows carrying any of these quality flags: truncated, loop, no_think_end, empty_answer, "
    "tool_call_unparsed (docs/storage.md#quality-flags). --drop-truncated is --drop-flag truncated.",
)
@click.option(
    "--min-reasoning-tokens", type=click.IntRange(min=0), default=0, help="Leave out rows with less reasoning."
)
@click.option(
    "--exclude-reasoning",
    is_flag=True,
    help="Token formats: mask the reasoning (through </think>) out of the loss; text formats: drop it.",
)
@click.option(
    "--merge-turns",
    is_flag=True,
    help="eagle3/specforge, --turns all jobs: one sample per conversation (its last turn's prompt + output), "
    "the loss also over every earlier model answer found verbatim in that prompt.",
)
@click.option(
    "--max-length",
    type=click.IntRange(min=1),
    default=None,
    help="Warn, naming them, about rows longer than this [default: the format's consumer's: 2048 (SpecForge) "
    "for specforge/eagle3/conversations, 1024 (TRL) for hf/messages].",
)
@click.option("--tokenizer", default=None, help="Tokenizer path/id for decoding (default: the job record's).")
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="messages/conversations: allow the tokenizer's own code (Kimi's needs it); off, such a tokenizer is refused.",
)
@click.option(
    "--push-to-hub", "push_to_hub", default=None, metavar="REPO", help="hf: also upload to this Hub dataset repo."
)
@click.option("--hub-private", is_flag=True, help="hf: make a repo that --push-to-hub creates private.")
@click.option(
    "--image-urls",
    type=click.Choice(["store", "data"]),
    default="store",
    show_default=True,
    help="messages/conversations, image prompts: point at each image where the image store keeps it (messages: a "
    "file:// or s3:// URL; conversations: SpecForge's plain path), or inline its bytes as a data: URI.",
)
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def export(
    settings: Settings,
    job: str,
    fmt: str,
    out: str | None,
    shard_rows: int | None,
    drop_truncated: bool,
    drop_flags: str,
    min_reasoning_tokens: int,
    exclude_reasoning: bool,
    merge_turns: bool,
    max_length: int | None,
    tokenizer: str | None,
    trust_remote_code: bool,
    push_to_hub: str | None,
    hub_private: bool,
    image_urls: str,
    datasets: tuple[str, ...],
    as_json: bool,
    follow: bool,
    reader: str | None,
    until_idle_s: float | None,
    shard_s: float | None,
) -> None:
    """Export the committed rows of JOB as training data.

    Token formats keep the stored ids exactly; the text formats decode the generated turn from them with
    the job's tokenizer (local files only; one that ships its own code is refused unless
    --trust-remote-code is given) and take the conversation before it from the submit manifest.
    With --follow, while the job runs: rolling shards, each row once (docs/exports.md).
    """
    from storage.exports import ExportError, export_job

    if follow:
        _follow(settings, job, fmt, out, as_json, reader, until_idle_s, shard_s, shard_rows, **{
            "datasets": list(datasets) or None, "drop_truncated": drop_truncated,
            "drop_flags": tuple(f for f in drop_flags.split(",") if f.strip()),
            "min_reasoning_tokens": min_reasoning_tokens, "exclude_reasoning": exclude_reasoning,
            "merge_turns": merge_turns, "max_length": max_length, "tokenizer": tokenizer,
            "trust_remote_code": trust_remote_code, "push_to_hub": push_to_hub, "image_urls": image_urls,
        })  # fmt: skip
        return
    given = [name for name, v in (("--reader", reader), ("--until-idle", until_idle_s), ("--shard-seconds", shard_s))
             if v is not None]  # fmt: skip
    if given:
        raise click.UsageError(f"{', '.join(given)} go with --follow")
    try:
        result = export_job(
            settings,
            job,
            fmt,  # type: ignore[arg-type]
            out,
            exclude_reasoning=exclude_reasoning,
            tokenizer=tokenizer,
            datasets=list(datasets) or None,
            trust_remote_code=trust_remote_code,
            drop_truncated=drop_truncated,
            drop_flags=[f for f in drop_flags.split(",") if f.strip()],
            min_reasoning_tokens=min_reasoning_tokens,
            shard_rows=shard_rows,
            max_length=max_length,
            push_to_hub=push_to_hub,
            hub_private=hub_private,
            merge_turns=merge_turns,
            image_urls=image_urls,
        )
    except ExportError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        _print_json(asdict(result))
        return
    files = f" in {len(result.files)} files" if len(result.files) > 1 else ""
    click.echo(f"wrote {result.rows} rows ({result.format}) to {result.path}{files}")
    for reason, count in result.skipped.items():
        click.echo(f"  left out {count} rows: {reason.replace('_', ' ')}")
    if result.pushed_to:
        click.echo(f"  pushed to the Hub: {result.pushed_to}")
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)


def _follow(
    settings: Settings,
    job: str,
    fmt: str,
    out: str | None,
    as_json: bool,
    reader: str | None,
    until_idle_s: float | None,
    shard_s: float | None,
    shard_rows: int | None,
    **options: Any,
) -> None:
    """``export --follow``: rolling shards until the job is finished or idle; one summary line on stderr."""
    from storage.exports import ExportError, ExportOptions
    from storage.follow import DEFAULT_SHARD_ROWS, DEFAULT_SHARD_S, FollowOptions, follow_job

    how = FollowOptions(
        reader=reader,
        until_idle_s=until_idle_s,
        shard_rows=shard_rows or DEFAULT_SHARD_ROWS,
        shard_s=DEFAULT_SHARD_S if shard_s is None else shard_s,
    )
    try:
        result = follow_job(settings, job, fmt, out, ExportOptions(**options), how)
    except ExportError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        # Whatever it was doing, the closed shards are whole and the half-written one is cleaned at the next start.
        click.echo("interrupted: the closed shards stay; the same command goes on after the last one", err=True)
        raise SystemExit(130) from None
    if as_json:
        _print_json(asdict(result))
    click.echo(result.summary(), err=True)


@click.command("report")
@click.argument("job")
@common_options
@click.option("--out", "out_dir", default=None, help="Directory for card.md, report.png and report.html.")
@click.option(
    "--gpus-per-host",
    type=click.IntRange(min=1),
    default=None,
    help="GPUs per SGLang server for GPU-hours [default: tp × pp × dp from each server's recorded launch arguments].",
)
@click.option(
    "--usd-per-gpu-hour",
    type=click.FloatRange(min=0),
    default=None,
    help="Price one GPU-hour: the card shows the cost.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of tables.")
def report(
    settings: Settings,
    job: str,
    out_dir: str | None,
    gpus_per_host: int | None,
    usd_per_gpu_hour: float | None,
    as_json: bool,
) -> None:
    """Counts, length and reasoning distributions, finish reasons, tokens/s, per-worker totals, and the data card:
    per dataset what was stored, dead-lettered, truncated or flagged, GPU-hours, tokens/s per GPU and cost.

    --out also writes card.md and draws report.png/report.html with matplotlib: pip install 'thinkfleet[report]'.
    """
    import importlib.util

    if out_dir and importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException(
            "report --out draws its charts with matplotlib, which is not installed: "
            "pip install 'thinkfleet[report]' (or run report without --out for the summary alone)"
        )
    from storage.report import print_summary, report_job

    summary, written = report_job(
        settings, job, out_dir, gpus_per_host=gpus_per_host, usd_per_gpu_hour=usd_per_gpu_hour
    )
    if as_json:
        _print_json({**summary, "files": written})
        return
    print_summary(summary)
    for path in written:
        click.echo(f"wrote {path}")


@click.command("compact")
@click.argument("job")
@common_options
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets (repeatable).")
@click.option("--max-rows-per-file", type=int, default=None, help="Rows per compacted file.")
@click.option(
    "--max-mb-per-file",
    type=click.IntRange(min=1),
    default=None,
    help="MiB per compacted file, estimated as decoded (on disk ~2-3x less) [2048].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def compact(
    settings: Settings,
    job: str,
    datasets: tuple[str, ...],
    max_rows_per_file: int | None,
    max_mb_per_file: int | None,
    as_json: bool,
) -> None:
    """Merge JOB's small parts into large files per dataset (its committed view, duplicates dropped).

    Memory stays within THINKFLEET_STORAGE_MEMORY_MB whatever the job's size; with --dataset it may run while
    the job does (parts committed meanwhile are left for the next run)."""
    from storage.compact import DEFAULT_MAX_BYTES_PER_FILE, DEFAULT_MAX_ROWS_PER_FILE, compact_job

    result = compact_job(
        settings,
        job,
        datasets=list(datasets) or None,
        max_rows_per_file=max_rows_per_file or DEFAULT_MAX_ROWS_PER_FILE,
        max_bytes_per_file=(max_mb_per_file << 20) if max_mb_per_file else DEFAULT_MAX_BYTES_PER_FILE,
    )
    if as_json:
        _print_json(asdict(result))
        return
    for d in result.datasets:
        what = d.skipped or f"{len(d.files_written)} file(s) written"
        fenced = f" ({d.fenced_rows} fenced rows dropped)" if d.fenced_rows else ""
        click.echo(
            f"{d.dataset}: {d.parts_before} parts, {d.rows_before} rows -> {d.rows_after} rows{fenced}; "
            f"{what}; {d.parts_removed} parts removed"
        )
        for part in d.quarantined:
            click.echo(f"  DAMAGED part quarantined (not compacted; `producer verify {job}` names its prompts): {part}")
        for part in d.refused:
            click.echo(f"  REFUSED (resolves outside the job: not read, not deleted): {part}")


COMMANDS = (verify, export, report, compact)
