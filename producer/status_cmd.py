"""``producer status`` and ``producer wait``: the commands that poll a job's progress, and how they ride through a
Redis that stops answering (:class:`RedisOutage`).

Apart from :mod:`producer.status` (what the counters and the full check read) and :mod:`producer.view` (how a
status renders) because this is the polling: how often, when a full check runs, and what ends a wait and with
which exit code. Apart from :mod:`producer.cli`, which only lists and registers commands. Nothing heavy is
imported here: ``status`` and ``wait`` start fast (tests/test_scale_cli_imports.py).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
import redis
from rich.console import Console
from rich.markup import escape

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
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings, redacted_url

#: ``producer wait`` exit codes.
EXIT_TIMEOUT = 124
EXIT_INCONSISTENT = 3


@click.command("status")
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
@settings_options(STATE)
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
    return sync_client(settings.redis_url, max_connections=settings.producer_redis_connections, pool_wait_s=60)


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


@click.command("wait")
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
@settings_options(STATE)
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
