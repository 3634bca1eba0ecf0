"""Secure defaults: only json/msgpack is ever deserialized, hostile or broken messages are refused and
logged without hurting the worker, Redis passwords work and never reach a log, and ``rediss://`` is
accepted with certificate verification on.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import redis

from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, simulator, submit_ids
from testing.record import check_job, record_result
from testing.services import REDIS_SERVER, free_port, service_missing, wait_for_port
from thinkfleet.message import TASK_NAME
from thinkfleet.settings import Settings
from workers.app import make_app


class _Exploit:
    """Unpickling this creates ``path``: proof that a worker deserialized pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def _push_hostile_messages(settings: Settings, client: redis.Redis, canary: Path) -> None:
    app = make_app(settings, register=False)
    with app.producer_or_acquire() as producer:
        # A pickle message (Celery would run its reduce on load).
        app.send_task(TASK_NAME, args=[_Exploit(canary)], serializer="pickle", producer=producer, queue=settings.queue)
        # A msgpack message with the wrong number of arguments.
        app.send_task(
            TASK_NAME, args=["job", "only-two"], task_id="wrong-arity", producer=producer, queue=settings.queue
        )
        # A message whose msgpack body is garbage.
        producer.publish(
            b"\xc1\xc1 not msgpack",
            exchange=settings.queue,
            routing_key=settings.queue,
            content_type="application/x-msgpack",
            content_encoding="binary",
            headers={"lang": "py", "task": TASK_NAME, "id": "garbage-body", "argsrepr": "()", "kwargsrepr": "{}"},
        )
    # Not even a kombu envelope.
    client.lpush(settings.queue, b"\x00\xffnot json at all")


def test_hostile_and_malformed_messages_are_refused_and_the_worker_keeps_working(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a worker, and hostile or broken messages ahead of a real job on its queue.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    canary = tmp_path / "pickle-was-loaded"
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "400") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim), tmp_path)
        _push_hostile_messages(settings, client, canary)
        worker.start()
        try:
            worker.wait_ready(client, keys)
            job = submit_ids(settings, "after", make_prompts(10))
            wait_until(lambda: job_progress(client, keys, "after")["done"] == 10, 120, what="10 rows")
            assert worker.alive() and worker.starts == 1, "no hostile message took the worker down"
        finally:
            worker.terminate()
    log = worker.log_path.read_text(errors="replace")
    # Then none was deserialized by pickle, each was refused with a log line, and the real job is whole.
    assert not canary.exists(), "a pickle message was deserialized"
    assert "untrusted content" in log and "pickle" in log
    assert "malformed message wrong-arity dead-lettered" in log
    malformed = [json.loads(raw) for raw in client.lrange(keys.malformed, 0, -1)]
    assert [m["message_id"] for m in malformed] == ["wrong-arity"] and "9 args" in malformed[0]["error"]
    assert "garbage-body" in log
    assert client.llen(settings.queue) == 0, "every hostile message left the queue"
    outcome = check_job(settings, "after", job.prompts, job.sampling_params)
    record_result(
        "hostile messages: pickle, wrong arity, garbage body, non-JSON",
        outcome,
        "4 bad messages ahead of a 10-prompt job",
        [],
        time.monotonic() - started,
        notes="all refused and logged; pickle never loaded; worker never restarted",
    )
    outcome.assert_clean()


@pytest.fixture
def password_redis(tmp_path: Path):
    if REDIS_SERVER is None:
        service_missing("redis-server is not installed")
    port, password = free_port(), "s3cr3t-Pa55-7f0e"
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--requirepass", password, "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)
        yield f"redis://:{password}@127.0.0.1:{port}/0", password
    finally:
        proc.kill()
        proc.wait(10)


def test_password_protected_redis_works_and_the_password_never_reaches_a_log(password_redis, tmp_path: Path) -> None:
    url, password = password_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url.replace(password, "wrong")).ping()
    settings = isolated_settings(url, str(tmp_path / "out"))
    client = redis.Redis.from_url(url)
    keys = settings.keys
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "400") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path).start()
        try:
            worker.wait_ready(client, keys)
            job = submit_ids(settings, "auth", make_prompts(10))
            wait_until(lambda: job_progress(client, keys, "auth")["done"] == 10, 120, what="10 rows")
        finally:
            worker.terminate()
    outcome = check_job(settings, "auth", job.prompts, job.sampling_params)
    status = producer_cli(settings, "status", "auth", in_process=True)
    log = worker.log_path.read_text(errors="replace")
    record_result(
        "Redis with requirepass (redis://:password@)",
        outcome,
        "none; the password must not appear in any log",
        [],
        time.monotonic() - started,
    )
    outcome.assert_clean()
    assert ":**@127.0.0.1" in log, "Celery shows the broker URL masked"
    for text in (log, status.stdout, status.stderr):
        assert password not in text


def test_rediss_urls_are_accepted_with_certificate_verification() -> None:
    settings = Settings(redis_url="rediss://:pw@redis.example:6380/0")
    assert settings.broker_url == settings.redis_url
    app = make_app(settings, register=False)
    conn = app.connection_for_write()
    assert conn.transport_cls == "rediss"
    assert conn.ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}, "TLS without verification is never the default"
    relaxed = make_app(Settings(redis_url="rediss://redis.example:6380/0?ssl_cert_reqs=none"), register=False)
    assert relaxed.connection_for_write().ssl == {"ssl_cert_reqs": ssl.CERT_NONE}
    import redis.asyncio as aioredis

    pool = aioredis.from_url(settings.redis_url).connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert json.dumps(app.conf.accept_content) == '["msgpack", "json"]'
