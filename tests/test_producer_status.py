"""`producer status` and `producer wait` read what workers write: sets, unacked messages, timeline, alarm."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from producer.cli import cli
from producer.status_cmd import EXIT_INCONSISTENT, EXIT_TIMEOUT
from producer.submit import submit
from producer.submit_options import SubmitOptions
from testing.datasets import chat_rows, write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.settings import Settings


@pytest.fixture
def job(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Settings:
    """Job "j": alpha has 4 prompts, beta 2; a worker has finished some, holds one, dead-lettered one."""
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    paths = [write_jsonl(tmp_path / "alpha.jsonl", chat_rows(4, words=8)),
             write_jsonl(tmp_path / "beta.jsonl", chat_rows(2, words=8, seed=1))]  # fmt: skip
    submit(settings, SubmitOptions(paths=paths, job="j", tokenizer=str(tok), processes=1))
    k, r, now = settings.keys, redis_client, time.time()
    # A worker took alpha/r2 off the queue (kombu moved it to the unacked hash).
    queued = {json.loads(m)["headers"]["id"]: m for m in r.lrange(settings.queue, 0, -1)}
    r.lrem(settings.queue, 1, queued["j/alpha/r2/r0"])
    unacked = kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"]
    r.hset(unacked, "tag-1", json.dumps([json.loads(queued["j/alpha/r2/r0"]), "", settings.queue]))
    # Two rows committed 30 s ago, 3,000 output tokens; beta/r0 dead-lettered.
    r.sadd(k.done("j"), "alpha/r0", "alpha/r1")
    r.hset(k.counters("j"), mapping={"done": 2, "output_tokens": 3000})
    r.hset(k.worker_counters("j"), mapping={"w1": 2000, "w2": 1000})
    r.zadd(k.timeline("j"), {f"{now - 30:.6f}:2:3000": now - 30})
    r.hset(k.dead("j"), "beta/r0", json.dumps({"error_class": "context_overflow"}))
    return settings


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_status_json_counts_per_dataset_rates_and_eta(job: Settings) -> None:
    code, out = run("status", "j", "--json", "--redis-url", job.redis_url)
    assert code == 0, out
    st = json.loads(out)
    assert (st["total"], st["queued"], st["running"], st["done"], st["dead"]) == (6, 2, 1, 2, 1)
    assert st["datasets"]["alpha"] == {"total": 4, "queued": 1, "running": 1, "done": 2, "dead": 0, "unaccounted": 0}
    assert st["datasets"]["beta"] == {"total": 2, "queued": 1, "running": 0, "done": 0, "dead": 1, "unaccounted": 0}
    assert st["unaccounted"] == 0 and st["unaccounted_ids"] == []
    assert st["rates"]["output_tokens_per_s"] == pytest.approx(100, rel=0.05)  # 3,000 tokens in ~30 s
    assert st["mean_output_tokens"] == 1500
    assert st["eta_s"] == pytest.approx(3 * 1500 / 100, rel=0.05)  # remaining × mean ÷ tokens/s
    assert st["workers"]["w1"]["output_tokens"] == 2000
    assert st["alarm"] is None and st["finished"] is False
    assert st["queue_length"] == 5  # all jobs' messages, the dead one's included


def test_status_reports_a_prompt_that_is_nowhere_as_unaccounted_not_queued(
    job: Settings, redis_client: redis.Redis
) -> None:
    # Given alpha/r3's message gone from the queue while nothing stored, dead-lettered or holds it (a loss).
    for raw in redis_client.lrange(job.queue, 0, -1):
        if json.loads(raw)["headers"]["id"] == "j/alpha/r3/r0":
            redis_client.lrem(job.queue, 1, raw)
    # Then status counts it as unaccounted, names it, and "queued" counts only what is on the queue.
    code, out = run("status", "j", "--json", "--redis-url", job.redis_url)
    st = json.loads(out)
    assert (st["total"], st["queued"], st["running"], st["done"], st["dead"], st["unaccounted"]) == (6, 1, 1, 2, 1, 1)
    assert st["unaccounted_ids"] == ["alpha/r3"]
    assert st["datasets"]["alpha"]["unaccounted"] == 1 and st["datasets"]["alpha"]["queued"] == 0
    assert st["finished"] is False and st["remaining"] == 3
    # And the rich view shows it.
    code, out = run("status", "j", "--redis-url", job.redis_url)
    assert code == 0 and "UNACCOUNTED" in out and "alpha/r3" in out


def test_wait_exits_naming_prompts_that_stay_unaccounted(job: Settings, redis_client: redis.Redis) -> None:
    # Given a lost prompt (its message gone, nothing holds it): `producer wait` used to hang forever.
    for raw in redis_client.lrange(job.queue, 0, -1):
        if json.loads(raw)["headers"]["id"] == "j/alpha/r3/r0":
            redis_client.lrem(job.queue, 1, raw)
    args = ("wait", "j", "--lost-after", "0.3", "--interval", "0.1", "--timeout", "30", "--redis-url", job.redis_url)
    code, out = run(*args)
    # Then it exits 3 (inconsistent), not 124 (timeout), and names what is lost and the fix.
    assert code == EXIT_INCONSISTENT, out
    assert "alpha/r3" in out and "re-enqueues" in out


def test_status_refuses_a_broker_apart_from_the_job_state_redis(job: Settings) -> None:
    # A RabbitMQ broker cannot carry next turns and retries exactly (they are enqueued in Redis transactions).
    result = CliRunner().invoke(
        cli, ["status", "j", "--json", "--redis-url", job.redis_url], env={"THINKFLEET_BROKER_URL": "amqp://h//"}
    )
    assert result.exit_code == 2, result.output
    assert "amqp:// broker apart from THINKFLEET_REDIS_URL" in result.output
    assert "Unset THINKFLEET_BROKER_URL" in result.output


def test_status_shouts_when_the_reasoning_alarm_fired(job: Settings, redis_client: redis.Redis) -> None:
    redis_client.set(job.keys.alarm("j"), json.dumps({"rows": 100, "missing_think_end": 100}))
    code, out = run("status", "j", "--redis-url", job.redis_url)
    assert code == 0 and "REASONING ALARM" in out
    code, out = run("status", "j", "--json", "--redis-url", job.redis_url)
    assert json.loads(out)["alarm"] == {"rows": 100, "missing_think_end": 100}


def test_status_of_an_unknown_job(redis_url: str) -> None:
    code, out = run("status", "nope", "--json", "--redis-url", redis_url)
    assert code == 0 and json.loads(out)["exists"] is False
    code, out = run("wait", "nope", "--redis-url", redis_url, "--timeout", "1")
    assert code == 1


def test_wait_times_out_while_prompts_remain(job: Settings) -> None:
    code, out = run("wait", "j", "--json", "--timeout", "0.3", "--interval", "0.1", "--redis-url", job.redis_url)
    assert code == EXIT_TIMEOUT
    assert json.loads(out.splitlines()[0])["remaining"] == 3


def test_wait_returns_once_every_prompt_is_stored_or_dead(job: Settings, redis_client: redis.Redis) -> None:
    from storage.writer import PartWriter
    from testing.rows import make_row

    redis_client.sadd(job.keys.done("j"), "alpha/r2", "alpha/r3")
    redis_client.hset(job.keys.dead("j"), "beta/r1", "{}")
    args = ("wait", "j", "--json", "--timeout", "5", "--interval", "0.1", "--output-uri", job.output_uri,
            "--redis-url", job.redis_url)  # fmt: skip
    code, out = run(*args)
    assert code == EXIT_INCONSISTENT  # Redis says done, storage has none of them
    writer = PartWriter(job.output_uri, "w1")
    writer.write("j", "alpha", [make_row(f"alpha/r{i}", dataset="alpha", job="j") for i in range(4)])
    code, out = run(*args)
    assert code == 0, out
    st = json.loads(out.splitlines()[0])
    assert st["finished"] is True and st["missing_from_storage"] == 0
    assert (st["done"], st["dead"]) == (4, 2)
