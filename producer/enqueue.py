"""Fast, all-or-nothing publishing of prompt tasks, and what is already queued or running.

``apply_async`` per prompt costs a Python round trip through Celery and kombu and one Redis command
each (~460 prompts/s). Here Celery's own machinery builds the message *once* (a publish on a private
in-memory kombu broker, same app configuration), and every prompt fills the few fields that differ
(task id, argsrepr, delivery tag, body) into that exact JSON. Messages are ``LPUSH``-ed many per
command into a *staging* list; the commit moves the whole list onto the queue in one Lua call, so a
submit that fails half-way leaves nothing on the queue (the staging list expires).

A message is therefore byte-for-byte what ``send_task`` would have pushed to the kombu Redis
transport, except for its random delivery tag.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
import uuid
from collections.abc import Iterable
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

import msgpack
import redis

from thinkfleet.keys import Keys, kombu_transport_options
from thinkfleet.message import TASK_NAME, PromptTask
from thinkfleet.settings import Settings

#: Values per LPUSH and bytes per pipeline round trip when staging.
LPUSH_VALUES = 256
PIPELINE_BYTES = 4 << 20
#: Messages per LRANGE when scanning the queue for a job's prompts.
SCAN_CHUNK = 2000
#: A staging list outlives a crashed submit by this long.
STAGING_TTL_S = 24 * 3600
#: Celery truncates argsrepr to this many characters (``app.amqp.argsrepr_maxsize``).
ARGSREPR_MAX = 1024

_SENTINEL_ID = "tf-sentinel-id-6f1d"
_SENTINEL_ARGSREPR = "tf-sentinel-argsrepr-6f1d"
_SENTINEL_TAG = "tf-sentinel-tag-6f1d"
_SENTINEL_BODY = "tf-sentinel-body-6f1d"
_capture_lock = threading.Lock()

#: kombu's Redis priority lists: ``queue`` for 0 (the highest), ``queue\x06\x16N`` for N = 1..9 (lower),
#: as ``workers.app`` configures them (``priority_steps`` 0..9, ``sep``); workers pop them in this order.
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = tuple(range(10))


def priority_step(priority: int | None) -> int:
    """A job's priority as a kombu step: 0 (highest, the default) … 9 (lowest); out of range is clamped."""
    return min(max(int(priority or 0), PRIORITY_STEPS[0]), PRIORITY_STEPS[-1])


def priority_list(queue: str, priority: int | None) -> str:
    """The list a message of ``priority`` is queued on (kombu's ``_q_for_pri``): 0 is ``queue`` itself."""
    step = priority_step(priority)
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def priority_lists(queue: str) -> list[str]:
    """Every priority list of ``queue``, highest first (``KEYS`` of the priority-aware Lua scripts)."""
    return [priority_list(queue, step) for step in PRIORITY_STEPS]


def job_priority(client: redis.Redis, settings: Settings, job: str) -> int:
    """The job record's priority as a step (0 when there is no record)."""
    from thinkfleet.state.job import JobRecord

    record = JobRecord.load(client, settings.keys, job)
    return priority_step(record.priority if record else 0)


# Move a staged list onto the queue in order, atomically. RENAME when the queue is empty is O(1) and
# wakes blocked BRPOP consumers like a push does; PERSIST drops the staging TTL it carries over.
_COMMIT = """
local n = redis.call('LLEN', KEYS[1])
if n == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('PERSIST', KEYS[2])
  return n
end
for i = 1, n do redis.call('RPOPLPUSH', KEYS[1], KEYS[2]) end
return n
"""


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

    def encode(self, task: PromptTask) -> bytes:
        """The JSON to LPUSH onto the queue for ``task``."""
        return self.encode_many([task])[0]

    def encode_many(self, tasks: list[PromptTask]) -> list[bytes]:
        tags = _delivery_tags(len(tasks))
        literals, slots, pack, kwargs, embed = self._literals, self._slots, self._packer.pack, self.kwargs, self.embed
        out = []
        for task, tag in zip(tasks, tags, strict=True):
            values = {
                "id": _quote(task.task_id),
                "argsrepr": _quote(task.argsrepr[:ARGSREPR_MAX]),
                "tag": tag,
                "body": b'"' + binascii.b2a_base64(pack([task.to_args(), kwargs, embed]), newline=False) + b'"',
            }
            pieces = [literals[0]]
            for slot, literal in zip(slots, literals[1:], strict=True):
                pieces.append(values[slot])
                pieces.append(literal)
            out.append(b"".join(pieces))
        return out


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
    from workers.app import make_app

    app = make_app(settings.with_overrides(broker_url="memory://localhost/"), register=False)
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


# -- what is already on the broker ------------------------------------------------------------------------
_REVISION = re.compile(r"/r\d+$")


def prompt_of_task_id(job: str, task_id: str) -> str | None:
    """``job/prompt/r3`` → ``prompt`` (None for another job's task)."""
    if not task_id.startswith(job + "/"):
        return None
    m = _REVISION.search(task_id)
    return task_id[len(job) + 1 : m.start()] if m else None


def queue_keys(client: redis.Redis, queue: str) -> list[str]:
    """The queue's list and kombu's priority lists next to it (``queue\\x06\\x163`` …)."""
    keys = [queue]
    for key in priority_lists(queue)[1:]:
        if client.exists(key):
            keys.append(key)
    return keys


def _task_id(raw: bytes) -> str | None:
    try:
        return json.loads(raw)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None


def queued_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` with a message waiting in the queue."""
    found: set[str] = set()
    # A paused job's parked messages are queued too (thinkfleet/state/lifecycle.py).
    for key in [*queue_keys(client, settings.queue), settings.keys.parked(job)]:
        # Read head to tail while workers pop the tail and others push the head: a push shifts what we
        # have not read yet towards the tail, so re-check the length each time instead of snapshotting it.
        start = 0
        while start < client.llen(key):
            for raw in client.lrange(key, start, start + SCAN_CHUNK - 1):
                tid = _task_id(raw)
                pid = prompt_of_task_id(job, tid) if tid else None
                if pid is not None:
                    found.add(pid)
            start += SCAN_CHUNK
    return found


def running_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` delivered to a worker and not yet acknowledged (kombu's unacked hash)."""
    unacked = str(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"])
    found: set[str] = set()
    for _tag, raw in client.hscan_iter(unacked, count=1000):
        try:
            tid = json.loads(raw)[0]["headers"]["id"]
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        pid = prompt_of_task_id(job, tid)
        if pid is not None:
            found.add(pid)
    return found


# -- staging and commit -------------------------------------------------------------------------------------
class Stager:
    """Messages pushed to a private list as they are ready, moved onto the queue only by :meth:`commit`."""

    def __init__(self, client: redis.Redis, keys: Keys, job: str, queue: str, priority: int = 0) -> None:
        self.client = client
        self.key = keys.staging(job, uuid.uuid4().hex[:12])
        #: The job's priority list (``queue`` itself for priority 0); its messages say the same priority.
        self.queue = priority_list(queue, priority)
        self.count = 0
        self.bytes = 0
        self._pipe = client.pipeline(transaction=False)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._commit = client.register_script(_COMMIT)

    def push(self, messages: Iterable[bytes]) -> None:
        for m in messages:
            self._pending.append(m)
            self._pending_bytes += len(m)
            if len(self._pending) >= LPUSH_VALUES:
                self._queue_lpush()
            if self._pending_bytes >= PIPELINE_BYTES:
                self.flush()

    def _queue_lpush(self) -> None:
        if self._pending:
            # LPUSH k a b c leaves a rightmost: kombu's BRPOP then serves them in push order.
            self._pipe.lpush(self.key, *self._pending)
            self.count += len(self._pending)
            self._pending = []

    def flush(self) -> None:
        self._queue_lpush()
        if len(self._pipe):
            self._pipe.expire(self.key, STAGING_TTL_S)
            self._pipe.execute()
        self.bytes += self._pending_bytes
        self._pending_bytes = 0

    def commit(self, pipe: redis.client.Pipeline | None = None) -> Any:
        """Move everything staged onto the queue (inside ``pipe``'s MULTI when given)."""
        self.flush()
        return self._commit(keys=[self.key, self.queue], client=pipe or self.client)

    def discard(self) -> None:
        self._pending = []
        self._pipe.reset()
        self.client.delete(self.key)
