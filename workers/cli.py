"""``worker``: start a Celery worker for this host's SGLang server with the right pool and bound.

Flags override ``THINKFLEET_*`` settings; the Settings object they make is handed to the app itself
(``workers.app.use_settings``), and the result is exactly ``celery -A workers.app worker`` sized to the in-flight
bound: both run the app's pool, ``workers.pool.LoopPool`` (prompts on the event loop, no thread per message).
"""

from __future__ import annotations

import sys

import click

from thinkfleet.cli import settings_options
from thinkfleet.settings import Settings


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@settings_options(
    (
        "sglang_url",
        "max_inflight",
        "redis_url",
        "broker_url",
        "output_uri",
        "worker_name",
        "queue",
        "key_prefix",
        "lease_s",
        "metrics_port",
        "s3_endpoint_url",
        # An agentic job's executor (workers/tool_exec.py): which specs this host runs, and how hard it drives them.
        "tool_executors",
        "tool_timeout_s",
        "tool_retries",
        "tool_concurrency",
    ),
    aliases={"worker_name": ["--name"], "queue": ["--queue", "--queues"]},
    check_redis_password=False,  # checked at start: exit 78, logged
)
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@click.pass_context
def main(ctx: click.Context, loglevel: str, settings: Settings) -> None:
    """Run a thinkfleet worker (extra arguments are passed to `celery worker`)."""
    from workers.app import use_settings  # the worker runtime's imports, only once the flags parsed

    app = use_settings(settings)
    argv = [
        "worker",
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
