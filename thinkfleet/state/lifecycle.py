"""A job's lifecycle: active → paused ⇄ active, → cancelled; and purge (every Redis key of the job).

The state is one STRING, ``Keys.job_state(job)``: ``paused`` or ``cancelled``; absent means active
("finished" is derived: active with every prompt done or dead). Workers read it before each prompt
(``workers/runtime.py``). Every move keeps the closed set of outcomes and the live invariant:

- **pause** sets the state, then moves the job's queued messages, a slice per Lua call
  (``lua/park.lua``), from the queue and kombu's priority lists into ``Keys.parked(job)``, which the
  invariant counts as queued. A message a worker pops meanwhile (or a redelivery later) is parked by
  that worker (``lua/park_one.lua``: only while the state still says paused) and acked. In-flight
  generations finish.
- **resume** clears the state, then moves the parked list back behind the queue (``lua/unpark.lua``),
  onto the list of the job's priority, so a resumed job keeps its priority.
  A worker's park after the state changed is refused atomically, so nothing is stranded.
  ``resume`` of a cancelled job makes it active again (then ``producer retry JOB --error-class
  cancelled`` revives its cancelled prompts).
- **cancel** sets the state, parks the queued messages, then dead-letters each parked message as
  ``cancelled`` (the whole message kept) in the same Lua call that removes it from the parked list
  (``lua/cancel.lua``): a dead worker's claim on it goes (kept, ownerless, when it names a part that may have
  committed); a message whose prompt a live worker runs stays parked (that run ends it). Workers dead-letter
  what they pop afterwards, and abort their in-flight requests of the job.
- **purge** deletes every key of the job and its name from ``Keys.jobs``; storage is untouched.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import redis

from thinkfleet.broker.keys import priority_lists, priority_step
from thinkfleet.broker.queues import decode_message, queue_keys
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.state.scripts import lua

if TYPE_CHECKING:  # a hint only: the message module loads numpy (producer jobs/status need none)
    from thinkfleet.message import PromptTask

ACTIVE, PAUSED, CANCELLED, FINISHED = "active", "paused", "cancelled", "finished"
#: Messages per Lua call when moving a job's messages (each call blocks Redis while it runs).
CHUNK = 200
#: The dead-letter error class of a cancelled prompt.
CANCELLED_CLASS = "cancelled"


class LifecycleError(Exception):
    """Unknown job, or an operation its state refuses."""


def get_state(client: redis.Redis, settings: Settings, job: str) -> str:
    """``paused``, ``cancelled`` or ``active`` (stored state only; see :func:`job_summary` for finished)."""
    raw = client.get(settings.keys.job_state(job))
    return raw.decode() if raw else ACTIVE


def queue_lists(client: redis.Redis, settings: Settings) -> list[str]:
    return queue_keys(client, settings.queue)


def move(client: redis.Redis, settings: Settings, job: str, to: str, leaves: tuple[str, ...]) -> str:
    """Set ``job``'s state to ``to`` (``active``: the state key deleted) if it is in one of ``leaves`` now, checked
    and set in one Lua call (``lua/set_state.lua``); returns the state it left. Raises :class:`LifecycleError` for
    an unknown job or a state the move may not leave."""
    keys = settings.keys
    script = client.register_script(lua("set_state"))
    outcome, previous = script(keys=[keys.job_state(job), keys.job(job), keys.jobs], args=[job, to, *leaves])
    outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
    previous = previous.decode() if isinstance(previous, bytes) else str(previous)
    if outcome == "unknown":
        raise LifecycleError(f"no job {job!r} in Redis ({settings.redis_url})")
    if outcome == "refused":
        fix = "resume it first" if previous == CANCELLED else f"it is {previous}"
        raise LifecycleError(f"job {job!r} is {previous}: {fix}")
    return previous


def park_queued(client: redis.Redis, settings: Settings, job: str) -> int:
    """Move every queued message of ``job`` into its parked list; returns how many moved."""
    script = client.register_script(lua("park"))
    parked = settings.keys.parked(job)
    moved = 0
    for key in queue_lists(client, settings):
        start, length = 0, 1
        while start < length:
            nxt, length, n = script(keys=[key, parked], args=[start, CHUNK, job + "/"])
            start, moved = int(nxt), moved + int(n)
            length = int(length)
    return moved


def unpark(client: redis.Redis, settings: Settings, job: str, queue: str | None = None) -> int:
    """Move the parked messages back onto ``queue`` (default: the queue); returns how many moved.

    They go onto the list of the job's priority (0 is ``queue`` itself), each saying it in
    ``properties.priority`` (a copy a worker parked says 0: it is rewritten); without a job record, onto
    the list of the priority each message says.
    """
    script = client.register_script(lua("unpark"))
    parked = settings.keys.parked(job)
    record = JobRecord.load(client, settings.keys, job)
    priority = str(priority_step(record.priority)) if record is not None else ""
    before = int(client.llen(parked))
    keys = [parked, parked + ":rewrite", *priority_lists(queue or settings.queue)]
    while int(script(keys=keys, args=[CHUNK, priority])) > 0:
        pass
    return before


def pause(client: redis.Redis, settings: Settings, job: str) -> int:
    """Pause ``job``: workers take none of its prompts until :func:`resume`. Returns messages parked."""
    move(client, settings, job, PAUSED, (ACTIVE, PAUSED))  # never over a cancel: resume first
    return park_queued(client, settings, job)


def resume(client: redis.Redis, settings: Settings, job: str) -> int:
    """Make ``job`` active again; returns the messages moved back onto the queue."""
    move(client, settings, job, ACTIVE, (ACTIVE, PAUSED, CANCELLED))
    return unpark(client, settings, job)


def dead_record(task: PromptTask, error_class: str, message: str, worker: str) -> str:
    """The dead-letter record ``Ledger.dead_letter`` writes (the whole message, for ``producer retry``)."""
    return json.dumps(
        {
            "error_class": error_class,
            "message": message[:2000],
            "attempts": 0,
            "worker": worker,
            "at": time.time(),
            "dataset": task.dataset,
            "task": base64.b64encode(msgpack.packb(task.to_args())).decode(),
        }
    )


@dataclass(frozen=True)
class CancelResult:
    """What one :func:`cancel_parked` pass did with the job's parked messages (``lua/cancel.lua``)."""

    dead: int = 0  # dead-lettered ``cancelled`` now
    finished: int = 0  # copies of prompts already done or dead: removed
    live: int = 0  # a live worker runs the prompt: kept parked (that run ends it)
    superseded: int = 0  # a leftover copy of a lower revision than `producer retry` asked for: removed
    malformed: int = 0  # not a prompt task: moved to the fleet-wide malformed list


def cancel(client: redis.Redis, settings: Settings, job: str, who: str = "producer cancel") -> int:
    """Cancel ``job``: its queued and parked prompts dead-lettered ``cancelled``; workers abort its
    in-flight requests (they watch the state). Stored rows stay. Returns how many were dead-lettered now."""
    return cancel_detail(client, settings, job, who).dead


def cancel_detail(client: redis.Redis, settings: Settings, job: str, who: str = "producer cancel") -> CancelResult:
    """:func:`cancel`, saying also what stayed parked (a live worker's run) and what was a copy of a finished prompt."""
    move(client, settings, job, CANCELLED, (ACTIVE, PAUSED, CANCELLED))
    park_queued(client, settings, job)
    return cancel_parked(client, settings, job, who)


def cancel_parked(client: redis.Redis, settings: Settings, job: str, who: str = "producer cancel") -> CancelResult:
    """Dead-letter the parked messages of a cancelled ``job`` (``lua/cancel.lua``, a slice per call): each leaves
    the parked list only as its prompt's dead letter or as a copy of a finished prompt; a message whose prompt a
    live worker runs stays parked. Only prompts dead-lettered here are counted as ``dead``."""
    keys = settings.keys
    script = client.register_script(lua("cancel"))
    parked = keys.parked(job)
    totals = {"dead": 0, "finished": 0, "live": 0, "malformed": 0, "superseded": 0}
    start = 0  # messages kept parked (live runs) stay at the head: the next slice starts after them
    while True:
        raws = client.lrange(parked, start, start + CHUNK - 1)
        if not raws:
            return CancelResult(**totals)
        args: list[Any] = [keys.heartbeat("")]
        datasets: dict[str, int] = {}
        for raw in raws:
            try:
                task = decode_message(raw)
            except Exception as exc:  # not a prompt task: keep it where nothing is lost
                record = {"message_id": None, "error": f"{type(exc).__name__}: {exc}", "at": time.time()}
                record["args"] = repr(raw)[:4000]
                with client.pipeline(transaction=True) as pipe:
                    pipe.lrem(parked, 1, raw)
                    pipe.lpush(keys.malformed, json.dumps(record))
                    removed, _ = pipe.execute()
                totals["malformed"] += int(removed)
                continue
            index = datasets.setdefault(task.dataset, len(datasets) + 1)
            record = dead_record(task, CANCELLED_CLASS, f"job cancelled by {who}", who)
            args += [raw, task.prompt_id, record, index, int(task.revision)]
        if len(args) > 1:
            base = [parked, keys.dead(job), keys.claims(job), keys.counters(job), keys.deliveries(job), keys.done(job)]
            base.append(keys.revisions(job))
            states = script(keys=base + [keys.dataset_counters(job, d) for d in datasets], args=args)
            for state in states:
                name = state.decode() if isinstance(state, bytes) else str(state)
                if name in totals:
                    totals[name] += 1
                if name == "live":
                    start += 1


def job_keys(client: redis.Redis, settings: Settings, job: str) -> list[str]:
    """Every Redis key of ``job`` (its record and every ``{prefix}:job:{job}:…`` key)."""
    found = [settings.keys.job(job)] if client.exists(settings.keys.job(job)) else []
    pattern = _glob_escape(settings.keys.job(job)) + ":*"
    found += [k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(match=pattern, count=1000)]
    return found


def purge(client: redis.Redis, settings: Settings, job: str) -> int:
    """Delete every key of ``job`` and its name from the job set (but its submit lock: the caller holds it, so no
    submit or retry runs meanwhile); returns how many keys went. Storage is untouched.

    The record, the name and every fixed-name key go first, in one Lua call (``lua/purge.lua``): from then on
    every worker script refuses the job's stragglers, so the rest — queued copies (parked, then deleted) and the
    keys found by SCAN — cannot be made again behind the sweep (a SCAN then a delete, alone, left a window for
    keys written between the two)."""
    keys = settings.keys
    fixed = keys.job_fixed(job)
    gone = int(client.register_script(lua("purge"))(keys=[keys.jobs, *fixed], args=[job]))
    park_queued(client, settings, job)  # stray copies of finished prompts on the queue: parked, then swept
    lock = keys.submit_lock(job)
    names = [n for n in job_keys(client, settings, job) if n != lock]
    for start in range(0, len(names), 500):
        gone += int(client.delete(*names[start : start + 500]))
    return gone


@dataclass
class JobSummary:
    job: str
    state: str
    total: int
    done: int
    dead: int
    priority: int
    created_at: float
    age_s: float | None
    parked: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def job_summary(client: redis.Redis, settings: Settings, job: str, now: float | None = None) -> JobSummary:
    from thinkfleet.state.job import JobRecord

    keys = settings.keys
    record = JobRecord.load(client, keys, job)
    with client.pipeline(transaction=False) as p:
        p.hlen(keys.prompts(job))
        p.scard(keys.done(job))
        p.hlen(keys.dead(job))
        p.llen(keys.parked(job))
        p.get(keys.job_state(job))
        total, done, dead, parked, raw_state = p.execute()
    state = raw_state.decode() if raw_state else ACTIVE
    if state == ACTIVE and total and done + dead >= total:
        state = FINISHED
    created = float(record.created_at) if record else 0.0
    now = time.time() if now is None else now
    return JobSummary(
        job=job,
        state=state,
        total=int(total),
        done=int(done),
        dead=int(dead),
        priority=int(record.priority) if record else 0,
        created_at=created,
        age_s=(now - created) if created else None,
        parked=int(parked),
    )


def list_jobs(client: redis.Redis, settings: Settings) -> list[JobSummary]:
    names = sorted(m.decode() for m in client.smembers(settings.keys.jobs))
    now = time.time()
    return [job_summary(client, settings, name, now) for name in names]


def _glob_escape(text: str) -> str:
    import re

    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
