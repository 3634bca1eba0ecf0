"""A job's counts from the counters its own transitions keep: O(1) of the queue, O(datasets) of the job.

Every transition that moves a prompt into or out of ``done``/``dead`` updates, in the same Lua call, the job's
counters hash and its dataset's (``finalize``, ``dead_letter``, ``requeue``, ``refill_done``); ``submit`` sets each
dataset's ``submitted`` in its commit MULTI, and ``finalize`` counts a later turn it adds to the job. A Redis
rollback restores counters and sets together (they are written together). So ``producer status`` reads numbers,
not sets: the job's totals from ``HLEN``/``SCARD`` (exact and O(1) already), each dataset's from its counters.

What counters cannot say is *where* a pending prompt is — queued, delivered, or nowhere at all (lost). That is the
full scan's (:mod:`thinkfleet.state.invariant`), run on request (``status --deep``) or as the periodic check of
``wait`` and ``status --watch``. :func:`check_counters` compares the counters with the sets (streamed in chunks),
repairs drift when nothing moved while it read, and the verdict is kept (``Keys.checked``) for a plain ``status``
to show.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from thinkfleet.keys import Keys

#: The per-dataset counters status reads (``Keys.dataset_counters``).
FIELDS = ("submitted", "done", "dead")
#: The job counter of messages of an earlier generation of the job record (before ``producer purge`` and a new
#: submit) that a worker skipped: never run with the new record, never acked unseen (``producer status`` shows it).
STALE_GENERATION = "stale_generation"
#: Members per SSCAN/HSCAN/HMGET round trip of a check (each a short block of Redis).
SCAN_CHUNK = 2000


@dataclass
class Counts:
    """How many prompts of a job are submitted, done and dead, in all and per dataset."""

    total: int = 0
    done: int = 0
    dead: int = 0
    #: dataset → {total, done, dead}
    datasets: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return self.total - self.done - self.dead


def read_counts(client: redis.Redis, keys: Keys, job: str, datasets: Sequence[str]) -> Counts:
    """The job's counts in one round trip: totals from the sets' sizes, per dataset from the counters
    (a single dataset takes the exact totals).

    One MULTI, so the sizes are of one moment: a finalize adds a turn's successor to the prompts and the turn to
    done in one step, and sizes read across it (the prompts before, done after) say nothing is pending while the
    successor is (``producer wait`` reads its verdict from them)."""
    names = list(datasets)
    with client.pipeline(transaction=True) as p:
        p.hlen(keys.prompts(job))
        p.scard(keys.done(job))
        p.hlen(keys.dead(job))
        for name in names:
            p.hmget(keys.dataset_counters(job, name), *FIELDS)
        total, done, dead, *per_ds = p.execute()
    counts = Counts(int(total), int(done), int(dead))
    if len(names) == 1:
        counts.datasets[names[0]] = {"total": counts.total, "done": counts.done, "dead": counts.dead}
        return counts
    for name, values in zip(names, per_ds, strict=True):
        submitted, d_done, d_dead = (int(float(v)) if v is not None else 0 for v in values)
        counts.datasets[name] = {"total": submitted, "done": d_done, "dead": d_dead}
    return counts


# -- the full check -----------------------------------------------------------------------------------------
def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def scan_counts(client: redis.Redis, keys: Keys, job: str, chunk: int = SCAN_CHUNK) -> dict[str, dict[str, int]]:
    """dataset → {submitted, done, dead} counted from the sets themselves, a chunk per round trip (memory: one
    chunk, not the job)."""
    out: dict[str, dict[str, int]] = {}

    def bump(dataset: bytes | None, name: str) -> None:
        ds = dataset.decode() if dataset is not None else "?"  # a prompt with no dataset recorded
        out.setdefault(ds, dict.fromkeys(FIELDS, 0))[name] += 1

    for _pid, ds in client.hscan_iter(keys.prompt_dataset(job), count=chunk):
        bump(ds, "submitted")
    for name, members in (
        ("done", client.sscan_iter(keys.done(job), count=chunk)),
        ("dead", (k for k, _v in client.hscan_iter(keys.dead(job), count=chunk))),
    ):
        for pids in _chunks(members, chunk):
            for ds in client.hmget(keys.prompt_dataset(job), pids):
                bump(ds, name)
    return out


def _counter_snapshot(client: redis.Redis, keys: Keys, job: str, names: Sequence[str]) -> list[Any]:
    """The sets' sizes (what :func:`scan_counts` counts) and the datasets' counters, in one round trip."""
    with client.pipeline(transaction=False) as p:
        p.hlen(keys.prompt_dataset(job))
        p.scard(keys.done(job))
        p.hlen(keys.dead(job))
        for name in names:
            p.hmget(keys.dataset_counters(job, name), *FIELDS)
        return p.execute()


@dataclass
class CounterCheck:
    """The counters against the sets: ``drift`` = dataset → {field: counter − set count} (only what differs)."""

    drift: dict[str, dict[str, int]] = field(default_factory=dict)
    repaired: bool = False
    #: the sets moved while they were read: drift may be the motion, nothing was repaired
    moving: bool = False

    @property
    def ok(self) -> bool:
        return not self.drift


def check_counters(
    client: redis.Redis, keys: Keys, job: str, datasets: Sequence[str] = (), repair: bool = True
) -> CounterCheck:
    """Compare each dataset's counters with a streamed count of the sets; with ``repair`` set them to the
    counts — only when nothing moved while the sets were read (their sizes and the counters are the same before
    and after the scan, and unchanged under WATCH until the write), so a repair never undoes a transition."""
    given = sorted(set(datasets))
    start = _counter_snapshot(client, keys, job, given)
    scanned = scan_counts(client, keys, job)
    names = sorted(set(given) | set(scanned))
    before = _counter_snapshot(client, keys, job, names)
    # Every transition of done/dead changes a set's size or a dataset's counter: the same before and after the
    # scan means nothing moved while it read, so the drift is real (a transition mid-scan looks like drift).
    at = {name: i for i, name in enumerate(names)}
    moved = start[:3] != before[:3] or any(start[3 + i] != before[3 + at[n]] for i, n in enumerate(given))
    result = CounterCheck(moving=moved)
    for name, values in zip(names, before[3:], strict=True):
        have = dict(zip(FIELDS, (int(float(v)) if v is not None else 0 for v in values), strict=True))
        want = scanned.get(name, dict.fromkeys(FIELDS, 0))
        diff = {f: have[f] - want[f] for f in FIELDS if have[f] != want[f]}
        if diff:
            result.drift[name] = diff
    if not result.drift or not repair or result.moving:
        return result
    watched = [
        keys.prompt_dataset(job),
        keys.done(job),
        keys.dead(job),
        *(keys.dataset_counters(job, n) for n in names),
    ]
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(*watched)
            # nothing may have moved since `before` (WATCH guards from here on), and the scan must add up to the sizes
            if _counter_snapshot(client, keys, job, names) != before or _sizes(scanned) != before[:3]:
                result.moving = True
                return result
            pipe.multi()
            for name in result.drift:
                pipe.hset(keys.dataset_counters(job, name), mapping=scanned.get(name, dict.fromkeys(FIELDS, 0)))
            pipe.execute()
            result.repaired = True
        except redis.WatchError:
            result.moving = True
    return result


def _sizes(scanned: dict[str, dict[str, int]]) -> list[int]:
    return [sum(d[f] for d in scanned.values()) for f in FIELDS]


# -- the last check's verdict ---------------------------------------------------------------------------------
def record_check(client: redis.Redis, keys: Keys, job: str, verdict: dict[str, Any]) -> None:
    """Keep the verdict of a full check (``Keys.checked``) for plain ``status`` calls, which do not scan."""
    client.set(keys.checked(job), json.dumps({"at": time.time(), **verdict}))


def last_check(client: redis.Redis, keys: Keys, job: str) -> dict[str, Any] | None:
    raw = client.get(keys.checked(job))
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None
