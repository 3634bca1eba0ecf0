"""What is on the broker, read from Redis: queue lists (with kombu's priority lists and the workers' host lists),
task ids of the messages on them, and the delivered-but-unacknowledged messages in kombu's ``unacked`` hash.

Readers only (status, verify, the invariant, a re-submit's dedup): they never move a message. What a task
id means (``job/prompt/rN``) is :mod:`thinkfleet.state.invariant`'s business; here it is kombu's envelope.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import msgpack
import redis

from thinkfleet.broker.keys import KombuKeys, host_glob, priority_lists

if TYPE_CHECKING:  # the message module loads numpy and zstandard: status and wait read task ids only
    from thinkfleet.message import PromptTask

#: Messages per Lua call when scanning a queue list (each call blocks Redis while it runs: keep it short).
QUEUE_CHUNK = 200
#: Unacked entries per HSCAN round trip.
UNACKED_CHUNK = 1000

# The task id of a kombu message: ``headers.id``, the only key named exactly "id" in the envelope (the body
# is base64, and a quote inside any JSON string is escaped, so ``"id": "`` cannot match string content).
# Ids with escapes (quotes, backslashes, non-ASCII) fall back to a full JSON parse.
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]*)"')

# LRANGE a slice of a queue list and return, per message, "i" + its task id, or "m" + the whole message
# when the id cannot be cut out plainly (then Python parses the JSON). The first element is the list's
# length, so the scan knows when to stop without another round trip. Only the ids cross the network.
_QUEUE_IDS = """
local items = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
local out = {tostring(redis.call('LLEN', KEYS[1]))}
for i, m in ipairs(items) do
  -- The headers follow the (large, base64) body: look near the end first, then everywhere.
  local _, e = string.find(m, '"id": "', math.max(1, #m - 4096), true)
  if not e then _, e = string.find(m, '"id"%s*:%s*"') end
  local id = e and string.match(m, '^([^"\\\\]*)"', e + 1)
  if id then out[i + 1] = 'i' .. id else out[i + 1] = 'm' .. m end
end
return out
"""


def task_id_of(raw: bytes) -> str | None:
    """The task id of a raw kombu message, or of an unacked entry ``[message, exchange, routing_key]``."""
    m = _ID.search(raw)
    if m:
        return m.group(1).decode("ascii", errors="replace")
    try:
        obj = json.loads(raw)
        if isinstance(obj, list):
            obj = obj[0]
        tid = obj["headers"]["id"]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return tid if isinstance(tid, str) else None


def decode_message(raw: bytes) -> PromptTask:
    """The prompt task of a raw kombu message (ValueError/KeyError/TypeError when it is none)."""
    from thinkfleet.message import PromptTask

    envelope = json.loads(raw)
    body = msgpack.unpackb(base64.b64decode(envelope["body"]), raw=False)
    return PromptTask.from_args(body[0])


def task_ids_of(raws: Iterable[bytes]) -> Iterator[str]:
    """The task ids of raw messages (or unacked entries), skipping what is not a task message."""
    for raw in raws:
        tid = task_id_of(raw)
        if tid:
            yield tid


def queue_keys(client: redis.Redis, queue: str) -> list[str]:
    """Every list a message waits on for ``queue``: the workers' host lists that exist (thinkfleet/broker/affinity.py),
    then the queue's list and those of kombu's priority lists next to it that exist, highest first.

    Host lists come first because a sweep moves messages from a host list onto the queue (never back): a reader
    going in this order finds a message moved while it reads (a message also moves from either into a transit list,
    which the readers read before and after)."""
    names = priority_lists(queue)
    with client.pipeline(transaction=False) as p:
        for name in names[1:]:
            p.exists(name)
        present = p.execute()
    return [*host_list_keys(client, queue), queue, *(n for n, there in zip(names[1:], present, strict=True) if there)]


def host_list_keys(client: redis.Redis, queue: str) -> list[str]:
    """Every worker's host lists of ``queue`` that exist (every priority step), sorted."""
    found = client.scan_iter(match=host_glob(queue), count=1000)
    return sorted(k.decode() if isinstance(k, bytes) else str(k) for k in found)


def queue_length(client: redis.Redis, queue: str) -> int:
    """Messages waiting on ``queue``, all priorities and host lists together."""
    return sum(int(client.llen(key)) for key in queue_keys(client, queue))


def list_task_ids(client: redis.Redis, key: str) -> Iterator[str]:
    """Task ids of the messages on list ``key``, head to tail, a chunk per Lua call. Workers pop the tail
    and pushes shift the head while we read: a message is read at least once unless it left."""
    script = client.register_script(_QUEUE_IDS)
    start, length = 0, 1
    while start < length:
        reply = script(keys=[key], args=[start, start + QUEUE_CHUNK - 1])
        length = int(reply[0])
        for item in reply[1:]:
            tid = item[1:].decode("ascii", errors="replace") if item[:1] == b"i" else task_id_of(item[1:])
            if tid:
                yield tid
        start += QUEUE_CHUNK


def unacked_task_ids(client: redis.Redis, prefix: str) -> Iterator[str]:
    """Task ids of the messages delivered to a worker and not yet acknowledged (kombu's ``unacked`` hash)."""
    entries = (raw for _tag, raw in client.hscan_iter(KombuKeys(prefix).unacked, count=UNACKED_CHUNK))
    return task_ids_of(entries)
