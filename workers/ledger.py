"""The worker's Redis bookkeeping: claims, done, dead letters, counters, the reasoning alarm.

Exactly-once, end to end (storage dedupes on read as the last line of defence):
1. ``claim`` — before generating, a prompt is claimed (HASH ``claims``). A prompt already done or
   dead is skipped without calling the server; a claim held by a live worker (its heartbeat key
   exists) makes a redelivered copy wait for that run instead of generating a second row.
2. ``mark_part`` — just before a part is written, each claim records the part's path.
3. ``finalize`` — after the part is committed, the prompts join ``done`` and their claims go.
A worker that dies between 2 and 3 leaves claims naming a part: whoever takes the prompt over finds
the part exists and only finalizes it, so no second row is generated.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis

from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask

_CLAIM = """
-- KEYS: done, dead, claims ; ARGV: prompt_id, worker, claim_json, heartbeat_prefix
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return {'done', ''} end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'dead', ''} end
local cur = redis.call('HGET', KEYS[3], ARGV[1])
if cur then
  local owner = cjson.decode(cur)['worker']
  if owner == ARGV[2] then return {'mine', cur} end
  if redis.call('EXISTS', ARGV[4] .. owner) == 1 then return {'busy', cur} end
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
  return {'stale', cur}
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return {'new', ''}
"""

_FINALIZE = """
-- KEYS: done, claims, counters, dataset_counters, worker_counters, timeline
-- ARGV: worker, now, alarm_min_rows, alarm_missing_share, then per row: prompt_id, tokens, think_end, truncated
local new_rows, tokens, think, trunc = 0, 0, 0, 0
local flags = {}
for i = 5, #ARGV, 4 do
  local pid = ARGV[i]
  redis.call('HDEL', KEYS[2], pid)
  if redis.call('SADD', KEYS[1], pid) == 1 then
    new_rows = new_rows + 1
    tokens = tokens + tonumber(ARGV[i + 1])
    think = think + tonumber(ARGV[i + 2])
    trunc = trunc + tonumber(ARGV[i + 3])
    flags[#flags + 1] = ARGV[i + 2]
  end
end
if new_rows == 0 then return {0, 0, 0, 0} end
redis.call('HINCRBY', KEYS[3], 'done', new_rows)
redis.call('HINCRBY', KEYS[3], 'output_tokens', tokens)
redis.call('HINCRBY', KEYS[3], 'think_end', think)
redis.call('HINCRBY', KEYS[3], 'missing_think_end', new_rows - think)
redis.call('HINCRBY', KEYS[3], 'truncated', trunc)
redis.call('HINCRBY', KEYS[4], 'done', new_rows)
redis.call('HINCRBY', KEYS[4], 'output_tokens', tokens)
redis.call('HINCRBY', KEYS[5], ARGV[1], tokens)
redis.call('ZADD', KEYS[6], ARGV[2], ARGV[2] .. ':' .. new_rows .. ':' .. tokens)
-- The reasoning alarm watches the job's first alarm_min_rows rows, then the running share.
local minrows = tonumber(ARGV[3])
local seen = tonumber(redis.call('HGET', KEYS[3], 'alarm_rows') or '0')
local miss = tonumber(redis.call('HGET', KEYS[3], 'alarm_missing') or '0')
for _, f in ipairs(flags) do
  if seen >= minrows then break end
  seen = seen + 1
  if f == '0' then miss = miss + 1 end
end
redis.call('HSET', KEYS[3], 'alarm_rows', seen, 'alarm_missing', miss)
local rows = tonumber(redis.call('HGET', KEYS[3], 'done'))
local missing_all = tonumber(redis.call('HGET', KEYS[3], 'missing_think_end'))
local share = tonumber(ARGV[4])
local fire = 0
if (seen >= minrows and miss >= share * minrows) or (rows >= minrows and missing_all >= share * rows) then
  fire = 1
end
return {new_rows, fire, seen, miss}
"""


_ABANDON = """
-- KEYS: claims ; ARGV: prompt_id, the claim as read, the claim with no owner
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Claim:
    state: str  # new | mine | busy | stale | done | dead
    previous: dict[str, Any] | None


@dataclass(frozen=True)
class FinalRow:
    prompt_id: str
    completion_tokens: int
    has_think_end: bool
    truncated: bool


class Ledger:
    def __init__(self, client: aioredis.Redis, keys: Keys, worker: str) -> None:
        self.r = client
        self.keys = keys
        self.worker = worker
        self._claim = client.register_script(_CLAIM)
        self._finalize = client.register_script(_FINALIZE)
        self._abandon = client.register_script(_ABANDON)

    def _claim_json(self, part: str | None = None) -> str:
        return json.dumps({"worker": self.worker, "part": part, "at": time.time()})

    async def claim(self, job: str, prompt_id: str) -> Claim:
        k = self.keys
        state, previous = await self._claim(
            keys=[k.done(job), k.dead(job), k.claims(job)],
            args=[prompt_id, self.worker, self._claim_json(), k.heartbeat("")],
        )
        state = state.decode() if isinstance(state, bytes) else state
        prev = json.loads(previous) if previous else None
        return Claim(state, prev)

    async def abandon_claims(self) -> int:
        """At start: claims under our name are a previous life's (same --name, or same hostname-pid in a
        restarted container). Our fresh heartbeat would make them look alive to other workers, whose
        redelivered copies would wait on them forever, so they lose their owner (and keep their part:
        whoever claims next still finds a committed part and only finalizes it). Returns how many."""
        abandoned = 0
        for raw_job in await self.r.smembers(self.keys.jobs):
            job = raw_job.decode() if isinstance(raw_job, bytes) else raw_job
            async for prompt_id, raw in self.r.hscan_iter(self.keys.claims(job)):
                claim = json.loads(raw)
                if claim.get("worker") == self.worker:
                    orphan = json.dumps({**claim, "worker": ""})
                    abandoned += int(await self._abandon(keys=[self.keys.claims(job)], args=[prompt_id, raw, orphan]))
        return abandoned

    async def resolved(self, job: str, prompt_id: str) -> str | None:
        """'done' / 'dead' once the prompt is finished by anyone, else None."""
        async with self.r.pipeline(transaction=False) as p:
            p.sismember(self.keys.done(job), prompt_id)
            p.hexists(self.keys.dead(job), prompt_id)
            done, dead = await p.execute()
        return "done" if done else "dead" if dead else None

    async def claim_owner(self, job: str, prompt_id: str) -> str | None:
        raw = await self.r.hget(self.keys.claims(job), prompt_id)
        return json.loads(raw)["worker"] if raw else None

    async def mark_part(self, job: str, prompt_ids: list[str], part: str) -> None:
        value = self._claim_json(part)
        await self.r.hset(self.keys.claims(job), mapping=dict.fromkeys(prompt_ids, value))

    async def finalize(
        self, job: str, dataset: str, rows: list[FinalRow], alarm_min_rows: int, alarm_share: float
    ) -> tuple[int, bool, int, int]:
        """Mark rows done; returns (new rows, alarm condition, alarm window rows, of them missing)."""
        k = self.keys
        args: list[Any] = [self.worker, f"{time.time():.6f}", alarm_min_rows, alarm_share]
        for row in rows:
            args += [row.prompt_id, row.completion_tokens, int(row.has_think_end), int(row.truncated)]
        new, fire, seen, miss = await self._finalize(
            keys=[
                k.done(job),
                k.claims(job),
                k.counters(job),
                k.dataset_counters(job, dataset),
                k.worker_counters(job),
                k.timeline(job),
            ],
            args=args,
        )
        return int(new), bool(fire), int(seen), int(miss)

    async def raise_alarm(self, job: str, evidence: dict[str, Any]) -> bool:
        """Set the job's alarm once; True if this call set it."""
        return bool(await self.r.set(self.keys.alarm(job), json.dumps(evidence), nx=True))

    async def dead_letter(self, task: PromptTask, error_class: str, message: str, attempts: int) -> None:
        """Record a permanent failure; the record keeps the whole message so `producer retry` can resend it."""
        job, dataset, prompt_id = task.job, task.dataset, task.prompt_id
        record = json.dumps(
            {
                "error_class": error_class,
                "message": message[:2000],
                "attempts": attempts,
                "worker": self.worker,
                "at": time.time(),
                "dataset": dataset,
                "task": base64.b64encode(msgpack.packb(task.to_args())).decode(),
            }
        )
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.keys.dead(job), prompt_id, record)
            p.hdel(self.keys.claims(job), prompt_id)
            p.hincrby(self.keys.counters(job), "dead", 1)
            p.hincrby(self.keys.dataset_counters(job, dataset), "dead", 1)
            await p.execute()

    async def release(self, job: str, prompt_id: str) -> None:
        """Drop our claim (hand-back): the next delivery may claim it at once."""
        raw = await self.r.hget(self.keys.claims(job), prompt_id)
        if raw and json.loads(raw).get("worker") == self.worker:
            await self.r.hdel(self.keys.claims(job), prompt_id)

    async def count(self, job: str, field: str, amount: int = 1) -> None:
        await self.r.hincrby(self.keys.counters(job), field, amount)
