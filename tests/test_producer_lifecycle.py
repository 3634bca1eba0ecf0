"""Job lifecycle: ``producer jobs``, ``pause``/``resume``, ``cancel``, ``purge`` and ``submit --break-lock``,
with real redis, a real simulator and real workers; the live invariant sampled throughout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, dead_letters, in_flight, job_progress, wait_until
from testing.harness import (
    STEADY_LEASE,
    fast_env,
    isolated_settings,
    make_prompts,
    post_json,
    producer_cli,
    sim_stats,
    submit_ids,
)
from testing.invariant_watch import InvariantWatch
from testing.record import check_job, record_result
from thinkfleet.settings import Settings
from thinkfleet.state import lifecycle as lc

#: Simulated seconds per wall second: slow enough that a job of N_PROMPTS runs for tens of seconds.
TIME_SCALE = "2"
N_PROMPTS = 32
SAMPLING = {"max_new_tokens": 256}


def _stored(client: redis.Redis, settings: Settings, job: str) -> int:
    return job_progress(client, settings.keys, job)["done"]


def _fleet(
    tmp_path: Path, settings: Settings, n: int = 2, **extra: object
) -> tuple[SimulatorProcess, list[WorkerProcess]]:
    sim = SimulatorProcess("--time-scale", TIME_SCALE)
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    client = redis.Redis.from_url(settings.redis_url)
    env = fast_env(settings, sim.url, max_inflight=4, **{**STEADY_LEASE, **extra})  # no worker dies here
    workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in range(n)]
    for w in workers:
        w.wait_ready(client, settings.keys)
    return sim, workers


def _stop(sim: SimulatorProcess, workers: list[WorkerProcess]) -> None:
    for w in workers:
        w.terminate()
    sim.kill()


def _jobs(settings: Settings) -> dict[str, dict[str, object]]:
    out = producer_cli(settings, "jobs", "--json", in_process=True)
    assert out.returncode == 0, out.stderr
    return {j["job"]: j for j in json.loads(out.stdout)}


def test_pause_holds_and_resume_finishes_clean(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(N_PROMPTS)
    # The pause must land while prompts are still queued, whatever the box's load: the simulator is stalled
    # (it takes requests and answers none) from before the submit until the pause has landed, so no prompt
    # can be stored before it. Each worker then holds at most its concurrency (max_inflight + headroom = 8)
    # claimed prompts, which finish after the stall; every other message is parked. The request deadline
    # outlasts the stall, so the held requests are answered, never timed out and retried.
    sim, workers = _fleet(tmp_path, settings, request_timeout_floor_s=600)
    started = time.monotonic()
    try:
        for w in workers:
            w.wait_consuming()  # past the preflight, which a stalled server would hold
        with InvariantWatch(settings, "pz") as watch:
            post_json(f"{sim.url}/control/stall", {"seconds": 300})
            try:
                submit_ids(settings, "pz", prompts, **SAMPLING)
                wait_until(lambda: in_flight(client, settings.keys, "pz"), 60, what="prompts in flight")
                assert _stored(client, settings, "pz") == 0
                assert _jobs(settings)["pz"]["state"] == "active"
                out = producer_cli(settings, "pause", "pz", in_process=True)
                assert out.returncode == 0, out.stderr
            finally:
                post_json(f"{sim.url}/control/stall", {"seconds": 0})
            # In-flight prompts finish; then nothing more is stored while the job is paused.
            wait_until(lambda: not in_flight(client, settings.keys, "pz"), 120, what="in-flight prompts finished")
            held = _stored(client, settings, "pz")
            assert held < N_PROMPTS, out.stdout

            def parked() -> int:
                return int(client.llen(settings.keys.parked("pz")))

            def accounted() -> bool:
                return parked() == N_PROMPTS - held - len(dead_letters(client, settings.keys, "pz"))

            # The messages the workers had taken but not claimed are parked as they reach them.
            wait_until(accounted, 60, what="every message not stored parked")
            time.sleep(4)  # the hold itself: an interval in which nothing may happen
            assert _stored(client, settings, "pz") == held
            assert not in_flight(client, settings.keys, "pz")
            assert client.llen(settings.keys.parked("pz")) == N_PROMPTS - held - len(
                dead_letters(client, settings.keys, "pz")
            )
            listed = _jobs(settings)["pz"]
            assert listed["state"] == "paused" and listed["done"] == held and listed["total"] == N_PROMPTS
            status = json.loads(producer_cli(settings, "status", "pz", "--json", in_process=True).stdout)
            assert status["state"] == "paused" and status["unaccounted"] == 0
            out = producer_cli(settings, "resume", "pz", in_process=True)
            assert out.returncode == 0, out.stderr
            wait_until(lambda: _stored(client, settings, "pz") == N_PROMPTS, 120, what="job finished after resume")
        watch.assert_held()
        assert _jobs(settings)["pz"]["state"] == "finished"
        outcome = check_job(settings, "pz", prompts, {**_params(client, settings, "pz")})
        record_result(
            "producer pause then resume mid-job",
            outcome,
            "pause with prompts in flight (the server held until it landed), 4 s held, resume",
            wall_s=time.monotonic() - started,
            workers=len(workers),
        )
        outcome.assert_clean()
    finally:
        _stop(sim, workers)


def _params(client: redis.Redis, settings: Settings, job: str) -> dict[str, object]:
    return json.loads(client.hget(settings.keys.job(job), "sampling_params"))


def test_cancel_second_job_stops_it_and_first_finishes(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    a_prompts = make_prompts(N_PROMPTS, seed=1)
    b_prompts = {f"b{k}": v for k, v in make_prompts(N_PROMPTS, seed=2).items()}
    sim, workers = _fleet(tmp_path, settings)
    started = time.monotonic()
    try:
        with InvariantWatch(settings, "ja") as watch_a, InvariantWatch(settings, "jb") as watch_b:
            submit_ids(settings, "jb", b_prompts, **SAMPLING)
            submit_ids(settings, "ja", a_prompts, **SAMPLING)
            wait_until(lambda: in_flight(client, settings.keys, "jb"), 60, what="job B generating")
            aborted_before = int(sim_stats(sim.url)["aborted"])
            out = producer_cli(settings, "cancel", "jb", in_process=True)
            assert out.returncode == 0, out.stderr
            cancelled_at = time.monotonic()
            # B's generation stops within a few seconds: no claim left, its requests aborted on the server.
            wait_until(lambda: not in_flight(client, settings.keys, "jb"), 5, interval_s=0.1, what="B stopped")
            stop_s = time.monotonic() - cancelled_at
            b_stored = _stored(client, settings, "jb")
            wait_until(lambda: _stored(client, settings, "ja") == N_PROMPTS, 180, what="job A finished")
            assert _stored(client, settings, "jb") == b_stored
        watch_a.assert_held()
        watch_b.assert_held()
        assert int(sim_stats(sim.url)["aborted"]) > aborted_before
        dead = dead_letters(client, settings.keys, "jb")
        assert {d["error_class"] for d in dead.values()} == {"cancelled"}
        assert len(dead) + b_stored == N_PROMPTS
        assert _jobs(settings)["jb"]["state"] == "cancelled"
        outcome_a = check_job(settings, "ja", a_prompts, _params(client, settings, "ja"))
        outcome_b = check_job(settings, "jb", b_prompts, _params(client, settings, "jb"), expected_dead=set(dead))
        record_result(
            "producer cancel of a second job while the first runs",
            outcome_a,
            f"cancel job B mid-run: stopped in {stop_s:.1f} s, {b_stored} rows kept, {len(dead)} cancelled",
            recovery_s=[stop_s],
            wall_s=time.monotonic() - started,
            workers=len(workers),
        )
        outcome_a.assert_clean()
        outcome_b.assert_clean()
        # The cancelled prompts revive: resume, then retry them.
        assert producer_cli(settings, "resume", "jb", in_process=True).returncode == 0
        out = producer_cli(settings, "retry", "jb", "--error-class", "cancelled", in_process=True)
        assert out.returncode == 0, out.stderr
        wait_until(lambda: _stored(client, settings, "jb") == N_PROMPTS, 180, what="job B revived")
    finally:
        _stop(sim, workers)


def test_purge_refuses_while_running_then_removes_every_key(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(N_PROMPTS, seed=3)
    sim, workers = _fleet(tmp_path, settings, n=1)
    try:
        submit_ids(settings, "pg", prompts, **SAMPLING)
        wait_until(lambda: in_flight(client, settings.keys, "pg"), 60, what="generating")
        out = producer_cli(settings, "purge", "pg", in_process=True)
        assert out.returncode != 0 and "queued" in out.stderr
        out = producer_cli(settings, "purge", "pg", "--force", in_process=True)
        assert out.returncode == 0, out.stderr
        assert not list(client.scan_iter(match=f"{settings.key_prefix}:job:pg*"))
        assert not client.sismember(settings.keys.jobs, "pg")
        assert "pg" not in _jobs(settings)
        time.sleep(2)  # a straggler worker must not recreate the job's keys
        assert not list(client.scan_iter(match=f"{settings.key_prefix}:job:pg:*")), list(
            client.scan_iter(match=f"{settings.key_prefix}:job:pg:*")
        )
    finally:
        _stop(sim, workers)


def test_pause_parks_and_resume_restores_without_workers(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    submit_ids(settings, "x1", make_prompts(30, seed=4))
    submit_ids(settings, "x2", {f"q{k}": v for k, v in make_prompts(500, seed=5, length=8).items()})
    before = client.lrange(settings.queue, 0, -1)
    assert lc.pause(client, settings, "x2") == 500
    assert client.llen(settings.queue) == 30
    from thinkfleet.state.invariant import account

    assert account(client, settings, "x2").counts()["queued"] == 500
    assert lc.resume(client, settings, "x2") == 500
    after = client.lrange(settings.queue, 0, -1)
    assert sorted(after) == sorted(before)
    x2_before = [m for m in before if b'"x2/' in m]
    assert [m for m in after if b'"x2/' in m] == x2_before  # order kept
    assert lc.cancel(client, settings, "x2") == 500
    assert client.llen(settings.queue) == 30
    assert len(dead_letters(client, settings.keys, "x2")) == 500
    assert lc.purge(client, settings, "x2") > 0
    assert not list(client.scan_iter(match=f"{settings.key_prefix}:job:x2*"))
    assert client.llen(settings.queue) == 30


def test_break_lock_names_holder_and_breaks_only_dead_or_old_locks(redis_url: str, tmp_path: Path) -> None:
    from producer.state import LockHolder, StateError, SubmitLock, break_lock

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    key = settings.keys.submit_lock("bl")
    with SubmitLock(client, settings, "bl") as held:
        try:
            with SubmitLock(client, settings, "bl"):
                raise AssertionError("a second lock was granted")
        except StateError as e:
            assert f"pid {os.getpid()}" in str(e) and "--break-lock" in str(e)
        try:
            break_lock(client, settings, "bl")
            raise AssertionError("a live holder's lock was broken")
        except StateError as e:
            assert "live process" in str(e)
        assert client.get(key) == held.token.encode()
    # A dead process on this host: broken at once.
    holder = LockHolder.parse(held.token)
    client.set(key, f"dead@{time.time():.0f}@{holder.host}@999999999")
    assert break_lock(client, settings, "bl") is not None
    assert not client.exists(key)
    # Another host: only once old enough.
    client.set(key, f"other@{time.time():.0f}@elsewhere@1")
    try:
        break_lock(client, settings, "bl")
        raise AssertionError("a young lock of an unknown holder was broken")
    except StateError:
        pass
    client.set(key, f"other@{time.time() - 3600:.0f}@elsewhere@1")
    assert "elsewhere" in (break_lock(client, settings, "bl") or "")
    assert not client.exists(key)
