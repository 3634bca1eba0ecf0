"""The ``producer`` command: the group and what it lists — ``submit`` (:mod:`producer.submit_cmd`), ``status`` and
``wait`` (:mod:`producer.status_cmd`), ``retry`` (loaded when named), the lifecycle commands (:mod:`producer.lifecycle`)
(+ storage's verify/export/report/compact when that package provides them)."""

from __future__ import annotations

import importlib

import click
import redis

from producer.lifecycle import make_commands as make_lifecycle_commands
from producer.status_cmd import status_cmd, wait_cmd
from producer.submit_cmd import submit_cmd
from thinkfleet.cli import STATE, settings_options

# What submit and retry need (Arrow, the tokenizers, Celery) is imported where they run (inside submit_cmd's
# functions; retry's module when it is named): status, wait, jobs and --help start in a few hundred milliseconds,
# most of it Python, click, rich, redis and the settings (tests/test_scale_cli_imports.py names what they must not
# load).

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

    def invoke(self, ctx: click.Context) -> object:
        """A one-shot command whose Redis does not answer (down, restarting, failing over) ends with one line
        naming it and exit 1, never a traceback; ``wait`` and ``status --watch`` ride through outages themselves."""
        try:
            return super().invoke(ctx)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise click.ClickException(
                f"cannot reach Redis ({type(exc).__name__}: {exc}): the command stopped there. "
                "Is the head up (THINKFLEET_REDIS_URL)? Run the command again once it answers."
            ) from None


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


for _command in (submit_cmd, status_cmd, wait_cmd):
    cli.add_command(_command)


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
