"""The live invariant's count, in constant memory: how many submitted prompts are in no place, and a few of them.

:func:`thinkfleet.state.invariant.account` answers *where* every prompt is, as Python sets — the job's size in the
caller's memory, which ``status --deep`` needs for its per-dataset table. ``producer wait`` and ``status --watch``
need only the number of prompts in no place (and a few names), so their periodic check keeps the places in Redis:
Lua scripts read the queue lists, the parked list, kombu's unacked hash and the transit lists a slice at a time
and add the job's prompt ids they find to a scratch SET (``Keys.check_seen``, with a TTL), live claims are added
from the claims hash, then the prompts hash is walked a slice at a time: a prompt neither done, dead nor seen is
unaccounted. The caller holds one slice, never the job; Redis holds the scratch set for the length of the check.

The read order is the live invariant's (transit, unacked, queue, transit, unacked, claims, then done/dead), and a
prompt found in no place is looked for by a second pass that adds to the same set: one unaccounted after both is
reported — as :func:`~thinkfleet.state.invariant.account` does with its recheck.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

import redis

from thinkfleet.broker.keys import KombuKeys
from thinkfleet.broker.queues import QUEUE_CHUNK, UNACKED_CHUNK, queue_keys, task_id_of
from thinkfleet.settings import Settings
from thinkfleet.state.invariant import broker_client, live_claims, prompt_of_task_id

#: The scratch set outlives a check that died by this long.
SEEN_TTL_S = 600
#: Prompt ids per HSCAN slice of the final count.
PROMPT_CHUNK = 1000
#: Unaccounted prompt ids named (the count is always complete).
NAMED = 20

# The job's prompt id of one raw message (or unacked entry): its task id cut out as queues.py's scan does, then
# "job/prompt/rN" → "prompt". Returns the id, false for another job's message, or nil when the id cannot be cut
# out plainly (the caller parses that message in Python).
_PROMPT_OF = """
local function prompt_of(m, prefix)
  local _, e = string.find(m, '"id": "', math.max(1, #m - 4096), true)
  if not e then _, e = string.find(m, '"id"%s*:%s*"') end
  local id = e and string.match(m, '^([^"\\\\]*)"', e + 1)
  if not id then return nil end
  if string.sub(id, 1, #prefix) ~= prefix then return false end
  local pid = string.match(string.sub(id, #prefix + 1), '^(.*)/r%d+$')
  return pid or false
end
"""

# KEYS: a list, the seen set ; ARGV: start, count, "job/", ttl. Adds the job's prompt ids of the slice to seen;
# returns {list length, unparsed message, ...}.
_LIST_SLICE = (
    _PROMPT_OF
    + """
local items = redis.call('LRANGE', KEYS[1], ARGV[1], tonumber(ARGV[1]) + tonumber(ARGV[2]) - 1)
local out = {redis.call('LLEN', KEYS[1])}
for _, m in ipairs(items) do
  local pid = prompt_of(m, ARGV[3])
  if pid then redis.call('SADD', KEYS[2], pid) elseif pid == nil then out[#out + 1] = m end
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return out
"""
)

# KEYS: kombu's unacked hash, the seen set ; ARGV: cursor, count, "job/", ttl. One HSCAN slice of the unacked
# hash; returns {next cursor, unparsed entry, ...}.
_UNACKED_SLICE = (
    _PROMPT_OF
    + """
local r = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out = {r[1]}
for i = 2, #r[2], 2 do
  local pid = prompt_of(r[2][i], ARGV[3])
  if pid then redis.call('SADD', KEYS[2], pid) elseif pid == nil then out[#out + 1] = r[2][i] end
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return out
"""
)

# KEYS: prompts hash, done set, dead hash, seen set ; ARGV: cursor, count, names wanted. One HSCAN slice of the
# submitted prompts: returns {next cursor, unaccounted in the slice, up to ARGV[3] of their ids...}.
_COUNT_SLICE = """
local r = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out, n, want = {r[1], 0}, 0, tonumber(ARGV[3])
for i = 1, #r[2], 2 do
  local pid = r[2][i]
  if redis.call('SISMEMBER', KEYS[2], pid) == 0 and redis.call('HEXISTS', KEYS[3], pid) == 0
     and redis.call('SISMEMBER', KEYS[4], pid) == 0 then
    n = n + 1
    if #out - 2 < want then out[#out + 1] = pid end
  end
end
out[2] = n
return out
"""


@dataclass
class PlaceCheck:
    """How many submitted prompts of ``job`` are in no place (``unaccounted``) and the first :data:`NAMED`."""

    job: str
    unaccounted: int = 0
    unaccounted_ids: list[str] = field(default_factory=list)
    passes: int = 1
    took_s: float = 0.0


def check_places(client: redis.Redis, settings: Settings, job: str) -> PlaceCheck | None:
    """The live invariant's count for ``job`` in constant memory (module docstring); None where it cannot run
    here: the broker is not a Redis, or another Redis than the job state's (the scripts need both in one)."""
    try:
        broker = broker_client(client, settings)
    except Exception:
        return None
    if broker is not client:
        broker.close()
        return None
    started = time.monotonic()
    seen = settings.keys.check_seen(job, uuid.uuid4().hex[:12])
    scripts = _Scripts(client)
    try:
        _one_pass(client, scripts, settings, job, seen)
        found = _count(client, scripts, settings, job, seen)
        if found.unaccounted:
            _one_pass(client, scripts, settings, job, seen)  # moved between two reads? look again
            found = _count(client, scripts, settings, job, seen)
            found.passes = 2
    finally:
        client.delete(seen)
    found.took_s = round(time.monotonic() - started, 3)
    return found


class _Scripts:
    def __init__(self, client: redis.Redis) -> None:
        self.list_slice = client.register_script(_LIST_SLICE)
        self.unacked_slice = client.register_script(_UNACKED_SLICE)
        self.count_slice = client.register_script(_COUNT_SLICE)


def _one_pass(client: redis.Redis, scripts: _Scripts, settings: Settings, job: str, seen: str) -> None:
    prefix = job + "/"
    transit = _transit_keys(client, settings)
    for key in transit:
        _add_list(client, scripts, key, seen, prefix, job)
    _add_unacked(client, scripts, settings, seen, prefix, job)
    for key in [*queue_keys(client, settings.queue), settings.keys.parked(job)]:
        _add_list(client, scripts, key, seen, prefix, job)
    for key in _transit_keys(client, settings):
        _add_list(client, scripts, key, seen, prefix, job)
    _add_unacked(client, scripts, settings, seen, prefix, job)
    claimed = sorted(live_claims(client, settings, job))  # as many as the fleet has in flight
    for start in range(0, len(claimed), PROMPT_CHUNK):
        client.sadd(seen, *claimed[start : start + PROMPT_CHUNK])
    client.expire(seen, SEEN_TTL_S)


def _add_parsed(client: redis.Redis, seen: str, job: str, raws: list[bytes]) -> None:
    """Messages whose id the script could not cut out plainly: parsed here (rare)."""
    pids = []
    for raw in raws:
        tid = task_id_of(raw)
        pid = prompt_of_task_id(job, tid) if tid else None
        if pid is not None:
            pids.append(pid)
    if pids:
        client.sadd(seen, *pids)


def _add_list(client: redis.Redis, scripts: _Scripts, key: str, seen: str, prefix: str, job: str) -> None:
    start, length = 0, 1
    while start < length:
        reply = scripts.list_slice(keys=[key, seen], args=[start, QUEUE_CHUNK, prefix, SEEN_TTL_S])
        length = int(reply[0])
        _add_parsed(client, seen, job, reply[1:])
        start += QUEUE_CHUNK


def _add_unacked(client: redis.Redis, scripts: _Scripts, settings: Settings, seen: str, prefix: str, job: str) -> None:
    cursor: bytes | int = 0
    key = KombuKeys(settings.key_prefix).unacked
    while True:
        reply = scripts.unacked_slice(keys=[key, seen], args=[cursor, UNACKED_CHUNK, prefix, SEEN_TTL_S])
        cursor = reply[0]
        _add_parsed(client, seen, job, reply[1:])
        if int(cursor) == 0:
            return


def _count(client: redis.Redis, scripts: _Scripts, settings: Settings, job: str, seen: str) -> PlaceCheck:
    keys = settings.keys
    found = PlaceCheck(job)
    cursor: bytes | int = 0
    while True:
        want = max(0, NAMED - len(found.unaccounted_ids))
        reply = scripts.count_slice(
            keys=[keys.prompts(job), keys.done(job), keys.dead(job), seen], args=[cursor, PROMPT_CHUNK, want]
        )
        cursor, n = reply[0], int(reply[1])
        found.unaccounted += n
        found.unaccounted_ids += [p.decode() for p in reply[2:]]
        if int(cursor) == 0:
            found.unaccounted_ids.sort()
            return found


def _transit_keys(client: redis.Redis, settings: Settings) -> list[bytes]:
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", settings.keys.transit("")) + "*"
    return list(client.scan_iter(match=pattern, count=1000))
