"""`producer retry` is atomic: no prompt is lost or sent twice, whoever is consuming while it runs.

A retry that published the dead letters' messages before deleting their records handed them to idle
workers that still saw the prompts as dead: they skipped and acknowledged them, then the records went
too, and the prompts were nowhere. Now the records leave and the messages land on the queue in one
MULTI (the same staged commit `producer submit` uses), so a worker sees either both or neither.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import msgpack
import pytest
import redis

from producer.enqueue import Stager
from producer.retry import retry_dead, retry_truncated
from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, dead_letters, in_flight, job_progress, wait_until
from testing.harness import (
    STEADY_LEASE,
    fast_env,
    isolated_settings,
    make_prompts,
    producer_cli,
    register_ids,
    submit_ids,
    transit_prompt_ids,
)
from testing.record import check_job, record_result
from thinkfleet.keys import Keys
from thinkfleet.message import content_hash
from thinkfleet.settings import Settings
from thinkfleet.state.invariant import queued_prompt_ids
from thinkfleet.state.invariant import unacked_prompt_ids as running_prompt_ids

#: Dead letters per scenario: enough that idle workers grab some before a non-atomic retry finishes.
N_DEAD = 40


def _blocked_on_queue(client: redis.Redis) -> int:
    """Connections of this test's DB blocked in the workers' pop (``BLMOVE queue → transit``): idle consumers."""
    db = client.connection_pool.connection_kwargs.get("db", 0)
    return sum(
        1
        for c in client.client_list()
        if c.get("cmd") == "blmove" and "b" in c.get("flags", "") and int(c.get("db", -1)) == db
    )


def _settled(client: redis.Redis, settings: Settings, job: str) -> bool:
    """Nothing of ``job`` is queued, popped, delivered or claimed: what is stored now is all there will be."""
    return not (
        client.llen(settings.queue)
        or queued_prompt_ids(client, settings, job)
        or transit_prompt_ids(client, settings, job)
        or running_prompt_ids(client, settings, job)
        or in_flight(client, settings.keys, job)
    )


def _wait_settled(client: redis.Redis, settings: Settings, job: str, want_done: int, timeout_s: float) -> None:
    """Until ``want_done`` prompts are done, or the job has settled short of it (twice in a row, 1 s apart)."""
    last = {"settled": False}

    def finished() -> bool:
        if job_progress(client, settings.keys, job)["done"] >= want_done and _settled(client, settings, job):
            return True
        settled = _settled(client, settings, job)
        was, last["settled"] = last["settled"], settled
        return settled and was

    wait_until(finished, timeout_s, interval_s=1.0, what=f"job {job} settled")


def _resolved(client: redis.Redis, keys: Keys, job: str) -> int:
    p = job_progress(client, keys, job)
    return p["done"] + p["dead"]


def _two_idle_workers(client: redis.Redis, keys: Keys, workers: list[WorkerProcess]) -> None:
    for w in workers:
        assert w.alive(), w.tail()
    wait_until(lambda: _blocked_on_queue(client) >= 2, 60, interval_s=0.05, what="two workers blocked on the queue")


def test_retry_while_two_workers_sit_idle_loses_nothing(redis_url: str, tmp_path: Path) -> None:
    # Given a job of 10 short prompts and 40 prompts too long for a 4,096-token server: 40 dead letters.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(10)
    for i, ids in enumerate(make_prompts(N_DEAD, seed=1, length=5000).values()):
        prompts[f"long{i:03d}"] = ids  # ≥ 2,500 ids + 2,048 new > 4,096
    long_ids = {pid for pid in prompts if pid.startswith("long")}
    sim = SimulatorProcess("--time-scale", "400", "--context-length", "4096")
    sim.log_path = str(tmp_path / "sim.log")
    started = time.monotonic()
    sim.start()
    env = fast_env(settings, sim.url, **STEADY_LEASE)  # no worker dies here
    workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready(client, keys)
        job = submit_ids(settings, "retry-idle", prompts)
        wait_until(lambda: _resolved(client, keys, "retry-idle") == len(prompts), 120, what="all resolved")
        assert set(dead_letters(client, keys, "retry-idle")) == long_ids
        # When the server comes back with a long context and, while two workers sit idle on the queue,
        # the operator retries every dead letter.
        # Each worker must see the server go away: one that probes only after the restart would keep the old
        # server's context length (a real restart takes minutes, far longer than a health interval).
        seen = {w.name: w.gate_closures() for w in workers}
        sim.kill()
        wait_until(lambda: all(w.gate_closures() > seen[w.name] for w in workers), 30, what="both workers saw it go")
        sim.args = ["--time-scale", "400"]
        sim.start()
        _two_idle_workers(client, keys, workers)
        retry = producer_cli(settings, "retry", "retry-idle", "--json")
        assert retry.returncode == 0, retry.stderr
        assert set(json.loads(retry.stdout)["prompt_ids"]) == long_ids
        _wait_settled(client, settings, "retry-idle", len(prompts), 180)
    finally:
        for w in workers:
            w.terminate()
        sim.kill()
    # Then every retried prompt is stored once, byte-exact, and no dead letter is left.
    outcome = check_job(settings, "retry-idle", job.prompts, job.sampling_params)
    record_result(
        "producer retry while two workers sit idle",
        outcome,
        f"{N_DEAD} of {len(prompts)} prompts dead-lettered (context overflow); server restarted with a longer "
        "context; `producer retry` while two workers block on the queue",
        [],
        time.monotonic() - started,
        workers=2,
        notes="dead records leave and messages land in one MULTI: a worker sees both or neither",
    )
    outcome.assert_clean()
    assert not dead_letters(client, keys, "retry-idle")
    assert not client.hlen(keys.deliveries("retry-idle"))


def test_truncated_retry_while_two_workers_sit_idle_replaces_every_row(redis_url: str, tmp_path: Path) -> None:
    # Given a job whose budget of 64 new tokens truncates most of its 40 outputs, and two idle workers.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    sim = SimulatorProcess("--time-scale", "400")
    sim.log_path = str(tmp_path / "sim.log")
    started = time.monotonic()
    sim.start()
    env = fast_env(settings, sim.url, **STEADY_LEASE)  # no worker dies here
    workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready(client, keys)
        job = submit_ids(settings, "retry-trunc", make_prompts(N_DEAD, seed=2), max_new_tokens=64)
        wait_until(lambda: job_progress(client, keys, "retry-trunc")["done"] == N_DEAD, 120, what="all rows")
        _two_idle_workers(client, keys, workers)
        # When the truncated rows are re-run with 2,048 new tokens.
        retry = producer_cli(settings, "retry", "retry-trunc", "--truncated", "--max-new-tokens", "2048", "--json")
        assert retry.returncode == 0, retry.stderr
        rerun = set(json.loads(retry.stdout)["prompt_ids"])
        assert len(rerun) >= N_DEAD // 2, "most outputs were cut at 64 tokens"
        _wait_settled(client, settings, "retry-trunc", N_DEAD, 180)
    finally:
        for w in workers:
            w.terminate()
        sim.kill()
    # Then the committed view holds the new revision of each re-run prompt, once, byte-exact.
    overrides = {pid: {"max_new_tokens": 2048} for pid in rerun}
    outcome = check_job(settings, "retry-trunc", job.prompts, job.sampling_params, overrides=overrides)
    record_result(
        "producer retry --truncated while two workers sit idle",
        outcome,
        f"{len(rerun)} of {N_DEAD} rows stopped at 64 tokens; `producer retry --truncated --max-new-tokens 2048` "
        "while two workers block on the queue",
        [],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
    assert int(client.hget(keys.counters("retry-trunc"), "done") or 0) == N_DEAD


# -- a retry that dies before its commit changes nothing ------------------------------------------------------
def _dead_letter_all(settings: Settings, job: str, n: int) -> dict[str, list[int]]:
    """Register a job of ``n`` prompts and dead-letter every one, with the record and counters a worker writes."""
    prompts = make_prompts(n, seed=3)
    _, tasks = register_ids(settings, job, prompts)
    client = redis.Redis.from_url(settings.redis_url)
    keys = settings.keys
    for task in tasks:
        record = {
            "error_class": "context_overflow",
            "message": "too long",
            "attempts": 1,
            "worker": "w-test",
            "at": time.time(),
            "dataset": task.dataset,
            "task": base64.b64encode(msgpack.packb(task.to_args())).decode(),
        }
        client.hset(keys.dead(job), task.prompt_id, json.dumps(record))
        client.hincrby(keys.counters(job), "dead", 1)
        client.hincrby(keys.dataset_counters(job, task.dataset), "dead", 1)
    return prompts


def _snapshot(client: redis.Redis, settings: Settings, job: str) -> dict[str, object]:
    keys = settings.keys
    return {
        "dead": client.hgetall(keys.dead(job)),
        "done": client.smembers(keys.done(job)),
        "counters": client.hgetall(keys.counters(job)),
        "ds": client.hgetall(keys.dataset_counters(job, "synthetic")),
        "deliveries": client.hgetall(keys.deliveries(job)),
        "queue": client.lrange(settings.queue, 0, -1),
        "staging": sorted(client.scan_iter(match=keys.staging(job, "*"))),
    }


class _Interrupted(Exception):
    pass


_REAL_COMMIT = Stager.commit


def _interrupt(*args: object, **kwargs: object) -> None:
    raise _Interrupted("killed before the commit")


def test_dead_retry_interrupted_before_its_commit_changes_nothing(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    _dead_letter_all(settings, "cut", 25)
    client.hset(keys.deliveries("cut"), "p00003", json.dumps({"n": 2, "error": "crash"}))
    before = _snapshot(client, settings, "cut")
    assert len(before["dead"]) == 25 and not before["queue"]  # type: ignore[arg-type]

    monkeypatch.setattr(Stager, "commit", _interrupt)
    with pytest.raises(_Interrupted):
        retry_dead(settings, "cut")
    # Dead records, counters, deliveries and the queue are as they were; the staged messages are gone.
    assert _snapshot(client, settings, "cut") == before
    assert not client.exists(keys.submit_lock("cut")), "the lock is released"

    # And a retry that runs to the end moves all 25 at once, and clears counters and delivery counts.
    monkeypatch.undo()
    ids = retry_dead(settings, "cut")
    after = _snapshot(client, settings, "cut")
    assert sorted(ids) == sorted(k.decode() for k in before["dead"])  # type: ignore[union-attr]
    assert not after["dead"] and not after["deliveries"] and not after["staging"]
    assert len(after["queue"]) == 25  # type: ignore[arg-type]
    assert int(after["counters"][b"dead"]) == 0 and int(after["ds"][b"dead"]) == 0  # type: ignore[index]
    assert sorted(queued_prompt_ids(client, settings, "cut")) == sorted(ids)
    # The queue serves them in row order (kombu pops the right end).
    served = [json.loads(m)["headers"]["id"] for m in reversed(after["queue"])]  # type: ignore[call-overload]
    assert served == [f"cut/{pid}/r0" for pid in ids]
    # A second retry finds nothing to re-send.
    assert retry_dead(settings, "cut") == []
    assert client.llen(settings.queue) == 25


def test_retry_waits_for_no_one_and_refuses_while_a_submit_holds_the_job(redis_url: str, tmp_path: Path) -> None:
    from producer.state import SubmitLock

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    _dead_letter_all(settings, "locked", 5)
    with SubmitLock(client, settings, "locked"):
        result = producer_cli(settings, "retry", "locked", "--json")
    assert result.returncode != 0 and "another submit" in result.stderr, result.stderr
    assert client.hlen(settings.keys.dead("locked")) == 5 and not client.llen(settings.queue)


def test_truncated_retry_interrupted_before_its_commit_changes_nothing(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa

    import storage.reader

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(12, seed=4)
    register_ids(settings, "cut-trunc", prompts)
    # Every prompt stored and done; the even ones stopped on length (storage is faked: only its view matters).
    client.sadd(keys.done("cut-trunc"), *prompts)
    client.hset(keys.counters("cut-trunc"), "done", 12)
    client.hset(keys.dataset_counters("cut-trunc", "synthetic"), "done", 12)
    client.hset(keys.deliveries("cut-trunc"), "p00002", json.dumps({"n": 1, "error": "crash"}))
    rows = [
        {
            "dataset": "synthetic",
            "prompt_id": pid,
            "row_index": i,
            "sample_index": 0,
            "revision": 0,
            "content_hash": content_hash(ids),  # retry checks a rebuilt message against it
            "input_ids": ids,
            "finish_reason": "length" if i % 2 == 0 else "stop",
        }
        for i, (pid, ids) in enumerate(prompts.items())
    ]
    monkeypatch.setattr(storage.reader, "read_committed", lambda *a, **k: pa.Table.from_pylist(rows))
    before = _snapshot(client, settings, "cut-trunc")

    monkeypatch.setattr(Stager, "commit", _interrupt)
    with pytest.raises(_Interrupted):
        retry_truncated(settings, "cut-trunc", 2048)
    assert _snapshot(client, settings, "cut-trunc") == before
    assert not client.exists(keys.submit_lock("cut-trunc"))

    monkeypatch.setattr(Stager, "commit", _REAL_COMMIT)
    ids = retry_truncated(settings, "cut-trunc", 2048)
    truncated = [pid for i, pid in enumerate(prompts) if i % 2 == 0]
    assert ids == truncated
    after = _snapshot(client, settings, "cut-trunc")
    assert after["done"] == {pid.encode() for pid in prompts} - {pid.encode() for pid in truncated}
    assert int(after["counters"][b"done"]) == 6 and int(after["ds"][b"done"]) == 6  # type: ignore[index]
    assert not after["deliveries"] and not after["staging"]
    served = [json.loads(m)["headers"]["id"] for m in reversed(after["queue"])]  # type: ignore[call-overload]
    assert served == [f"cut-trunc/{pid}/r1" for pid in truncated]
