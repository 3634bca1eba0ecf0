"""Every message ends stored, dead-lettered with its reason, or handed back — on the paths that used to
lose prompts silently: two workers with one metrics port, a worker that cannot start, a corrupt or
malformed message, a prompt that crashes every worker (poison), and storage that stops accepting writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, dead_letters, exchange_paths, free_port, job_progress, wait_until
from testing.harness import STEADY_LEASE, fast_env, isolated_settings, make_prompts, register_ids, sim_stats, submit_ids
from testing.invariant_watch import InvariantWatch
from testing.record import check_job, record_result
from thinkfleet.broker.celery_app import send_tasks as _publish
from thinkfleet.message import PromptTask
from workers.tasks import START_FAILED_EXIT


def _resolved(client: redis.Redis, keys, job: str) -> int:
    p = job_progress(client, keys, job)
    return p["done"] + p["dead"]


@pytest.fixture()
def sim(tmp_path: Path):
    proc = SimulatorProcess("--time-scale", "400")
    proc.log_path = str(tmp_path / "sim.log")
    proc.start()
    yield proc
    proc.kill()


def test_two_workers_on_one_host_with_one_metrics_port_lose_nothing(redis_url: str, tmp_path: Path, sim) -> None:
    # Given two workers configured with the same metrics port (the shipped .env.example does this).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    port = free_port()
    started = time.monotonic()
    env = fast_env(settings, sim.url, metrics_port=port, **STEADY_LEASE)  # no worker dies here
    workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready(client, keys)
        job = submit_ids(settings, "ports", make_prompts(120))
        wait_until(lambda: _resolved(client, keys, "ports") == 120, 180, what="all resolved")
        # Then both serve metrics (on different ports) and both are still alive.
        info = {w.name: json.loads(client.hget(keys.workers, w.name)) for w in workers}
        ports = {i["metrics_port"] for i in info.values()}
        assert port in ports and len(ports) == 2, info
        assert all(w.alive() for w in workers)
        taken = [w for w in workers if "is taken" in w.log_path.read_text()]
        assert len(taken) == 1, "exactly one worker found the port taken and moved to a free one"
    finally:
        for w in workers:
            w.terminate()
    outcome = check_job(settings, "ports", job.prompts, job.sampling_params)
    record_result(
        "two workers on one host with one metrics port",
        outcome,
        "THINKFLEET_METRICS_PORT identical for both workers",
        [],
        time.monotonic() - started,
        workers=2,
        notes="the second serves metrics on a free port (registered in Redis) instead of failing every task",
    )
    outcome.assert_clean()


@pytest.mark.parametrize("fault", ["redis_password", "output_unwritable", "broker_apart"])
def test_a_worker_that_cannot_start_consumes_nothing_and_exits_naming_the_cause(
    redis_url: str, tmp_path: Path, sim, fault: str
) -> None:
    # Given a queued job and a worker whose Redis password is wrong / whose output location is a file.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    submit_ids(settings, "nostart", make_prompts(5))
    assert client.llen(settings.queue) == 5
    env = fast_env(settings, sim.url)
    if fault == "redis_password":
        # A user that does not exist: any password passes Redis' passwordless default user.
        bad = redis_url.replace("redis://", "redis://nobody:wrong-password@")
        env["THINKFLEET_REDIS_URL"] = bad
        env["THINKFLEET_BROKER_URL"] = bad
        expect = "cannot use Redis"
    elif fault == "broker_apart":
        # A RabbitMQ broker (nothing answers there: the worker must refuse before it ever connects).
        env["THINKFLEET_BROKER_URL"] = "amqp://guest:broker-secret@127.0.0.1:1//"
        expect = "Unset THINKFLEET_BROKER_URL"
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        env["THINKFLEET_OUTPUT_URI"] = str(blocker / "out")
        expect = "is not writable"
    worker = WorkerProcess("nostart", env, tmp_path).start()
    assert worker.proc is not None
    try:
        rc = worker.proc.wait(60)
    finally:
        worker.kill()
    log = worker.log_path.read_text()
    # Then it exits non-zero naming the cause (and the fix), and every message is still queued.
    assert rc == START_FAILED_EXIT, log[-3000:]
    assert expect in log and "nothing was consumed" in log, log[-3000:]
    if fault == "output_unwritable":
        assert "make it writable for uid" in log
    elif fault == "broker_apart":
        assert "broker-secret" not in log, "the broker's password must not be logged"
    else:
        assert "wrong-password" not in log, "the password must not be logged"
    assert client.llen(settings.queue) == 5
    assert job_progress(client, settings.keys, "nostart")["done"] == 0


def test_corrupt_and_malformed_messages_are_dead_lettered_and_nothing_else_is_disturbed(
    redis_url: str, tmp_path: Path, sim
) -> None:
    # Given a job where one message carries a corrupt id blob, plus a message that is no prompt task at all.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    job, tasks = register_ids(settings, "corrupt", make_prompts(20))
    bad = tasks[3]
    tasks[3] = PromptTask(
        bad.job, bad.dataset, bad.prompt_id, bad.row_index, bad.content_hash, b"\x01" + b"\x28\xb5\x2f\xfd garbage"
    )
    started = time.monotonic()
    worker = WorkerProcess("w1", fast_env(settings, sim.url), tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        _publish(settings, tasks)
        from workers.app import make_app

        app = make_app(settings, register=False)
        app.send_task("thinkfleet.generate", args=["not", "a", "prompt"], queue=settings.queue)
        wait_until(lambda: _resolved(client, keys, "corrupt") == 20, 120, what="all resolved")
        wait_until(lambda: client.llen(keys.malformed) == 1, 30, what="the malformed message recorded")
        assert worker.alive()
    finally:
        worker.terminate()
    dead = dead_letters(client, keys, "corrupt")
    assert set(dead) == {bad.prompt_id}
    assert dead[bad.prompt_id]["error_class"] == "corrupt_message"
    malformed = json.loads(client.lindex(keys.malformed, 0))
    assert "9 args" in malformed["error"]
    outcome = check_job(settings, "corrupt", job.prompts, job.sampling_params, expected_dead={bad.prompt_id})
    record_result(
        "corrupt id blob + a message that is no prompt task",
        outcome,
        "1 zstd-corrupt ids blob, 1 message with 3 args",
        [],
        time.monotonic() - started,
        notes="corrupt → dead letter corrupt_message; malformed → tf:malformed list (reason + body); the rest stored",
    )
    outcome.assert_clean()


def test_a_poison_prompt_is_dead_lettered_after_max_deliveries_and_nothing_else_is_disturbed(
    redis_url: str, tmp_path: Path, sim
) -> None:
    # Given a prompt that raises an unexpected exception in every worker that takes it.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(30)
    env = fast_env(settings, sim.url, max_deliveries=3)
    env["THINKFLEET_FAILPOINTS"] = "during_generate=raise:always@p00007"
    started = time.monotonic()
    worker = WorkerProcess("w1", env, tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "poison2", prompts)
        watch = InvariantWatch(settings, "poison2").start()
        wait_until(lambda: _resolved(client, keys, "poison2") == 30, 120, what="all resolved")
        assert worker.alive()
        watch.stop()
    finally:
        worker.terminate()
    watch.assert_held()
    # Then it is dead-lettered as poison with the exception's class and last line, after 3 deliveries.
    dead = dead_letters(client, keys, "poison2")
    assert set(dead) == {"p00007"}
    assert dead["p00007"]["error_class"] == "poison:FailpointError"
    assert "failpoint during_generate" in dead["p00007"]["message"]
    assert dead["p00007"]["attempts"] == 3
    assert client.hget(keys.deliveries("poison2"), "p00007") is None, "a dead letter clears its delivery count"
    outcome = check_job(settings, "poison2", job.prompts, job.sampling_params, expected_dead={"p00007"})
    record_result(
        "poison prompt: raises in every worker",
        outcome,
        "1 prompt raises an unexpected exception on every delivery",
        [],
        time.monotonic() - started,
        notes="dead-lettered as poison:FailpointError after THINKFLEET_MAX_DELIVERIES=3; the rest stored",
    )
    outcome.assert_clean()


def test_a_poison_prompt_that_kills_its_worker_is_dead_lettered_after_max_deliveries(
    redis_url: str, tmp_path: Path, sim
) -> None:
    # Given a prompt that SIGKILLs every worker that generates it (an OOM, a segfault in a library).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(12)
    env = fast_env(settings, sim.url, max_deliveries=2)
    env["THINKFLEET_FAILPOINTS"] = "during_generate=kill:always@p00004"
    started = time.monotonic()
    worker = WorkerProcess("w1", env, tmp_path).start()
    kills = 0
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "killer", prompts)
        watch = InvariantWatch(settings, "killer").start()
        deadline = time.monotonic() + 150
        while _resolved(client, keys, "killer") < 12:
            assert time.monotonic() < deadline, f"not resolved: {job_progress(client, keys, 'killer')}"
            if not worker.alive():
                kills += 1
                worker.start().wait_ready(client, keys)  # a supervisor restarting it (compose: restart)
            time.sleep(0.2)
        watch.stop()
    finally:
        worker.terminate()
    watch.assert_held()
    dead = dead_letters(client, keys, "killer")
    assert set(dead) == {"p00004"}, dead
    assert dead["p00004"]["error_class"].startswith("poison:"), dead
    # A death cannot be pinned on one prompt: its first kill makes every prompt in flight a suspect (max 2), and
    # the suspects run together in one group (thinkfleet/state/ledger.py), halved at each death, so the culprit is
    # dead-lettered after max_deliveries + 1 + at most ⌊log2 12⌋ deaths, the last two alone in its group (the
    # bystanders of its kills are stored).
    assert 3 <= kills <= 2 + 1 + 3, kills
    outcome = check_job(settings, "killer", job.prompts, job.sampling_params, expected_dead={"p00004"})
    record_result(
        "poison prompt: kills its worker",
        outcome,
        "1 prompt SIGKILLs the worker on every delivery; the worker is restarted",
        [],
        time.monotonic() - started,
        notes=f"dead-lettered as poison:WorkerLost after {kills} kills (THINKFLEET_MAX_DELIVERIES=2, +1 alone, + "
        "halvings of its suspect group); the rest, its kills' bystanders included, stored",
    )
    outcome.assert_clean()


def test_output_unwritable_for_20s_keeps_rows_stops_consuming_and_finishes_clean(
    redis_url: str, tmp_path: Path, sim
) -> None:
    # Given a running job whose output directory stops accepting writes for 20 s.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    max_inflight = 8
    env = fast_env(settings, sim.url, max_inflight=max_inflight, storage_retry_max_s=2)
    started = time.monotonic()
    worker = WorkerProcess("w1", env, tmp_path).start()
    blocked: dict[str, float] = {}
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "unwritable", make_prompts(300))
        watch = InvariantWatch(settings, "unwritable").start()
        wait_until(lambda: job_progress(client, keys, "unwritable")["done"] >= 20, 120, what="20 rows stored")
        dataset_dir = Path(settings.output_uri) / "unwritable" / "dataset=synthetic"
        aside = tmp_path / "aside"
        # A regular file where the dataset directory was: every part write fails (root ignores chmod). Swapped in
        # one step: a move and then a write would let a part written in between make the directory again.
        aside.write_text("blocked")
        exchange_paths(aside, dataset_dir)
        # A part written just before the swap is durable (it moved aside with its directory) and may still be
        # finalized: count from the worker's first failed commit on, plus a moment for such a finalize.
        wait_until(lambda: "stopped consuming" in worker.log_path.read_text(), 60, what="the first failed commit")
        time.sleep(1.0)
        blocked["done_before"] = job_progress(client, keys, "unwritable")["done"]
        blocked["completed_before"] = float(sim_stats(sim.url)["completed"])
        time.sleep(20)
        blocked["completed_during"] = float(sim_stats(sim.url)["completed"]) - blocked["completed_before"]
        blocked["done_during"] = job_progress(client, keys, "unwritable")["done"] - blocked["done_before"]
        exchange_paths(aside, dataset_dir)  # the directory back, in one step too
        aside.unlink()
        wait_until(lambda: _resolved(client, keys, "unwritable") == 300, 240, what="all resolved")
        assert worker.alive()
        watch.stop()
    finally:
        worker.terminate()
    watch.assert_held()
    log = worker.log_path.read_text()
    # Then nothing was committed or acked while blocked, the worker stopped consuming, kept its rows in
    # memory (at most 2 × the in-flight bound generations completed meanwhile) and finished clean.
    assert blocked["done_during"] == 0, blocked
    assert blocked["completed_during"] <= 2 * max_inflight, blocked
    assert "stopped consuming" in log and "commits succeed again" in log
    assert dead_letters(client, keys, "unwritable") == {}
    outcome = check_job(settings, "unwritable", job.prompts, job.sampling_params)
    record_result(
        "output location unwritable for 20 s mid-run",
        outcome,
        "dataset directory replaced by a file for 20 s",
        [],
        time.monotonic() - started,
        notes=f"{int(blocked['completed_during'])} generations completed while blocked "
        f"(bound {2 * max_inflight}); rows kept in memory, consuming stopped, commit retried",
    )
    outcome.assert_clean()


def test_a_storage_failure_does_not_throw_away_generations(redis_url: str, tmp_path: Path, sim) -> None:
    """Every generation reaches storage exactly once: the simulator saw one generation per prompt."""
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    env = fast_env(settings, sim.url, max_inflight=4, storage_retry_max_s=0.5)
    env["THINKFLEET_FAILPOINTS"] = "before_part_write=raise:3"
    env["THINKFLEET_FAILPOINT_DIR"] = str(tmp_path)
    worker = WorkerProcess("w1", env, tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        before = int(sim_stats(sim.url)["completed"])
        job = submit_ids(settings, "keeprows", make_prompts(16))
        wait_until(lambda: _resolved(client, keys, "keeprows") == 16, 120, what="all resolved")
    finally:
        worker.terminate()
    assert int(sim_stats(sim.url)["completed"]) - before == 16, "a failed commit regenerated rows"
    assert len(list(tmp_path.glob("failpoint-before_part_write-*"))) == 3
    check_job(settings, "keeprows", job.prompts, job.sampling_params).assert_clean()


def test_a_worker_started_while_redis_restarts_waits_for_it_and_then_serves(tmp_path: Path, sim) -> None:
    # Given a queued job on a private Redis, which then goes down (the head node restarting).
    from testing.services import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    try:
        job = submit_ids(settings, "late-redis", make_prompts(4), max_new_tokens=64)
        client.save()  # the restart brings the job back
        server.stop()
        # When a worker starts while Redis is unreachable.
        worker = WorkerProcess("late", fast_env(settings, sim.url), tmp_path).start()
        try:
            wait_until(lambda: "not reachable yet" in worker.log_path.read_text(), 120, what="the worker waiting")
            assert worker.alive(), worker.tail(40)
            # Then once Redis is back, it starts and stores the whole job (nothing consumed before).
            server.start()
            worker.wait_ready(client, settings.keys, timeout_s=120)
            wait_until(lambda: job_progress(client, settings.keys, "late-redis")["done"] == 4, 120, what="the job")
        finally:
            worker.terminate()
        check_job(settings, "late-redis", job.prompts, job.sampling_params).assert_clean()
    finally:
        server.stop()
