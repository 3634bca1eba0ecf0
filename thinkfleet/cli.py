"""One decorator for the command-line flags that override :class:`~thinkfleet.settings.Settings`.

Every command (``producer …``, its storage commands, ``producer retry``, ``worker``) declares which settings
it lets a flag override; the flag's help is the setting's own description and environment variable, and the
command receives one ``settings`` keyword: the settings from the environment / ``.env`` with the given flags
applied, a remote Redis's password checked (:meth:`Settings.require_safe_redis_password`).
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from thinkfleet.settings import Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])

#: Where a job's state and rows are: the flags every producer and storage command takes.
STATE = ("redis_url", "output_uri", "key_prefix", "queue", "s3_endpoint_url")


def _click_type(field: str) -> Any:
    """``int`` / ``float`` for numeric settings (``X | None`` unwrapped), else plain text."""
    annotation = Settings.model_fields[field].annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation if annotation in (int, float) else None


def settings_options(
    fields: Sequence[str] = STATE,
    *,
    aliases: dict[str, Sequence[str]] | None = None,
    check_redis_password: bool = True,
) -> Callable[[F], F]:
    """Add ``--field-name`` for each Settings ``fields`` entry and hand the command ``settings=``.

    ``aliases`` gives a field other flag spellings (``{"worker_name": ["--name"]}``); a flag left out means
    "not given", so the environment's value stands. ``check_redis_password=False`` leaves the password check
    to the command (the worker makes it at start, where a refusal exits 78 and is logged like any failed start).
    """
    unknown = [f for f in fields if f not in Settings.model_fields]
    if unknown:
        raise ValueError(f"not settings: {unknown}")
    aliases = aliases or {}

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            overrides = {f: kwargs.pop(f) for f in fields}
            settings = load_settings(**overrides)
            if check_redis_password:
                settings.require_safe_redis_password(click.UsageError)
                settings.require_supported_broker(click.UsageError)
                from thinkfleet.signing import SigningKeyError, signer_for

                try:
                    signer_for(settings)  # an unreadable or short signing key is named before anything runs
                except SigningKeyError as exc:
                    raise click.UsageError(str(exc)) from None
            return func(*args, settings=settings, **kwargs)

        for field in reversed(fields):
            info = Settings.model_fields[field]
            flags = aliases.get(field) or [f"--{field.replace('_', '-')}"]
            env = f"THINKFLEET_{field.upper()}"
            help_text = f"{info.description or field} [{env}]"
            wrapper = click.option(*flags, field, type=_click_type(field), default=None, help=help_text)(wrapper)
        return typing.cast(F, wrapper)

    return decorate
