"""Compressed messages are refused before kombu inflates them (a decompression bomb costs nothing).

kombu decompresses a body whose ``compression`` header names a codec while it builds the ``Message`` —
before any content check, with no output limit (a 2 KB zlib frame is 64 MiB). A worker's consumer
(``workers.tasks.GuardedConsumer``) calls :func:`refuse_compression` before it receives anything; kombu then
hands such a message to ``on_decode_error`` with :class:`CompressionRefused`. thinkfleet never sends
compressed messages (ids are zstd-packed inside).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kombu.compression
import kombu.message


class CompressionRefused(ValueError):
    """A message with a ``compression`` header: never inflated (a decompression bomb costs nothing)."""

    def __init__(self, codec: str, size: int) -> None:
        super().__init__(
            f"message body of {size:,} bytes declares compression {codec[:64]!r}: refused before decompressing "
            "(thinkfleet never compresses messages)"
        )


def _refuse(body: Any, content_type: str = "?") -> bytes:
    raise CompressionRefused(str(content_type), len(body) if hasattr(body, "__len__") else -1)


def refuse_compression() -> None:
    """Make every kombu codec refuse instead of decompressing, in this process (a worker's consumer).

    Both the module-level ``decompress`` that ``kombu.message.Message`` calls and each registered decoder
    are replaced; a self-check builds a compressed message and fails loudly if kombu still inflates it.
    """
    kombu.message.decompress = _refuse  # type: ignore[assignment]
    decoders: dict[str, Callable[..., Any]] = kombu.compression._decoders  # type: ignore[attr-defined]
    for codec in list(decoders):
        decoders[codec] = lambda body, _codec=codec: _refuse(body, _codec)
    probe = kombu.message.Message(body=b"x\x9c\x03\x00", headers={"compression": "application/x-gzip"})
    if not (probe.errors and isinstance(probe.errors[0][1], CompressionRefused)):
        raise RuntimeError("kombu still decompresses message bodies: cannot refuse compressed messages")
