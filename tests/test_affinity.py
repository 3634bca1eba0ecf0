"""Host affinity's moves in Redis (thinkfleet/broker/affinity.py), step by step against a real Redis: the finalize
offers a next turn on its worker's host list with its offer time, the worker's pop takes its host list first (step by
step, within job priorities) and the offer with it, and a sweep moves what waited too long — or the whole list of a
dead or stopping host — onto the consuming end of the shared list of its priority. Every reader of the broker (the
queue's lists, the live invariant, pause, purge) sees the host lists."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgpack
import redis
import redis.asyncio as aioredis

from testing.harness import isolated_settings, register_ids
from thinkfleet.broker.affinity import BLOCK_S, POP, HostAffinity, block_timeout, pop_keys
from thinkfleet.broker.envelope import Envelope
from thinkfleet.broker.keys import PRIORITY_SEP as PRIORITY_SEP_FOR_TESTS
from thinkfleet.broker.keys import host_lists, host_queue, priority_list
from thinkfleet.broker.queues import queue_keys, queue_length
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.state import lifecycle as lc
from thinkfleet.state.invariant import account
from thinkfleet.state.ledger import FinalRow, Ledger
from workers.turns import shared_prefix

JOB = "aff"


@dataclass(frozen=True)
class _Next:
    """What finalize.lua takes of a next turn (workers/turns.py NextTurn's fields)."""

    prompt_id: str
    answer: str
    next_prompt_id: str
    next_hash: str
    next_message: bytes
    drop: tuple[str, ...] = ()


def _settings(redis_url: str, tmp_path: Path, **overrides: object) -> Settings:
    return isolated_settings(redis_url, str(tmp_path / "out"), **overrides)


def _message(settings: Settings, pid: str, priority: int = 0) -> bytes:
    ids = [1, 2, 3, len(pid)]
    task = PromptTask(JOB, "ds", pid, 0, content_hash(ids), pack_ids(ids), prefix_reusable=2)
    return Envelope(settings, priority).encode(task)


class _Channel:
    """What :func:`pop_keys` reads of a transit channel (kombu's names for the priority lists)."""

    priority_steps = tuple(range(10))
    sep = PRIORITY_SEP_FOR_TESTS

    def __init__(self, settings: Settings, worker: str, idle_ms: str | None) -> None:
        self.affinity_key = host_queue(settings.queue, worker)
        self.affinity_offers = settings.keys.affinity_offers(settings.queue)
        self.transit_key = settings.keys.transit(worker)
        self.delivery_holder = worker
        self.affinity_idle_ms = idle_ms

    def priority(self, n: int) -> int:
        return n

    def _q_for_pri(self, queue: str, pri: int) -> str:
        return priority_list(queue, pri)


def _pop(client: redis.Redis, settings: Settings, worker: str, idle_ms: str | None = None) -> tuple[bytes, int] | None:
    """The transit channel's pop (affinity.POP) with the keys and arguments it sends."""
    out = client.eval(POP, *pop_keys(_Channel(settings, worker, idle_ms), settings.queue))
    return (out[0], int(out[1])) if out else None


def _offer(client: redis.Redis, settings: Settings, worker: str, message: bytes, age_s: float, step: int = 0) -> None:
    """A message offered ``age_s`` ago to ``worker``'s host list, as finalize.lua leaves it."""
    client.lpush(host_lists(settings.queue, worker)[step], message)
    tid = json.loads(message)["headers"]["id"]
    now = client.time()
    client.zadd(settings.keys.affinity_offers(settings.queue), {f"{worker}\n{tid}": now[0] + now[1] / 1e6 - age_s})


def test_a_finalized_turn_is_offered_on_its_workers_host_list_with_its_offer_time(
    redis_url: str, tmp_path: Path
) -> None:
    settings = _settings(redis_url, tmp_path)
    keys = settings.keys
    register_ids(settings, JOB, {"c/t0": [1, 2, 3]}, dataset="ds")
    message = _message(settings, "c/t1")
    host = host_lists(settings.queue, "w1")[0]
    offers = keys.affinity_offers(settings.queue)

    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, keys, "w1", 3)
        await client.set(keys.heartbeat("w1"), "1")
        assert (await ledger.claim(JOB, "c/t0")).state == "new"
        row = FinalRow("c/t0", 10, True, False, prefix_reusable=None)
        nxt = _Next("c/t0", json.dumps({"content": "a"}), "c/t1", "h1", message)
        done = await ledger.finalize(JOB, "ds", [row], 100, 0.9, [nxt], host, keys.turn_answers(JOB), offers=offers)
        assert done.new == 1
        await client.aclose()

    asyncio.run(scenario())
    client = redis.Redis.from_url(redis_url)
    assert client.lrange(host, 0, -1) == [message] and not client.llen(settings.queue)
    [(member, score)] = client.zrange(offers, 0, -1, withscores=True)
    assert member == f"w1\n{JOB}/c/t1/r0".encode()
    assert abs(score - (client.time()[0] + client.time()[1] / 1e6)) < 30  # Redis's clock
    assert client.hexists(keys.prompts(JOB), "c/t1"), "the next turn joined the job as it was offered"


def test_finalize_counts_a_later_turns_reusable_prefix_and_its_cached_part(redis_url: str, tmp_path: Path) -> None:
    settings = _settings(redis_url, tmp_path)
    keys = settings.keys
    register_ids(settings, JOB, {"c/t1": [1], "c/t2": [2], "d/t1": [3]}, dataset="ds")

    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, keys, "w1", 3)
        await client.set(keys.heartbeat("w1"), "1")
        for pid in ("c/t1", "c/t2", "d/t1"):
            assert (await ledger.claim(JOB, pid)).state == "new"
        rows = [
            FinalRow("c/t1", 5, True, False, prefix_reusable=100, cached_tokens=96),
            FinalRow("c/t2", 5, True, False, prefix_reusable=50, cached_tokens=80),  # capped at the reusable 50
            FinalRow("d/t1", 5, True, False, prefix_reusable=40, cached_tokens=None),  # not reported: not counted
        ]
        await ledger.finalize(JOB, "ds", rows, 100, 0.9)
        await ledger.finalize(JOB, "ds", rows[:1], 100, 0.9)  # a retried finalize counts nothing twice
        await client.aclose()

    asyncio.run(scenario())
    counters = redis.Redis.from_url(redis_url).hgetall(keys.counters(JOB))
    assert int(counters[b"prefix_turns"]) == 2
    assert int(counters[b"prefix_reusable_tokens"]) == 150 and int(counters[b"prefix_cached_tokens"]) == 146


def test_a_worker_pops_its_host_list_first_within_each_priority_and_takes_the_offer_along(
    redis_url: str, tmp_path: Path
) -> None:
    settings = _settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url)
    offers = settings.keys.affinity_offers(settings.queue)
    turn0 = _message(settings, "n/t0")
    client.lpush(settings.queue, turn0)
    _offer(client, settings, "w1", first := _message(settings, "c/t1"), 0.0)
    _offer(client, settings, "w1", second := _message(settings, "d/t1"), 0.0)
    _offer(client, settings, "w2", theirs := _message(settings, "e/t1"), 0.0)
    low = _message(settings, "low/t1", priority=5)
    _offer(client, settings, "w1", low, 0.0, step=5)

    assert _pop(client, settings, "w1") == (first, 1), "its own host list before a new turn 0, oldest first"
    assert _pop(client, settings, "w1") == (second, 1)
    assert _pop(client, settings, "w1") == (turn0, 0), "a job of higher priority before its lower-priority offer"
    assert _pop(client, settings, "w1") == (low, 1)
    assert _pop(client, settings, "w1") is None, "never another host's list"
    assert client.llen(settings.keys.transit("w1")) == 4, "every pop is a move into its transit list"
    assert [m.split(b"\n")[0] for m in client.zrange(offers, 0, -1)] == [b"w2"], "the pops took their offers along"
    assert client.lrange(host_lists(settings.queue, "w2")[0], 0, -1) == [theirs]


def test_a_worker_holding_deliveries_blocks_briefly_on_the_queue_to_look_at_its_host_list_again() -> None:
    qos = SimpleNamespace(_delivered={"a": 1, "b": 2}, _dirty={"a"})
    chan = SimpleNamespace(brpop_timeout=1, affinity_block="1", qos=qos)
    assert block_timeout(chan, None) == BLOCK_S, "a delivery held: its next turn may land on the host list"
    qos._dirty = {"a", "b"}
    assert block_timeout(chan, None) == 1, "nothing held (acked ones aside): nothing of ours can be offered"
    qos._dirty, chan.affinity_block = set(), ""
    assert block_timeout(chan, None) == 1, "a worker that does not offer to itself blocks as kombu does"


def test_an_idle_worker_takes_another_hosts_offer_once_it_waited_its_idle_wait(redis_url: str, tmp_path: Path) -> None:
    settings = _settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url)
    _offer(client, settings, "busy", fresh := _message(settings, "a/t1"), 0.0)
    _offer(client, settings, "busy", waited := _message(settings, "b/t1", priority=2), 2.0, step=2)
    client.lpush(settings.queue, turn0 := _message(settings, "n/t0", priority=9))
    assert _pop(client, settings, "other", "1000") == (turn0, 0), "the queue first, even its lowest priority"
    assert _pop(client, settings, "other") is None, "without an idle wait a worker never steals"
    assert _pop(client, settings, "other", "1000") == (waited, 2), "the offer older than the idle wait"
    assert _pop(client, settings, "other", "1000") is None, "a fresh offer stays with its host"
    assert _pop(client, settings, "busy", "1000") == (fresh, 1)
    assert not client.zcard(settings.keys.affinity_offers(settings.queue)), "the offers left with their messages"


def test_a_sweep_moves_stale_offers_and_dead_hosts_lists_to_the_consuming_end_of_the_shared_queue(
    redis_url: str, tmp_path: Path
) -> None:
    settings = _settings(redis_url, tmp_path, affinity_wait_s=5.0)
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    offers = keys.affinity_offers(settings.queue)
    for w in ("me", "alive"):
        client.set(keys.heartbeat(w), "1")
    client.lpush(settings.queue, waiting := _message(settings, "n/t0"))
    _offer(client, settings, "alive", old := _message(settings, "a/t1"), 60.0)
    _offer(client, settings, "alive", fresh := _message(settings, "b/t1"), 0.0)
    _offer(client, settings, "dead", gone_host := _message(settings, "c/t1", priority=3), 0.0, step=3)
    client.lpush(host_lists(settings.queue, "dead")[0], unknown := _message(settings, "d/t1"))  # no offer recorded
    client.zadd(offers, {"alive\njob/gone/r0": 1.0})  # an offer whose message left another way (a purge)

    async def sweep() -> tuple[int, int]:
        aclient = aioredis.from_url(redis_url)
        try:
            return await HostAffinity(aclient, settings, "me").sweep()
        finally:
            await aclient.aclose()

    by_age, by_owner = asyncio.run(sweep())
    assert (by_age, by_owner) == (1, 2)
    # The stale one waits at the consuming (right) end, before the turn 0 queued earlier; the fresh one stays offered.
    assert client.lrange(settings.queue, 0, -1) == [waiting, old, unknown]
    assert client.lrange(priority_list(settings.queue, 3), 0, -1) == [gone_host], "onto the list of its priority"
    assert client.lrange(host_lists(settings.queue, "alive")[0], 0, -1) == [fresh]
    assert [m.split(b"\n")[1] for m in client.zrange(offers, 0, -1)] == [f"{JOB}/b/t1/r0".encode()]
    assert not client.exists(*host_lists(settings.queue, "dead"))


def test_a_host_that_stops_consuming_hands_its_list_back_and_offers_to_the_shared_queue(
    redis_url: str, tmp_path: Path
) -> None:
    settings = _settings(redis_url, tmp_path, affinity_backlog=2)
    client = redis.Redis.from_url(redis_url)
    client.set(settings.keys.heartbeat("me"), "1")
    _offer(client, settings, "me", mine := _message(settings, "a/t1"), 0.0)
    accepting = [True]

    async def scenario() -> tuple[list[str], tuple[int, int]]:
        aclient = aioredis.from_url(redis_url)
        try:
            affinity = HostAffinity(aclient, settings, "me", lambda: accepting[0])
            places = [(await affinity.place(0)).queue]
            client.lpush(host_lists(settings.queue, "me")[0], b"x")  # two waiting: the backlog bound
            places.append((await affinity.place(0)).queue)
            client.lrem(host_lists(settings.queue, "me")[0], 1, b"x")
            accepting[0] = False  # draining, server down or storage failing
            places.append((await affinity.place(0)).queue)
            return places, await affinity.sweep()
        finally:
            await aclient.aclose()

    places, moved = asyncio.run(scenario())
    assert places == [host_queue(settings.queue, "me"), settings.queue, settings.queue]
    assert moved == (0, 1) and client.lrange(settings.queue, 0, -1) == [mine]


def test_turning_affinity_off_or_a_broker_without_transit_offers_nothing(redis_url: str, tmp_path: Path) -> None:
    async def place(settings: Settings, transit: bool) -> str:
        aclient = aioredis.from_url(redis_url)
        try:
            return (await HostAffinity(aclient, settings, "me", transit=transit).place(4)).queue
        finally:
            await aclient.aclose()

    off = _settings(redis_url, tmp_path, affinity=False)
    assert asyncio.run(place(off, True)) == priority_list(off.queue, 4)
    on = _settings(redis_url, tmp_path)
    assert asyncio.run(place(on, False)) == priority_list(on.queue, 4)
    assert asyncio.run(place(on, True)) == priority_list(host_queue(on.queue, "me"), 4)


def test_every_reader_of_the_queue_and_every_operator_sees_the_host_lists(redis_url: str, tmp_path: Path) -> None:
    settings = _settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url)
    _job, tasks = register_ids(settings, JOB, {"c/t0": [1, 2], "c/t1": [3, 4]}, dataset="ds")
    env = Envelope(settings)
    client.lpush(settings.queue, env.encode(tasks[0]))
    client.lpush(host_lists(settings.queue, "w1")[2], env.encode(tasks[1]))
    assert queue_keys(client, settings.queue) == [host_lists(settings.queue, "w1")[2], settings.queue]
    assert queue_length(client, settings.queue) == 2
    acc = account(client, settings, JOB)
    assert acc.queued == {"c/t0", "c/t1"} and not acc.unaccounted
    assert lc.pause(client, settings, JOB) == 2, "pause parks the offered message too"
    assert not client.exists(*host_lists(settings.queue, "w1"))
    assert lc.resume(client, settings, JOB) == 2 and client.llen(settings.queue) == 2  # back onto the shared queue
    client.delete(settings.queue)
    client.lpush(host_lists(settings.queue, "w2")[0], env.encode(tasks[1]))
    assert lc.cancel(client, settings, JOB) == 1, "cancel dead-letters an offered message"
    assert client.hexists(settings.keys.dead(JOB), "c/t1") and not client.exists(*host_lists(settings.queue, "w2"))
    client.lpush(host_lists(settings.queue, "w3")[0], env.encode(tasks[0]))
    lc.purge(client, settings, JOB)
    assert not client.exists(*host_lists(settings.queue, "w3")), "purge takes an offered message too"


def test_a_later_turns_reusable_prefix_rides_in_its_message_signed_or_not(tmp_path: Path) -> None:
    task = PromptTask(JOB, "ds", "c/t1", 0, content_hash([1]), pack_ids([1]), prefix_reusable=4321)
    assert PromptTask.from_args(task.to_args()).prefix_reusable == 4321
    assert PromptTask.from_args(PromptTask(JOB, "ds", "c/t0", 0, "h", b"\x00").to_args()).prefix_reusable is None
    key = tmp_path / "key"
    key.write_text("k" * 64)
    signed = Settings(signing_key_file=str(key))
    body = json.loads(Envelope(signed).encode(task))["body"]
    args = msgpack.unpackb(base64.b64decode(body), raw=False)[0]
    assert len(args) == 12 and args[10] and args[11] == 4321
    assert shared_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and shared_prefix([1, 2], [1, 2, 3]) == 2
