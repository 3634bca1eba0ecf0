"""Real processes for tests and benchmarks: worker subprocesses, waits, Redis counts and recovery timing.

The worker process itself (:class:`WorkerProcess`, :func:`worker_env`, :func:`free_port`,
:func:`wait_for_port`) lives in the demo package, ``demo/fleet.py``, because the demo runs it too; it is
re-exported here so tests import every fleet helper from one place.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

from demo.fleet import WorkerProcess, free_port, free_ports, wait_for_port, worker_env
from thinkfleet.keys import Keys
from thinkfleet.redis_client import sync_client

__all__ = [
    "RecoveryWatch",
    "WorkerProcess",
    "dead_letters",
    "free_port",
    "free_ports",
    "in_flight",
    "job_progress",
    "job_settled",
    "register_id_job",
    "stuck_report",
    "wait_for_port",
    "wait_until",
    "worker_env",
]


def wait_until(
    predicate: Callable[[], object],
    timeout_s: float,
    interval_s: float = 0.2,
    what: str = "condition",
    explain: Callable[[], str] | None = None,
) -> None:
    """Until ``predicate()`` is true; a TimeoutError after ``timeout_s`` carries ``explain()`` (what a test that
    failed once in CI needs to be understood from its log alone: a stuck job's state, the workers' last lines)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    detail = ""
    if explain is not None:
        try:
            detail = "\n" + explain()
        except Exception as exc:  # the report must never hide the timeout it explains
            detail = f"\n(no report: {exc!r})"
    raise TimeoutError(f"{what} not reached within {timeout_s}s{detail}")


def stuck_report(
    client: redis.Redis, settings: Any, job: str, workers: Sequence[WorkerProcess] = (), lines: int = 40
) -> str:
    """What a job that stopped moving looks like: its counts, each prompt neither done nor dead with its claim,
    the queue and kombu's unacked hash, and each worker's last log lines."""
    from thinkfleet.broker.keys import kombu_transport_options

    keys = settings.keys
    out: list[str] = []
    try:
        out.append(f"progress: {job_progress(client, keys, job)}")
        prompts = {k.decode() for k in client.hkeys(keys.prompts(job))}
        settled = {m.decode() for m in client.smembers(keys.done(job))} | {
            k.decode() for k in client.hkeys(keys.dead(job))
        }
        claims = {k.decode(): v.decode() for k, v in client.hgetall(keys.claims(job)).items()}
        for pid in sorted(prompts - settled)[:20]:
            out.append(f"  open {pid}: claim={claims.get(pid)}")
        unacked = str(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"])
        out.append(f"queue={client.llen(settings.queue)} unacked={client.hlen(unacked)} claims={len(claims)}")
    except redis.RedisError as exc:
        out.append(f"Redis: {exc!r}")
    for w in workers:
        try:
            tail = w.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            tail = [repr(exc)]
        out.append(f"--- worker {w.name} (alive={w.alive()}) last {len(tail)} lines:")
        out.extend(tail)
    return "\n".join(out)


def job_settled(client: redis.Redis, settings: Any, job: str, prompts: int) -> bool:
    """Every prompt done, and no message or claim of the job left anywhere (redelivered copies consumed):
    the queue, kombu's unacked hash, every transit list and the claims are empty. False while Redis is away."""
    from thinkfleet.broker.keys import kombu_transport_options

    keys = settings.keys
    try:
        unacked = str(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"])
        transit = any(client.llen(k) for k in client.scan_iter(match=keys.transit("") + "*"))
        return (
            job_progress(client, keys, job)["done"] == prompts
            and not client.llen(settings.queue)
            and not client.hlen(unacked)
            and not transit
            and not client.hlen(keys.claims(job))
        )
    except redis.RedisError:
        return False


def job_progress(client: redis.Redis, keys: Keys, job: str) -> dict[str, int]:
    """done / dead / submitted counts straight from Redis."""
    return {
        "submitted": int(client.hlen(keys.prompts(job))),
        "done": int(client.scard(keys.done(job))),
        "dead": int(client.hlen(keys.dead(job))),
    }


def job_progress_or_down(client: redis.Redis, keys: Keys, job: str) -> dict[str, int]:
    """:func:`job_progress`, or ``done == -1`` while Redis does not answer (a restart, a failover): for waits that
    ride through an outage."""
    try:
        return job_progress(client, keys, job)
    except redis.RedisError:
        return {"submitted": 0, "done": -1, "dead": 0}


def dead_letters(client: redis.Redis, keys: Keys, job: str) -> dict[str, dict[str, object]]:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(keys.dead(job)).items()}


def in_flight(client: redis.Redis, keys: Keys, job: str, worker: str | None = None) -> set[str]:
    """Prompt ids some worker (or ``worker``) has claimed and not yet stored (the ledger's claims hash)."""
    if worker is None:
        return {k.decode() for k in client.hkeys(keys.claims(job))}
    claims = client.hgetall(keys.claims(job))
    return {k.decode() for k, v in claims.items() if json.loads(v).get("worker") == worker}


class RecoveryWatch:
    """Times a fault's recovery: from :meth:`start` (the fault) until every prompt that was in flight then
    is stored or dead-lettered, and at least one row more than at the fault is stored.

    It polls from its own thread with its own client and shrugs off connection errors, so it keeps
    timing through a Redis restart. ``seconds`` is None until recovered.
    """

    def __init__(self, redis_url: str, keys: Keys, job: str, label: str = "", interval_s: float = 0.1) -> None:
        self.redis_url = redis_url
        self.keys = keys
        self.job = job
        self.label = label
        self.interval_s = interval_s
        self.seconds: float | None = None
        self.pending: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pending: set[str] | None = None) -> RecoveryWatch:
        """Call right before injecting the fault; ``pending`` defaults to the prompts in flight now."""
        client = sync_client(self.redis_url)
        self.pending = set(pending) if pending is not None else in_flight(client, self.keys, self.job)
        self._done_at_start = int(client.scard(self.keys.done(self.job)))
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(client,), name=f"recovery-{self.label}", daemon=True)
        self._thread.start()
        return self

    def _recovered(self, client: redis.Redis) -> bool:
        done = {m.decode() for m in client.smembers(self.keys.done(self.job))}
        dead = {k.decode() for k in client.hkeys(self.keys.dead(self.job))}
        return self.pending <= done | dead and len(done) > self._done_at_start

    def _run(self, client: redis.Redis) -> None:
        while not self._stop.is_set():
            try:
                if self._recovered(client):
                    self.seconds = time.monotonic() - self._started
                    return
            except redis.RedisError:
                pass
            self._stop.wait(self.interval_s)

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        return self.seconds


def register_id_job(
    client: redis.Redis,
    keys: Keys,
    job: str,
    prompts: Mapping[str, list[int]],
    sampling_params: Mapping[str, object],
    dataset: str,
    fingerprint: str,
    signer: Any = None,
) -> str:
    """The job record and prompt hashes, as ``producer submit`` writes them, for a job given as token ids
    (no tokenizer): each prompt's content hash is :func:`thinkfleet.message.content_hash` of its ids. With
    ``signer`` (thinkfleet.signing.Signer) the record carries its signature, as a producer with a key writes it.

    Returns the record's generation: the existing record's (a re-submit keeps it), else a new one — as submit
    mints one, so that a straggler of a purged job's run is refused by finalize.lua instead of recreating its
    ``done`` (a record without a generation is not checked)."""
    from thinkfleet import kimi
    from thinkfleet.message import content_hash

    old = client.hget(keys.job(job), "generation")
    generation = json.loads(old) if old else uuid.uuid4().hex[:16]

    record = {
        "name": job,
        "sampling_params": dict(sampling_params),
        "tokenizer_fingerprint": fingerprint,
        "chat_template_hash": fingerprint,
        "think_start_id": kimi.THINK_START,
        "think_end_id": kimi.THINK_END,
        "generation": generation,
    }
    if sampling_params.get("logprobs") is not None:  # --logprobs K: the record's field, as submit writes it
        record["logprobs"] = sampling_params["logprobs"]
    fields = {k: json.dumps(v) for k, v in record.items()}
    client.hset(keys.job(job), mapping=signer.sign_record_hash(job, fields) if signer is not None else fields)
    client.sadd(keys.jobs, job)
    client.hset(keys.prompts(job), mapping={pid: content_hash(ids) for pid, ids in prompts.items()})
    client.hset(keys.prompt_dataset(job), mapping=dict.fromkeys(prompts, dataset))
    # The counters `producer status` reads, as submit's commit sets them (thinkfleet/state/counters.py).
    total = client.hlen(keys.prompts(job))
    in_dataset = sum(1 for name in client.hvals(keys.prompt_dataset(job)) if name == dataset.encode())
    client.hset(keys.dataset_counters(job, dataset), "submitted", in_dataset)
    client.hset(keys.counters(job), "submitted", total)
    return generation


def exchange_paths(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``): no moment where either is missing — a
    move and then a write would let a worker's part write in between make a moved directory again."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), f"{a} <-> {b}")


def draw_schedule(
    rng: random.Random, kinds: Sequence[str], count: int, low: float, high: float
) -> list[tuple[float, str]]:
    """``count`` (share of the job, kind) pairs at increasing shares in [low, high], each kind at least once when
    there is room: the fault and operator schedules' draw (the same ``rng`` then draws each event's details)."""
    drawn = list(kinds) if count >= len(kinds) else rng.sample(list(kinds), count)
    drawn += [rng.choice(list(kinds)) for _ in range(count - len(drawn))]
    rng.shuffle(drawn)
    shares = sorted(rng.uniform(low, high) for _ in range(count))
    return list(zip(shares, drawn, strict=True))
