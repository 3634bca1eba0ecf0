"""``producer retry JOB``: resend dead-lettered prompts, or re-run truncated rows with a bigger budget.

Dead letters keep their whole message (ledger.dead_letter), so a retry resends exactly what failed.
A truncated re-run reads the prompt ids back from storage and sends them as the next ``revision``
with a ``max_new_tokens`` override; the committed view keeps the highest revision, so the new row
replaces the old one.
"""

from __future__ import annotations

import base64
import json

import click
import msgpack
import pyarrow.compute as pc
import redis

from thinkfleet.message import TASK_NAME, PromptTask, pack_ids
from thinkfleet.settings import Settings, load_settings


def _publish(settings: Settings, tasks: list[PromptTask]) -> None:
    from workers.app import make_app

    app = make_app(settings, register=False)
    with app.producer_or_acquire() as producer:
        for task in tasks:
            app.send_task(
                TASK_NAME,
                args=task.to_args(),
                task_id=task.task_id,
                argsrepr=task.argsrepr,
                kwargsrepr="{}",
                queue=settings.queue,
                producer=producer,
            )


def retry_dead(settings: Settings, job: str, error_classes: tuple[str, ...] = ()) -> list[str]:
    """Re-enqueue dead-lettered prompts (optionally only some error classes); returns their ids."""
    client = redis.Redis.from_url(settings.redis_url)
    keys = settings.keys
    tasks: list[PromptTask] = []
    for raw in client.hvals(keys.dead(job)):
        record = json.loads(raw)
        if error_classes and not any(record["error_class"].startswith(c) for c in error_classes):
            continue
        tasks.append(PromptTask.from_args(msgpack.unpackb(base64.b64decode(record["task"]))))
    _publish(settings, tasks)
    if tasks:
        with client.pipeline() as p:
            p.hdel(keys.dead(job), *[t.prompt_id for t in tasks])
            p.hincrby(keys.counters(job), "dead", -len(tasks))
            for t in tasks:
                p.hincrby(keys.dataset_counters(job, t.dataset), "dead", -1)
            p.execute()
    return [t.prompt_id for t in tasks]


def retry_truncated(settings: Settings, job: str, max_new_tokens: int) -> list[str]:
    """Re-run every row of the committed view that stopped on length, as the next revision."""
    from storage.reader import read_committed

    table = read_committed(
        settings.output_uri,
        job,
        columns=[
            "dataset",
            "prompt_id",
            "row_index",
            "sample_index",
            "revision",
            "content_hash",
            "input_ids",
            "finish_reason",
        ],
        s3_endpoint_url=settings.s3_endpoint_url,
    )
    table = table.filter(pc.equal(table["finish_reason"], "length"))
    tasks = [
        PromptTask(
            job=job,
            dataset=row["dataset"],
            prompt_id=row["prompt_id"],
            row_index=row["row_index"],
            content_hash=row["content_hash"],
            ids_blob=pack_ids(row["input_ids"]),
            sample_index=row["sample_index"],
            revision=row["revision"] + 1,
            overrides={"max_new_tokens": max_new_tokens},
        )
        for row in table.to_pylist()
    ]
    client = redis.Redis.from_url(settings.redis_url)
    if tasks:
        # Not "done" until the new revision is stored (workers skip prompts in the done set); the
        # counters follow so that status and verify agree while the re-runs are in flight.
        keys = settings.keys
        with client.pipeline() as p:
            p.srem(keys.done(job), *[t.prompt_id for t in tasks])
            p.hincrby(keys.counters(job), "done", -len(tasks))
            for t in tasks:
                p.hincrby(keys.dataset_counters(job, t.dataset), "done", -1)
            p.execute()
    _publish(settings, tasks)
    return [t.prompt_id for t in tasks]


@click.command("retry")
@click.argument("job")
@click.option("--error-class", "error_classes", multiple=True, help="Only dead letters of this class (prefix).")
@click.option("--truncated", is_flag=True, help="Re-run rows that hit max_new_tokens instead of dead letters.")
@click.option("--max-new-tokens", type=int, help="New budget for --truncated re-runs.")
@click.option("--redis-url")
@click.option("--output-uri")
@click.option("--key-prefix")
@click.option("--queue")
@click.option("--s3-endpoint-url")
@click.option("--json", "as_json", is_flag=True)
def retry(
    job: str,
    error_classes: tuple[str, ...],
    truncated: bool,
    max_new_tokens: int | None,
    as_json: bool,
    **overrides: str | None,
) -> None:
    """Re-queue JOB's dead-lettered prompts (or, with --truncated, its length-stopped rows)."""
    settings = load_settings(**overrides)
    if truncated:
        if not max_new_tokens:
            raise click.UsageError("--truncated needs --max-new-tokens (the larger budget for the re-run)")
        ids = retry_truncated(settings, job, max_new_tokens)
        what = f"truncated rows re-queued with max_new_tokens={max_new_tokens}"
    else:
        ids = retry_dead(settings, job, error_classes)
        what = "dead-lettered prompts re-queued"
    if as_json:
        click.echo(json.dumps({"job": job, "requeued": len(ids), "prompt_ids": ids}))
    else:
        click.echo(f"{len(ids)} {what} for job {job}")
