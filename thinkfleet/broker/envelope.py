"""A Celery message captured once and filled in per prompt: the fast path of publishing.

``apply_async`` per prompt costs a Python round trip through Celery and kombu and one Redis command
each (~460 prompts/s). Here Celery's own machinery builds the message *once* (a publish on a private
in-memory kombu broker, same app configuration: :func:`capture_message`), and every prompt fills the few
fields that differ (task id, argsrepr, delivery tag, body) into that exact JSON (:class:`Envelope`). A
message is therefore byte-for-byte what ``send_task`` would have pushed to the kombu Redis transport, except
for its random delivery tag. The producer stages them (producer/enqueue.py); a worker encodes a multi-turn
job's next turn and re-queues a paused job's message with them.

With a signing key configured (thinkfleet/signing.py) every task that carries no signature yet is signed here, the
one door every message goes through; a task that has one (a paused job's message, a dead letter resent) keeps it.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

import msgpack

from thinkfleet.broker.celery_app import make_app
from thinkfleet.broker.keys import priority_list, priority_step
from thinkfleet.message import TASK_NAME, PromptTask
from thinkfleet.settings import Settings

#: Celery truncates argsrepr to this many characters (``app.amqp.argsrepr_maxsize``).
ARGSREPR_MAX = 1024

_SENTINEL_ID = "tf-sentinel-id-6f1d"
_SENTINEL_ARGSREPR = "tf-sentinel-argsrepr-6f1d"
_SENTINEL_TAG = "tf-sentinel-tag-6f1d"
_SENTINEL_BODY = "tf-sentinel-body-6f1d"
_capture_lock = threading.Lock()


class Envelope:
    """The kombu Redis-transport JSON of one ``thinkfleet.generate`` message, as a fill-in template."""

    def __init__(self, settings: Settings, priority: int = 0) -> None:
        message = capture_message(settings)
        #: kombu reads ``properties.priority`` when it restores or re-publishes a message: it names the
        #: same list the message is queued on. Priority 0 keeps Celery's message as it was captured.
        self.priority = priority_step(priority)
        if self.priority:
            message["properties"]["priority"] = self.priority
        body = msgpack.unpackb(base64.b64decode(message["body"]), raw=False)
        self.kwargs, self.embed = body[1], body[2]
        message["body"] = _SENTINEL_BODY
        message["headers"]["argsrepr"] = _SENTINEL_ARGSREPR
        message["headers"]["kwargsrepr"] = "{}"
        message["properties"]["delivery_tag"] = _SENTINEL_TAG
        text = json.dumps(message)  # kombu's dumps: json with default separators, ASCII-escaped
        slots = {
            f'"{_SENTINEL_ID}"': "id",
            f'"{_SENTINEL_ARGSREPR}"': "argsrepr",
            f'"{_SENTINEL_TAG}"': "tag",
            f'"{_SENTINEL_BODY}"': "body",
        }
        for quoted in slots:
            if quoted not in text:
                raise RuntimeError(f"Celery's message layout changed: {quoted} not in {text[:400]}")
        parts = re.split("(" + "|".join(map(re.escape, slots)) + ")", text)
        #: literal, slot, literal, slot, …, literal — the slots named as in ``slots``.
        self._literals = [p.encode() for p in parts[0::2]]
        self._slots = [slots[p] for p in parts[1::2]]
        self._packer = msgpack.Packer(use_bin_type=True)
        self.queue = priority_list(settings.queue, self.priority)
        from thinkfleet.signing import signer_for

        self.signer = signer_for(settings)

    def encode(self, task: PromptTask) -> bytes:
        """The JSON to LPUSH onto the queue for ``task``."""
        return self.encode_many([task])[0]

    def encode_many(self, tasks: list[PromptTask]) -> list[bytes]:
        tags = _delivery_tags(len(tasks))
        literals, slots, pack, kwargs, embed = self._literals, self._slots, self._packer.pack, self.kwargs, self.embed
        signer = self.signer
        out = []
        for task, tag in zip(tasks, tags, strict=True):
            values = {
                "id": _quote(task.task_id),
                "argsrepr": _quote(task.argsrepr[:ARGSREPR_MAX]),
                "tag": tag,
                "body": b'"' + binascii.b2a_base64(pack([_args(task, signer), kwargs, embed]), newline=False) + b'"',
            }
            pieces = [literals[0]]
            for slot, literal in zip(slots, literals[1:], strict=True):
                pieces.append(values[slot])
                pieces.append(literal)
            out.append(b"".join(pieces))
        return out


def _args(task: PromptTask, signer: Any) -> list[Any]:
    """The task's args, signed by ``signer`` when it carries no signature yet (an already signed task keeps its own)."""
    args = task.to_args()
    if signer is None or task.signature:
        return args
    return [*args[:9], task.generation, signer.task_signature(task), *args[11:]]  # (a reusable prefix stays)


def _quote(text: str) -> bytes:
    return encode_basestring_ascii(text).encode()


def _delivery_tags(n: int) -> list[bytes]:
    """Random uuid4-shaped tags, as kombu makes them (``uuid()``), in bulk: uuid4() costs ~5 µs each."""
    raw = bytearray(os.urandom(16 * n))
    for i in range(n):
        raw[16 * i + 6] = (raw[16 * i + 6] & 0x0F) | 0x40  # version 4
        raw[16 * i + 8] = (raw[16 * i + 8] & 0x3F) | 0x80  # RFC 4122 variant
    h = raw.hex()
    return [
        f'"{h[i : i + 8]}-{h[i + 8 : i + 12]}-{h[i + 12 : i + 16]}-{h[i + 16 : i + 20]}-{h[i + 20 : i + 32]}"'.encode()
        for i in range(0, 32 * n, 32)
    ]


def capture_message(settings: Settings) -> dict[str, Any]:
    """One message published by Celery's own ``send_task`` through kombu's virtual transport.

    The in-memory broker shares the Redis transport's envelope code (``kombu.transport.virtual``):
    body encoding, delivery info, priority, properties. Only the final ``LPUSH`` differs.
    """
    app = make_app(settings.with_overrides(broker_url="memory://localhost/"))
    sentinel = PromptTask("j", "d", "p", 0, "h", b"\x00")
    with _capture_lock, app.connection_for_write() as conn:
        channel = conn.default_channel
        with app.producer_or_acquire() as producer:
            app.send_task(
                TASK_NAME, args=sentinel.to_args(), task_id=_SENTINEL_ID, producer=producer, queue=settings.queue
            )
        message = channel._get(settings.queue)
    if msgpack.unpackb(base64.b64decode(message["body"]), raw=False)[0][5] != b"\x00":
        raise RuntimeError("captured Celery message does not carry the ids blob as msgpack bin")
    return message
