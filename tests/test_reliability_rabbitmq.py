"""The core scenarios with RabbitMQ as the broker (job state stays in Redis): a happy path and a
SIGKILLed worker. Skipped when no RabbitMQ answers on 127.0.0.1:5672 (guest/guest) — failed instead
under CI (``.ci/run`` starts one).

Each test uses its own quorum queue (``workers.app`` declares quorum queues for amqp) and deletes it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection

from testing.fleet import RecoveryWatch, WorkerProcess, in_flight, job_progress, wait_until
from testing.harness import (
    check_job,
    fast_env,
    isolated_settings,
    make_prompts,
    record_result,
    simulator,
    submit_ids,
)
from testing.services import needs_service
from thinkfleet.settings import Settings

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _rabbitmq_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=0.5):
            return True
    except OSError:
        return False


pytestmark = needs_service(_rabbitmq_up(), "no RabbitMQ on 127.0.0.1:5672")  # under CI: fail, not skip


@pytest.fixture
def amqp_settings(redis_url: str, tmp_path: Path) -> Iterator[Settings]:
    settings = isolated_settings(redis_url, str(tmp_path / "out"), broker_url=AMQP_URL)
    yield settings
    with Connection(AMQP_URL) as conn:
        conn.default_channel.queue_delete(settings.queue)


def test_happy_path_over_rabbitmq(amqp_settings: Settings, tmp_path: Path) -> None:
    settings = amqp_settings
    client = redis.Redis.from_url(settings.redis_url)
    keys = settings.keys
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "400") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=8), tmp_path).start()
        try:
            worker.wait_ready(client, keys)
            job = submit_ids(settings, "rmq-happy", make_prompts(30))
            wait_until(lambda: job_progress(client, keys, "rmq-happy")["done"] == 30, 120, what="30 rows")
        finally:
            worker.terminate()
    outcome = check_job(settings, "rmq-happy", job.prompts, job.sampling_params)
    record_result("happy path", outcome, "none", [], time.monotonic() - started, broker="rabbitmq")
    outcome.assert_clean()
    assert "amqp://guest:**@" in worker.log_path.read_text()


def test_killed_worker_over_rabbitmq_loses_and_duplicates_nothing(amqp_settings: Settings, tmp_path: Path) -> None:
    settings = amqp_settings
    client = redis.Redis.from_url(settings.redis_url)
    keys = settings.keys
    started = time.monotonic()
    watches: list[RecoveryWatch] = []
    with simulator(tmp_path, "--time-scale", "20") as sim:
        env = fast_env(settings, sim, max_inflight=4)
        victim = WorkerProcess("victim", env, tmp_path).start()
        survivor = WorkerProcess("survivor", env, tmp_path).start()
        try:
            victim.wait_ready(client, keys)
            survivor.wait_ready(client, keys)
            job = submit_ids(settings, "rmq-kill", make_prompts(60))
            for threshold in (10, 30):
                wait_until(lambda t=threshold: job_progress(client, keys, "rmq-kill")["done"] >= t, 120, what="rows")
                wait_until(lambda: in_flight(client, keys, "rmq-kill", "victim"), 60, what="the victim busy")
                watches.append(RecoveryWatch(settings.redis_url, keys, "rmq-kill", "sigkill").start())
                victim.kill()
                victim.start().wait_ready(client, keys)
            wait_until(lambda: job_progress(client, keys, "rmq-kill")["done"] == 60, 240, what="60 rows")
        finally:
            victim.kill()
            survivor.terminate()
    outcome = check_job(settings, "rmq-kill", job.prompts, job.sampling_params)
    record_result(
        "worker SIGKILL ×2 (restarted each time)",
        outcome,
        "2 × SIGKILL of 1 of 2 workers",
        [w.stop() for w in watches],
        time.monotonic() - started,
        broker="rabbitmq",
        workers=2,
    )
    outcome.assert_clean()
