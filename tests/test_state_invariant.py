"""The live invariant ``total = done + dead + queued + running``, against hand-built states in a real Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from producer.cli import cli
from thinkfleet.broker.envelope import Envelope
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.state import invariant
from thinkfleet.state.invariant import NotObservable, account

PLACES = ("queued", "transit", "unacked", "claimed", "done", "dead", "lost")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"), key_prefix="tinv", queue="qinv")


def task(job: str, pid: str, revision: int = 0) -> PromptTask:
    return PromptTask(job, "ds", pid, 0, f"h-{pid}", pack_ids([1, 2, 3]), revision=revision)


def register(r: redis.Redis, settings: Settings, job: str, pids: list[str]) -> None:
    r.hset(settings.keys.prompts(job), mapping={p: f"h-{p}" for p in pids})
    r.hset(settings.keys.prompt_dataset(job), mapping=dict.fromkeys(pids, "ds"))


def unacked_key(settings: Settings) -> str:
    return str(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"])


def build(r: redis.Redis, settings: Settings, job: str = "j") -> Envelope:
    """One prompt in each place, and ``lost`` in none (its claim's worker is dead)."""
    env = Envelope(settings)
    keys = settings.keys
    register(r, settings, job, [f"{p}" for p in PLACES])
    r.lpush(settings.queue, env.encode(task(job, "queued")))
    r.lpush(settings.queue, env.encode(task("other", "lost")))  # another job's prompt of the same name
    r.lpush(keys.transit("w1"), env.encode(task(job, "transit")))
    message = json.loads(env.encode(task(job, "unacked", revision=2)))
    r.hset(unacked_key(settings), "tag-1", json.dumps([message, "", settings.queue]))
    r.hset(keys.claims(job), "claimed", json.dumps({"worker": "alive", "part": None, "at": 0}))
    r.set(keys.heartbeat("alive"), "{}")
    r.hset(keys.claims(job), "lost", json.dumps({"worker": "gone", "part": None, "at": 0}))  # no heartbeat
    r.sadd(keys.done(job), "done")
    r.hset(keys.dead(job), "dead", "{}")
    return env


def test_each_place_accounts_for_its_prompt_and_only_the_lost_one_is_unaccounted(
    settings: Settings, redis_client: redis.Redis
) -> None:
    build(redis_client, settings)
    acc = account(redis_client, settings, "j")
    assert acc.unaccounted == {"lost"}
    assert not acc.ok
    assert (acc.queued, acc.transit, acc.unacked, acc.claimed) == ({"queued"}, {"transit"}, {"unacked"}, {"claimed"})
    assert (acc.done, acc.dead) == ({"done"}, {"dead"})
    assert acc.running == {"transit", "unacked", "claimed"}
    assert acc.counts() == {"total": 7, "done": 1, "dead": 1, "running": 3, "queued": 1, "unaccounted": 1}
    assert acc.passes == 2  # a prompt looked unaccounted, so it was looked for again
    assert acc.to_dict()["unaccounted_ids"] == ["lost"]


def test_a_message_back_on_the_queue_accounts_for_it(settings: Settings, redis_client: redis.Redis) -> None:
    env = build(redis_client, settings)
    redis_client.lpush(settings.queue, env.encode(task("j", "lost", revision=1)))
    acc = account(redis_client, settings, "j")
    assert acc.ok and acc.passes == 1
    assert acc.counts()["queued"] == 2


def test_a_finished_prompt_that_is_also_queued_is_a_redelivery_not_a_violation(
    settings: Settings, redis_client: redis.Redis
) -> None:
    env = Envelope(settings)
    register(redis_client, settings, "j", ["a", "b"])
    redis_client.sadd(settings.keys.done("j"), "a", "b")
    redis_client.lpush(settings.queue, env.encode(task("j", "a")))
    redis_client.lpush(settings.keys.transit("w"), env.encode(task("j", "b")))
    acc = account(redis_client, settings, "j")
    assert acc.ok
    assert acc.duplicated == {"a", "b"}
    assert acc.counts() == {"total": 2, "done": 2, "dead": 0, "running": 0, "queued": 0, "unaccounted": 0}


def test_priority_lists_odd_ids_and_hostile_items_on_the_queue(settings: Settings, redis_client: redis.Redis) -> None:
    env = Envelope(settings)
    odd = 'quo"te/ü\\x'  # JSON escapes: the Lua scan hands the message to Python's JSON parser
    register(redis_client, settings, "j", ["plain", "prio", odd])
    redis_client.lpush(settings.queue, b"\x80 not json", b'{"headers": 3}', env.encode(task("j", odd)))
    redis_client.lpush(f"{settings.queue}\x06\x163", env.encode(task("j", "prio")))
    redis_client.lpush(settings.queue, *[env.encode(task("x", f"n{i}")) for i in range(450)])  # > one Lua chunk
    redis_client.rpush(settings.queue, env.encode(task("j", "plain")))
    acc = account(redis_client, settings, "j")
    assert acc.queued == {"plain", "prio", odd}
    assert acc.ok


def test_a_prompt_moving_between_passes_is_not_reported(
    settings: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a prompt the first pass finds nowhere (it moved back and forth between two reads)…
    env = Envelope(settings)
    register(redis_client, settings, "j", ["moving", "gone"])

    def between_passes() -> None:  # …and that is back on the queue when the re-check runs.
        redis_client.lpush(settings.queue, env.encode(task("j", "moving")))

    monkeypatch.setattr(invariant, "_pause", between_passes)
    acc = account(redis_client, settings, "j")
    assert acc.unaccounted == {"gone"}
    assert acc.counts() == {"total": 2, "done": 0, "dead": 0, "running": 0, "queued": 1, "unaccounted": 1}


def test_without_recheck_one_pass_reports_what_it_saw(settings: Settings, redis_client: redis.Redis) -> None:
    register(redis_client, settings, "j", ["a"])
    acc = account(redis_client, settings, "j", recheck=False)
    assert acc.unaccounted == {"a"} and acc.passes == 1


def test_a_rabbitmq_broker_is_not_observable(settings: Settings, redis_client: redis.Redis) -> None:
    amqp = settings.with_overrides(broker_url="amqp://guest:guest@127.0.0.1:5672//")
    with pytest.raises(NotObservable):
        account(redis_client, amqp, "j")


def _verify(settings: Settings, *args: str) -> tuple[int, str]:
    env = {"THINKFLEET_KEY_PREFIX": settings.key_prefix, "THINKFLEET_QUEUE": settings.queue}
    result = CliRunner().invoke(cli, ["verify", "j", "--live", "--redis-url", settings.redis_url, *args], env=env)
    return result.exit_code, result.output


def test_verify_live_names_the_unaccounted_prompts(settings: Settings, redis_client: redis.Redis) -> None:
    env = build(redis_client, settings)
    code, out = _verify(settings)
    assert code == 1, out
    assert "UNACCOUNTED: 1" in out and "  lost" in out
    code, out = _verify(settings, "--json")
    report = json.loads(out)
    assert code == 1 and report["unaccounted"] == ["lost"] and report["counts"]["total"] == 7
    # When the lost prompt is re-enqueued, the invariant holds again.
    redis_client.lpush(settings.queue, env.encode(task("j", "lost")))
    code, out = _verify(settings)
    assert code == 0 and "OK" in out, out


def test_verify_live_cannot_check_an_unknown_job_or_a_rabbitmq_broker(settings: Settings) -> None:
    code, out = _verify(settings)
    assert code == 2 and "CANNOT CHECK" in out
    env = {"THINKFLEET_KEY_PREFIX": settings.key_prefix, "THINKFLEET_BROKER_URL": "amqp://guest:secret@h//"}
    redis.Redis.from_url(settings.redis_url).hset(settings.keys.prompts("j"), "a", "h")
    result = CliRunner().invoke(cli, ["verify", "j", "--live", "--redis-url", settings.redis_url], env=env)
    assert result.exit_code == 2 and "Unset THINKFLEET_BROKER_URL" in result.output  # refused before any check
    assert "secret" not in result.output
