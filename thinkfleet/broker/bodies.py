"""A delivered task's body read before Celery's trace reads it (the worker's pool starts the prompt early)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kombu.serialization import loads, prepare_accept_content


class BodyReader:
    """Decodes task bodies of the content types the app accepts (msgpack, json): never a pickle."""

    def __init__(self, accept_content: Iterable[str]) -> None:
        self._accept = prepare_accept_content(accept_content)

    def task_args(self, body: Any, content_type: str, content_encoding: str) -> tuple[Any, ...]:
        """The task's positional args: message protocol 2's body is ``(args, kwargs, embed)``."""
        decoded = loads(body, content_type, content_encoding, accept=self._accept)
        return tuple(decoded[0])
