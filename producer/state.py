"""What Redis and storage already hold for a job, the submit lock, and the one MULTI that records a submit.

A re-submit must enqueue only what is missing: prompts queued or running (their messages are on the
queue or in kombu's unacked hash), stored (storage is the truth; Redis' done set is its cache) or
dead-lettered (``producer retry`` re-sends those) are left alone.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.chains import ChainReplay
from producer.enqueue import Stager
from thinkfleet.settings import Settings
from thinkfleet.signing import signer_for
from thinkfleet.state.invariant import queued_prompt_ids, transit_prompt_ids, unacked_prompt_ids
from thinkfleet.state.job import JobRecord
from thinkfleet.state.scripts import lua

#: The submit lock expires after this long if a submit dies holding it.
LOCK_TTL_S = 3600
#: ``submit --break-lock`` breaks a lock held by another host (or an unknown holder) only once it is this old.
BREAK_LOCK_MIN_AGE_S = 60
#: Fields per HSET/SADD command inside the commit's MULTI.
CHUNK = 5000
#: Take prompts out of ``done`` (thinkfleet/state/lua/requeue.lua).
_REQUEUE = lua("requeue")
#: Return stored prompts to ``done``, counted (thinkfleet/state/lua/refill_done.lua).
_REFILL = lua("refill_done")


class StateError(Exception):
    """Redis is unreachable or another submit holds the job."""


@dataclass
class Existing:
    """A job's state before this submit."""

    record: JobRecord | None = None
    hashes: dict[str, str] = field(default_factory=dict)  # prompt_id → content hash
    datasets: dict[str, str] = field(default_factory=dict)  # prompt_id → dataset
    stored: set[str] = field(default_factory=set)  # in storage
    done: set[str] = field(default_factory=set)  # Redis' done set
    dead: set[str] = field(default_factory=set)
    queued: set[str] = field(default_factory=set)  # on the queue or delivered and unacknowledged
    #: prompts with a message of an earlier job generation only (workers skip those): enqueued again
    stale: set[str] = field(default_factory=set)
    #: prompts a quarantined (damaged) part held (storage/quarantine.py)
    quarantined: set[str] = field(default_factory=set)

    @property
    def lost(self) -> set[str]:
        """Done in Redis, but their row was in a part found damaged and none is stored: Redis' done set, a cache
        of storage, is wrong about them — enqueued again (and taken out of done in the same MULTI)."""
        return (self.done & self.quarantined) - self.stored - self.queued - self.dead

    @property
    def finished(self) -> set[str]:
        return (self.done - self.lost) | self.stored


def load_existing(client: redis.Redis, settings: Settings, job: str, redis_required: bool = True) -> Existing:
    keys = settings.keys
    try:
        existing = Existing(record=JobRecord.load(client, keys, job))
        existing.hashes = _str_map(client.hgetall(keys.prompts(job)))
        existing.datasets = _str_map(client.hgetall(keys.prompt_dataset(job)))
        # Workers keep moving messages while we look: queue → unacked → done (finalize before ack), and the
        # reaper moves unacked → queue. Reading unacked before and after the queue, and done/dead last,
        # sees every message in at least one place.
        # Transit lists (popped by a worker, not yet in unacked) count as running too.
        running = unacked_prompt_ids(client, settings, job) | transit_prompt_ids(client, settings, job)
        queued = queued_prompt_ids(client, settings, job)
        again = unacked_prompt_ids(client, settings, job) | transit_prompt_ids(client, settings, job)
        existing.queued = running | queued | again
        if existing.record is None:
            # No record (a first submit, a purge, or a Redis that lost it): this submit mints a new generation,
            # and workers skip every message of an earlier one (one a worker restored into the new Redis, or
            # a purge missed). Counting them as queued would leave their prompts to no run at all.
            existing.stale, existing.queued = existing.queued, set()
        existing.done = {m.decode() for m in client.smembers(keys.done(job))}
        existing.dead = {k.decode() for k in client.hkeys(keys.dead(job))}
    except redis.RedisError as e:
        if redis_required:
            raise StateError(f"cannot reach Redis at {settings.redis_url}: {e}") from e
        existing = Existing()  # a dry run without Redis: everything counts as new
    existing.stored = stored_prompt_ids(settings, job)  # (a damaged part met here is quarantined first)
    existing.quarantined = quarantined_prompt_ids(settings, job)
    return existing


def _str_map(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def stored_prompt_ids(settings: Settings, job: str) -> set[str]:
    """Prompt ids with a committed row in storage (empty when storage has nothing for the job yet)."""
    try:
        from storage.reader import stored_prompt_ids as read_stored
    except ImportError:  # storage not installed: Redis' done set is all we know
        return set()
    return set(read_stored(settings.output_uri, job, s3_endpoint_url=settings.s3_endpoint_url))


def quarantined_prompt_ids(settings: Settings, job: str) -> set[str]:
    """Prompt ids of the job's quarantined (damaged) parts, where their records know them."""
    try:
        from storage.quarantine import quarantined_prompt_ids as read_quarantined
    except ImportError:
        return set()
    return read_quarantined(settings.output_uri, job, settings.s3_endpoint_url)


def write_manifest(settings: Settings, job: str, rows: Sequence[dict[str, Any]]) -> None:
    """Tell storage what was submitted (``verify`` finds missing prompts against it, even without Redis),
    with each prompt's source ``messages``/``tools`` when the rows carry them (``export --format messages``)."""
    try:
        from storage.manifest import write_submitted
    except ImportError:
        return
    write_submitted(settings.output_uri, job, rows, s3_endpoint_url=settings.s3_endpoint_url)


# -- the submit lock ------------------------------------------------------------------------------------------
_UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class SubmitLock:
    """One submit per job at a time: two at once would both see a prompt as missing and enqueue it twice."""

    def __init__(self, client: redis.Redis, settings: Settings, job: str) -> None:
        self.client = client
        self.key = settings.keys.submit_lock(job)
        self.job = job
        self.redis_url = settings.redis_url
        self.token = f"{uuid.uuid4().hex}@{time.time():.0f}@{socket.gethostname()}@{os.getpid()}"

    def __enter__(self) -> SubmitLock:
        try:
            ok = self.client.set(self.key, self.token, nx=True, ex=LOCK_TTL_S)
        except redis.RedisError as e:
            raise StateError(f"cannot reach Redis at {self.redis_url}: {e}") from e
        if not ok:
            holder = LockHolder.parse(self.client.get(self.key), self.client.ttl(self.key))
            raise StateError(
                f"another submit of job {self.job!r} holds its lock: {holder.describe()}; wait for it, or if it "
                f"died, run `producer submit … --break-lock` (the lock expires after {LOCK_TTL_S} s)"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.eval(_UNLOCK, 1, self.key, self.token)


@dataclass
class LockHolder:
    """Who holds a submit lock, from its token ``uuid@unix_seconds@host@pid`` (older tokens: ``uuid@seconds``).

    Its age is Redis's: ``LOCK_TTL_S`` minus the key's TTL, counted down by Redis itself, so no host's clock
    (the holder's that stamped the token, or ours) decides whether a lock is old enough to break; the token's
    stamp is the fallback for a lock without a TTL."""

    token: str = ""
    since: float | None = None
    host: str = ""
    pid: int | None = None
    #: Seconds since the lock was taken, from its TTL in Redis (None: no TTL known).
    redis_age_s: float | None = None

    @classmethod
    def parse(cls, raw: bytes | str | None, ttl_s: int | None = None) -> LockHolder:
        token = raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")
        parts = token.split("@")
        holder = cls(token=token)
        if ttl_s is not None and ttl_s >= 0:
            holder.redis_age_s = float(max(0, LOCK_TTL_S - ttl_s))
        try:
            holder.since = float(parts[1]) if len(parts) > 1 else None
            holder.pid = int(parts[3]) if len(parts) > 3 else None
        except ValueError:
            pass
        holder.host = parts[2] if len(parts) > 2 else ""
        return holder

    @property
    def age_s(self) -> float | None:
        if self.redis_age_s is not None:
            return self.redis_age_s
        return None if self.since is None else max(0.0, time.time() - self.since)

    def alive_here(self) -> bool | None:
        """Whether the holder's process still runs: known only when it ran on this host."""
        if self.pid is None or self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def describe(self) -> str:
        who = f"pid {self.pid} on {self.host}" if self.host else "an unknown process"
        age = "of unknown age" if self.age_s is None else f"taken {self.age_s:.0f} s ago"
        return f"{who}, {age} (token {self.token!r})"


def break_lock(
    client: redis.Redis, settings: Settings, job: str, min_age_s: float = BREAK_LOCK_MIN_AGE_S
) -> str | None:
    """Break a stale submit lock of ``job``; returns what was broken (None: no lock). Safe cases only:
    the holder ran on this host and its process is gone, or the lock is at least ``min_age_s`` old (a
    holder elsewhere cannot be checked). A younger lock of a live or unknown holder raises StateError."""
    key = settings.keys.submit_lock(job)
    raw = client.get(key)
    if raw is None:
        return None
    holder = LockHolder.parse(raw, client.ttl(key))
    alive = holder.alive_here()
    if alive is True:
        raise StateError(f"the submit lock of job {job!r} is held by a live process: {holder.describe()}")
    if alive is None and (holder.age_s is None or holder.age_s < min_age_s):
        raise StateError(
            f"the submit lock of job {job!r} is held by {holder.describe()}, which cannot be checked from "
            f"here: --break-lock breaks it once it is {min_age_s:.0f} s old; is that submit still running?"
        )
    client.eval(_UNLOCK, 1, key, raw)  # only that holder's lock, not one taken since
    return holder.describe()


# -- the commit -----------------------------------------------------------------------------------------------
#: A submit's staged prompt hashes outlive a crashed submit by this long (as its staged messages do).
STAGING_TTL_S = 24 * 3600
#: Fields per HSET while staging.
STAGE_FIELDS = 2000

# Merge a staged hash into its target inside the commit's MULTI: RENAME when the target does not exist (a first
# submit: O(1)), else HSCAN the staged hash a slice at a time into the target. PERSIST drops the staging TTL.
_MERGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('PERSIST', KEYS[2])
  return 1
end
local cursor = '0'
repeat
  local r = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', 1000)
  cursor = r[1]
  if #r[2] > 0 then redis.call('HSET', KEYS[2], unpack(r[2])) end
until cursor == '0'
redis.call('DEL', KEYS[1])
return 2
"""


class PromptStager:
    """A submit's prompt hashes (prompt_id → content hash, prompt_id → dataset), written to private hashes as
    the prompts are rendered and merged into the job's by :func:`commit` — so a submit holds a chunk of them in
    memory, not the job, and a failed submit leaves nothing in the job's hashes (the staged ones expire)."""

    def __init__(self, client: redis.Redis, settings: Settings, job: str) -> None:
        token = uuid.uuid4().hex[:12]
        self.client = client
        self.prompts_key = settings.keys.staging_prompts(job, token)
        self.datasets_key = settings.keys.staging_datasets(job, token)
        self._hashes: dict[str, str] = {}
        self._datasets: dict[str, str] = {}
        self._merge = client.register_script(_MERGE)

    def add(self, prompt_id: str, content_hash: str, dataset: str) -> None:
        self._hashes[prompt_id] = content_hash
        self._datasets[prompt_id] = dataset
        if len(self._hashes) >= STAGE_FIELDS:
            self.flush()

    def flush(self) -> None:
        if not self._hashes:
            return
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.prompts_key, mapping=self._hashes)
            pipe.hset(self.datasets_key, mapping=self._datasets)
            pipe.expire(self.prompts_key, STAGING_TTL_S)
            pipe.expire(self.datasets_key, STAGING_TTL_S)
            pipe.execute()
        self._hashes, self._datasets = {}, {}

    def commit(self, pipe: redis.client.Pipeline, settings: Settings, job: str) -> None:
        """Queue on ``pipe`` (the commit's MULTI) the merge of the staged hashes into the job's."""
        self.flush()
        self._merge(keys=[self.prompts_key, settings.keys.prompts(job)], client=pipe)
        self._merge(keys=[self.datasets_key, settings.keys.prompt_dataset(job)], client=pipe)

    def discard(self) -> None:
        self._hashes, self._datasets = {}, {}
        self.client.delete(self.prompts_key, self.datasets_key)


def commit(
    client: redis.Redis,
    settings: Settings,
    record: JobRecord,
    prompts: PromptStager,
    existing: Existing,
    stager: Stager,
    revived: list[tuple[str, str]] = (),  # type: ignore[assignment]
    dataset_hint: dict[str, str] | None = None,
    replay: ChainReplay | None = None,
) -> None:
    """One MULTI: prompt hashes (staged), job record, counters, done-cache refill, and the staged messages →
    queue. ``revived``: (prompt_id, dataset) of this submit's prompts that were done but lost with a damaged part;
    ``dataset_hint``: the dataset of stored prompts this submit saw (Redis may have lost their prompt_dataset);
    ``replay``: stored turns of a ``--turns all`` job the workers finalize again (producer/chains.py): never
    refilled into done (their successors would be derived by nothing), their settled claims written here.

    Workers read the job record before their first message of the job, so both land together.
    """
    keys, job = settings.keys, record.name
    with client.pipeline(transaction=True) as pipe:
        prompts.commit(pipe, settings, job)
        # done caches storage: refill it after a Redis loss, the counters following (refill_done.lua). A stored
        # prompt with a message queued (a `retry --truncated` revision) is not done until that revision is stored.
        held = replay.held if replay is not None else set()
        newly_known = sorted(existing.stored - existing.done - existing.queued - existing.dead - held)
        hint = dataset_hint or {}
        for start in range(0, len(newly_known), CHUNK):
            chunk = newly_known[start : start + CHUNK]
            _refill_done(pipe, settings, job, [(p, hint.get(p) or existing.datasets.get(p) or "?") for p in chunk])
        # ... and is wrong about prompts whose row was in a damaged part: this submit enqueues them again.
        revived = sorted(revived)
        for start in range(0, len(revived), CHUNK):
            _take_out_of_done(pipe, settings, job, revived[start : start + CHUNK])
        if replay is not None:
            # A claim a worker took meanwhile is its own: HSETNX leaves it (the replay then goes through it).
            for pid, claim in replay.claims.items():
                pipe.hsetnx(keys.claims(job), pid, claim)
        record.save(pipe, keys, signer_for(settings))  # signed when a key is configured (thinkfleet/signing.py)
        for name, count in record.datasets.items():
            pipe.hset(keys.dataset_counters(job, name), "submitted", count)
        pipe.hset(keys.counters(job), "submitted", record.prompts)
        stager.commit(pipe)
        pipe.execute()


def _refill_done(pipe: redis.client.Pipeline, settings: Settings, job: str, prompts: list[tuple[str, str]]) -> None:
    """Queue on ``pipe`` the return of stored ``prompts`` ((prompt_id, dataset)) to the done set, the job's and
    their datasets' counters following (thinkfleet/state/lua/refill_done.lua)."""
    keys = settings.keys
    datasets = list(dict.fromkeys(d for _, d in prompts))
    index = {name: i + 1 for i, name in enumerate(datasets)}
    args: list[str | int] = []
    for pid, dataset in prompts:
        args += [pid, index[dataset]]
    pipe.eval(
        _REFILL,
        2 + len(datasets),
        keys.done(job),
        keys.counters(job),
        *[keys.dataset_counters(job, name) for name in datasets],
        *args,
    )


def _take_out_of_done(
    pipe: redis.client.Pipeline, settings: Settings, job: str, prompts: list[tuple[str, str]]
) -> None:
    """Queue on ``pipe`` the removal of ``prompts`` ((prompt_id, dataset)) from the done set, their counters
    following (thinkfleet/state/lua/requeue.lua, as ``producer retry`` does)."""
    keys = settings.keys
    datasets = list(dict.fromkeys(d for _, d in prompts))
    index = {name: i + 1 for i, name in enumerate(datasets)}
    args: list[str | int] = ["done"]
    for pid, dataset in prompts:
        args += [pid, index[dataset]]
    pipe.eval(
        _REQUEUE,
        3 + len(datasets),
        keys.done(job),
        keys.counters(job),
        keys.deliveries(job),
        *[keys.dataset_counters(job, name) for name in datasets],
        *args,
    )
