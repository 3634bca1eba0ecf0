"""``producer jobs``, ``pause``, ``resume``, ``cancel``, ``purge``: a job's lifecycle from the command line.

The state machine and its Redis moves are ``thinkfleet/state/lifecycle.py``; this module is the CLI.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click
import redis
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from thinkfleet.redis_client import BULK_TIMEOUT_S, sync_client
from thinkfleet.settings import Settings
from thinkfleet.state import lifecycle as lc
from thinkfleet.state.invariant import NotObservable, account

#: ``purge --force`` waits this long for the cancelled job's in-flight prompts to end.
PURGE_FORCE_WAIT_S = 60.0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _client(settings: Settings) -> redis.Redis:
    return sync_client(settings.redis_url, timeout_s=BULK_TIMEOUT_S)


def _fail(message: str) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    sys.exit(1)


def make_commands(common_options: Callable[..., Any]) -> list:
    """The lifecycle commands, decorated with ``producer.cli``'s common options."""

    @click.command("jobs")
    @click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
    @common_options
    def jobs_cmd(as_json: bool, settings: Settings) -> None:
        """Every job in Redis: state (active/paused/cancelled/finished), progress, age and priority."""
        jobs = lc.list_jobs(_client(settings), settings)
        if as_json:
            click.echo(json.dumps([j.to_dict() for j in jobs]))
            return
        table = Table("job", "state", "done", "dead", "total", "progress", "age", "priority")
        table.columns[0].no_wrap = True  # a job name is copied into the next command: never cut or wrapped
        for j in jobs:
            progress = f"{100.0 * (j.done + j.dead) / j.total:.1f}%" if j.total else "-"
            table.add_row(
                j.job, j.state, f"{j.done:,}", f"{j.dead:,}", f"{j.total:,}", progress, _age(j.age_s), str(j.priority)
            )
        console = Console()
        # Wider than the terminal (or rich's 80 columns when piped) rather than an ellipsis in a name.
        width = Measurement.get(console, console.options.update(width=10_000), table).maximum
        (Console(width=width) if width > console.width else console).print(table)

    @click.command("pause")
    @click.argument("job")
    @common_options
    def pause_cmd(job: str, settings: Settings) -> None:
        """Workers stop taking JOB's prompts (in-flight ones finish); its queued messages are parked."""
        try:
            n = lc.pause(_client(settings), settings, job)
        except lc.LifecycleError as e:
            _fail(str(e))
        click.echo(f"job {job} paused: {n} queued prompt(s) parked; `producer resume {job}` releases them")

    @click.command("resume")
    @click.argument("job")
    @common_options
    def resume_cmd(job: str, settings: Settings) -> None:
        """Make a paused (or cancelled) JOB active again: its parked prompts go back on the queue."""
        client = _client(settings)
        try:
            was = lc.get_state(client, settings, job)
            n = lc.resume(client, settings, job)
        except lc.LifecycleError as e:
            _fail(str(e))
        click.echo(f"job {job} active: {n} parked prompt(s) back on the queue")
        if was == lc.CANCELLED:
            click.echo(f"its cancelled prompts stay dead-lettered: `producer retry {job} --error-class cancelled`")

    @click.command("cancel")
    @click.argument("job")
    @common_options
    def cancel_cmd(job: str, settings: Settings) -> None:
        """Cancel JOB: queued prompts dead-lettered `cancelled`, in-flight ones aborted; stored rows kept."""
        try:
            done = lc.cancel_detail(_client(settings), settings, job)
        except lc.LifecycleError as e:
            _fail(str(e))
        click.echo(
            f"job {job} cancelled: {done.dead} queued prompt(s) dead-lettered `cancelled`; workers abort its in-flight "
            f"requests within seconds (revive: `producer resume {job}` then `producer retry {job} --error-class "
            "cancelled`)"
        )
        if done.live:
            click.echo(
                f"{done.live} parked message(s) kept: a live worker runs their prompts (that run stores or "
                f"dead-letters them; `producer cancel {job}` again clears the copies)"
            )

    @click.command("purge")
    @click.argument("job")
    @click.option("--force", is_flag=True, help="Cancel the job first, then purge once nothing runs.")
    @common_options
    def purge_cmd(job: str, force: bool, settings: Settings) -> None:
        """Delete every Redis key of JOB (export it first); storage is untouched. Refuses while anything of
        JOB is queued or running, unless --force."""
        client = _client(settings)
        if not lc.job_keys(client, settings, job) and not client.sismember(settings.keys.jobs, job):
            _fail(f"no job {job!r} in Redis ({settings.redis_url})")
        # The job's submit lock, held to the end: a submit or retry running now would commit into the keys
        # deleted under it (and purge used to delete its lock and staging with them). Imported here: producer.state
        # loads the submit's modules, which `producer status`/`jobs`/`--help` must not (tests/test_scale_cli_imports).
        from producer.state import StateError, SubmitLock

        try:
            with SubmitLock(client, settings, job):
                n = _purge(client, settings, job, force)
        except StateError as e:
            _fail(f"cannot purge job {job} now: {e}")
        click.echo(f"job {job} purged: {n} Redis key(s) deleted (storage untouched)")

    return [jobs_cmd, pause_cmd, resume_cmd, cancel_cmd, purge_cmd]


def _purge(client: redis.Redis, settings: Settings, job: str, force: bool) -> int:
    """purge (or purge --force) under the job's submit lock; returns the keys deleted."""
    busy = _busy(client, settings, job)
    if busy and not force:
        _fail(
            f"job {job} has {busy['queued']} queued and {busy['running']} running prompt(s): "
            f"cancel it first (`producer cancel {job}`) or use --force"
        )
    if busy:
        lc.cancel(client, settings, job, who="producer purge --force")
        deadline = time.monotonic() + PURGE_FORCE_WAIT_S
        while (busy := _busy(client, settings, job)) and time.monotonic() < deadline:
            time.sleep(1.0)
            # again: copies kept for live runs that have ended since, claims of runs that died since
            lc.cancel_parked(client, settings, job, who="producer purge --force")
        if busy:
            Console(stderr=True).print(
                f"[yellow]warning:[/] {busy['running']} prompt(s) still running after {PURGE_FORCE_WAIT_S:.0f} s;"
                " purging anyway"
            )
    return lc.purge(client, settings, job)


def _busy(client: redis.Redis, settings: Settings, job: str) -> dict[str, int]:
    """Queued (incl. parked) and running counts of ``job``; {} when none."""
    try:
        counts = account(client, settings, job).counts()
    except NotObservable:
        counts = {"queued": int(client.llen(settings.keys.parked(job))), "running": 0}
    queued, running = counts.get("queued", 0), counts.get("running", 0)
    return {"queued": queued, "running": running} if queued or running else {}
