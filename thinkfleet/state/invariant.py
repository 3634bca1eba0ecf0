"""The live invariant of a job: every submitted prompt is stored, dead-lettered, queued or running.

``total = done + dead + queued + running`` must hold at every moment, for every job:

- **done**: in the ``done`` SET (its row is committed to storage);
- **dead**: in the ``dead`` HASH (dead-lettered, waiting for ``producer retry``);
- **queued**: a message of the prompt is on the queue list (or one of kombu's priority lists), or in
  the job's parked list (a paused job, ``thinkfleet/state/lifecycle.py``);
- **running**: a message of the prompt is delivered — in kombu's ``unacked`` hash, or in a worker's
  transit list (popped with ``BLMOVE``, ``thinkfleet/broker/transit.py``) — or a worker whose heartbeat still
  exists holds a claim on it.

A prompt that is in none of these places is **unaccounted**: nothing will ever store it, and until this
check existed ``producer status`` showed it as "queued" forever over an empty queue. Being in several
places at once is fine (a redelivered copy of a stored prompt, a message between transit and unacked);
only *unaccounted* is a violation.

Workers keep moving messages while we read: forward queue → transit → unacked → done (a row is
finalized before its message is acked; transit → unacked records before it removes), and backward
unacked → queue (the reaper, a hand-back; one atomic MULTI each) and transit → queue (the transit
sweeper; one Lua call). One pass reads transit+unacked, then the queue, then transit+unacked again,
then the claims, and done/dead last, so a message moving forward, or back once, is seen somewhere. A
prompt that still looks unaccounted (it moved back *and* forward between two reads) is re-checked by a
second full pass; only a prompt unaccounted in both is reported.

Only a Redis broker can be observed (RabbitMQ holds its queue itself): :func:`account` raises
:class:`NotObservable` for any other broker.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from thinkfleet.broker.queues import list_task_ids, queue_keys, task_ids_of, unacked_task_ids
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings

#: Pause before the re-check pass of prompts found unaccounted by the first one.
RECHECK_DELAY_S = 0.05
#: Brokers whose queue lives in a Redis we can read.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

_REVISION = re.compile(r"/r\d+$")


class NotObservable(Exception):
    """The broker is not a Redis we can read (RabbitMQ): queued and running messages are invisible."""


@dataclass
class Accounting:
    """Where each submitted prompt of ``job`` is. Sets may overlap (a redelivery); ``unaccounted`` may not."""

    job: str
    submitted: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)
    queued: set[str] = field(default_factory=set)  # a message on a queue list
    unacked: set[str] = field(default_factory=set)  # delivered, not acknowledged (kombu's unacked hash)
    transit: set[str] = field(default_factory=set)  # popped into a worker's transit list
    claimed: set[str] = field(default_factory=set)  # claimed by a worker whose heartbeat exists
    unaccounted: set[str] = field(default_factory=set)
    passes: int = 1
    at: float = 0.0

    @property
    def running(self) -> set[str]:
        return self.unacked | self.transit | self.claimed

    @property
    def ok(self) -> bool:
        return not self.unaccounted

    @property
    def duplicated(self) -> set[str]:
        """Finished prompts that still have a message queued or delivered: a redelivery, not a violation."""
        return (self.done | self.dead) & (self.queued | self.unacked | self.transit)

    def state_of(self, prompt_id: str) -> str:
        """One state per prompt, for counting: done > dead > running > queued > unaccounted."""
        if prompt_id in self.done:
            return "done"
        if prompt_id in self.dead:
            return "dead"
        if prompt_id in self.unacked or prompt_id in self.transit or prompt_id in self.claimed:
            return "running"
        if prompt_id in self.queued:
            return "queued"
        return "unaccounted"

    def counts(self) -> dict[str, int]:
        """Disjoint counts over the submitted prompts; they sum to ``total``."""
        out = dict.fromkeys(("done", "dead", "running", "queued", "unaccounted"), 0)
        for pid in self.submitted:
            out[self.state_of(pid)] += 1
        return {"total": len(self.submitted), **out}

    def to_dict(self, limit: int = 20) -> dict[str, Any]:
        return {
            "job": self.job,
            "ok": self.ok,
            **self.counts(),
            "unaccounted_ids": sorted(self.unaccounted)[:limit],
            "duplicated": len(self.duplicated),
            "passes": self.passes,
            "at": self.at,
        }


def observable(settings: Settings) -> bool:
    return str(settings.broker_url or settings.redis_url).startswith(REDIS_SCHEMES)


def broker_client(client: redis.Redis, settings: Settings) -> redis.Redis:
    """The client of the Redis holding the queue: ``client`` unless the broker is another Redis."""
    if not observable(settings):
        raise NotObservable(f"broker {_scheme(settings.broker_url)}: its queue is not in Redis")
    if not settings.broker_url or settings.broker_url == settings.redis_url:
        return client
    return sync_client(settings.broker_url)


def account(
    client: redis.Redis,
    settings: Settings,
    job: str,
    submitted: set[str] | None = None,
    recheck: bool = True,
    broker: redis.Redis | None = None,
) -> Accounting:
    """Where every submitted prompt of ``job`` is right now (see the module docstring for the read order).

    ``submitted`` (default: the job's ``prompts`` hash) is the universe checked. With ``recheck`` a
    prompt unaccounted by the first pass is looked for again by a second one, and reported only if that
    one does not find it either. Raises :class:`NotObservable` for a non-Redis broker, and redis errors.
    """
    broker = broker or broker_client(client, settings)
    first = _one_pass(client, broker, settings, job, submitted)
    if not (recheck and first.unaccounted):
        return first
    _pause()
    second = _one_pass(client, broker, settings, job, submitted)
    # Seen by the first pass, in motion at the second: keep its first place so the counts add up.
    moving = second.unaccounted - first.unaccounted
    for name in ("done", "dead", "queued", "unacked", "transit", "claimed"):
        getattr(second, name).update(getattr(first, name) & moving)
    second.unaccounted &= first.unaccounted
    second.passes = 2
    return second


def _pause() -> None:
    time.sleep(RECHECK_DELAY_S)


def _one_pass(
    client: redis.Redis, broker: redis.Redis, settings: Settings, job: str, submitted: set[str] | None
) -> Accounting:
    keys = settings.keys
    acc = Accounting(job=job, at=time.time())
    if submitted is None:
        submitted = {k.decode() for k in client.hkeys(keys.prompts(job))}
    acc.submitted = set(submitted)
    transit_1 = transit_prompt_ids(broker, settings, job)
    unacked_1 = unacked_prompt_ids(broker, settings, job)
    acc.queued = queued_prompt_ids(broker, settings, job)
    acc.transit = transit_1 | transit_prompt_ids(broker, settings, job)
    acc.unacked = unacked_1 | unacked_prompt_ids(broker, settings, job)
    acc.claimed = live_claims(client, settings, job)
    with client.pipeline(transaction=False) as p:
        p.smembers(keys.done(job))
        p.hkeys(keys.dead(job))
        done, dead = p.execute()
    acc.done = {m.decode() for m in done}
    acc.dead = {k.decode() for k in dead}
    for name in ("done", "dead", "queued", "unacked", "transit", "claimed"):
        getattr(acc, name).intersection_update(acc.submitted)
    acc.unaccounted = acc.submitted - acc.done - acc.dead - acc.queued - acc.running
    return acc


# -- the places -------------------------------------------------------------------------------------------
def prompt_of_task_id(job: str, task_id: str) -> str | None:
    """``job/prompt/r3`` → ``prompt`` (None for another job's task)."""
    if not task_id.startswith(job + "/"):
        return None
    m = _REVISION.search(task_id)
    return task_id[len(job) + 1 : m.start()] if m else None


def _prompts_of(job: str, task_ids: Iterable[str]) -> set[str]:
    found = set()
    prefix = job + "/"
    for tid in task_ids:
        pid = prompt_of_task_id(job, tid) if tid.startswith(prefix) else None
        if pid is not None:
            found.add(pid)
    return found


def queued_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` with a message on the queue (any priority list) or in its parked list."""
    # A paused job's messages wait in its parked list (thinkfleet/state/lifecycle.py): queued too.
    found: set[str] = set()
    for key in [*queue_keys(client, settings.queue), settings.keys.parked(job)]:
        found |= _prompts_of(job, list_task_ids(client, key))
    return found


def unacked_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` delivered and not yet acknowledged (kombu's unacked hash)."""
    return _prompts_of(job, unacked_task_ids(client, settings.key_prefix))


def transit_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` in any worker's transit list (popped, not yet recorded as unacked). A dead
    worker's list counts too: its messages are in Redis, and live workers' sweeps return them."""
    found: set[str] = set()
    for key in client.scan_iter(match=_glob_escape(settings.keys.transit("")) + "*", count=1000):
        found |= _prompts_of(job, task_ids_of(client.lrange(key, 0, -1)))
    return found


def live_claims(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` claimed by a worker whose heartbeat key exists."""
    keys = settings.keys
    owners: dict[str, set[str]] = {}
    for pid, raw in client.hscan_iter(keys.claims(job), count=1000):
        try:
            worker = json.loads(raw).get("worker")
        except (ValueError, AttributeError):
            continue
        if worker:
            owners.setdefault(worker, set()).add(pid.decode())
    if not owners:
        return set()
    names = sorted(owners)
    with client.pipeline(transaction=False) as p:
        for name in names:
            p.exists(keys.heartbeat(name))
        alive = p.execute()
    return set().union(*(owners[n] for n, a in zip(names, alive, strict=True) if a))


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _scheme(url: str | None) -> str:
    return (url or "").split("://", 1)[0] + "://"
