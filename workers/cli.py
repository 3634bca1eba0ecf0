"""``worker``: start a Celery worker for this host's SGLang server with the right pool and bound.

Flags override ``THINKFLEET_*`` settings; the Settings object they make is handed to the app itself
(``workers.app.use_settings``), and the result is ``celery -A workers.app worker`` sized to the in-flight bound,
with one difference: the pool is ``workers.pool.LoopPool`` (prompts on the event loop, no thread per message)
where plain ``celery worker`` runs Celery's thread pool; both handle every message the same way.
"""

from __future__ import annotations

import os
import sys

import click

from thinkfleet.settings import load_settings

#: Flags whose Settings field has another name.
_FLAG_TO_FIELD = {"name": "worker_name"}


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--sglang-url", help="This host's SGLang server [THINKFLEET_SGLANG_URL].")
@click.option("--max-inflight", type=int, help="Requests in flight to SGLang [THINKFLEET_MAX_INFLIGHT].")
@click.option("--redis-url", help="Redis (job state and broker) [THINKFLEET_REDIS_URL].")
@click.option("--broker-url", help="Celery broker if not Redis [THINKFLEET_BROKER_URL].")
@click.option("--output-uri", help="Parquet root: a path or s3://… [THINKFLEET_OUTPUT_URI].")
@click.option("--name", help="Worker identity (default hostname-pid) [THINKFLEET_WORKER_NAME].")
@click.option("--queue", "--queues", "queue", help="Queue to consume [THINKFLEET_QUEUE].")
@click.option("--key-prefix", help="Redis key prefix [THINKFLEET_KEY_PREFIX].")
@click.option("--lease-s", type=float, help="Seconds before a silent worker's prompts re-run elsewhere.")
@click.option("--metrics-port", type=int, help="Prometheus port (0 = any free port).")
@click.option("--s3-endpoint-url", help="S3-compatible endpoint for s3:// output.")
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@click.pass_context
def main(ctx: click.Context, loglevel: str, **flags: object) -> None:
    """Run a thinkfleet worker (extra arguments are passed to `celery worker`)."""
    overrides = {_FLAG_TO_FIELD.get(flag, flag): value for flag, value in flags.items() if value is not None}
    settings = load_settings(**overrides)
    # Celery's `--pool custom` names its class in the environment, read when celery.concurrency is imported.
    os.environ["CELERY_CUSTOM_WORKER_POOL"] = "workers.pool:LoopPool"
    from workers.app import use_settings  # the worker runtime's imports, only once the flags parsed

    app = use_settings(settings)
    argv = [
        "worker",
        "--pool",
        "custom",  # workers.pool:LoopPool (CELERY_CUSTOM_WORKER_POOL)
        "--concurrency",
        str(app.conf.worker_concurrency),
        "--queues",
        settings.queue,
        "--loglevel",
        loglevel,
        "--events",
        "--without-mingle",
        "--without-gossip",
    ]
    if settings.worker_name:
        argv += ["--hostname", f"{settings.worker_name}@%h"]
    argv += list(ctx.args)
    sys.exit(app.worker_main(argv))


if __name__ == "__main__":
    main()
