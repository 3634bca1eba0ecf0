"""A delivery's ack, reject, hand-back, close-time restore and renewal act on kombu's unacked entry only while the
entry is that delivery's (thinkfleet/broker/transit.py): kombu restores an expired message with its original delivery
tag, so a late outcome of the first delivery used to settle the entry of the second. Real Redis, the worker's own
transport on two connections (two workers), kombu's own restore sweep."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from kombu import Connection, Producer, Queue

from thinkfleet.broker.keys import KombuKeys, kombu_transport_options
from thinkfleet.broker.transit import LEFT_TO_HOLDER, Transport, split_delivery_tag
from thinkfleet.keys import Keys
from workers.lease import HeldMessages, LeaseKeeper


class Broker:
    """One queue under a fresh prefix; ``worker(name)`` opens a connection on our transport held by ``name``."""

    def __init__(self, redis_url: str) -> None:
        self.url = redis_url
        self.prefix, self.name = f"dh{uuid.uuid4().hex[:6]}", f"q{uuid.uuid4().hex[:6]}"
        self.keys = KombuKeys(self.prefix)
        self.client = redis.Redis.from_url(redis_url)
        self.queue = Queue(self.name, routing_key=self.name)
        self.connections: list[Connection] = []

    def worker(self, name: str) -> Any:
        options = {**kombu_transport_options(self.prefix, 60), "delivery_holder": name}
        conn = Connection(self.url, transport=Transport, transport_options=options)
        self.connections.append(conn)
        return conn.channel()

    def publish(self, channel: Any) -> None:
        Producer(channel).publish({"prompt": 1}, routing_key=self.name, declare=[self.queue])

    def get(self, channel: Any) -> Any:
        message = self.queue(channel).get(no_ack=False)
        assert message is not None
        return message

    def expire(self, channel: Any) -> None:
        """The visibility sweep restores every entry (as if its holder stopped renewing it a lease ago)."""
        self.client.zadd(self.keys.unacked_index, {t: 0 for t in self.client.zrange(self.keys.unacked_index, 0, -1)})
        channel.qos.restore_visible(num=100, interval=1)

    def entry(self) -> tuple[int, dict[bytes, bytes]]:
        return self.client.hlen(self.keys.unacked), self.client.hgetall(self.keys.unacked_holder)

    def close(self) -> None:
        for conn in self.connections:
            conn.release()
        self.client.delete(
            self.name, self.keys.unacked, self.keys.unacked_index, self.keys.unacked_holder, self.keys.unacked_mutex
        )


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    b = Broker(redis_url)
    yield b
    b.close()


def _taken_over(broker: Broker, taker: str = "b") -> tuple[Any, Any, Any, Any]:
    """A's delivery expired and restored (same kombu tag), the taker's delivery of the same message recorded."""
    a, b = broker.worker("a"), broker.worker(taker)
    broker.publish(a)
    first = broker.get(a)
    broker.expire(b)
    second = broker.get(b)
    assert split_delivery_tag(first.delivery_tag)[0] == split_delivery_tag(second.delivery_tag)[0], "same kombu tag"
    assert first.delivery_tag != second.delivery_tag, "each delivery has its own tag"
    return a, b, first, second


@pytest.mark.parametrize("late", ["ack", "reject", "hand-back"])
def test_a_late_outcome_of_a_restored_delivery_leaves_the_new_deliverys_entry(broker: Broker, late: str) -> None:
    _a, _b, first, second = _taken_over(broker)
    tag, holder = split_delivery_tag(second.delivery_tag)
    before = LEFT_TO_HOLDER[late]
    # When the first delivery's outcome arrives late (its worker was paused past its lease).
    if late == "ack":
        first.ack()
    else:
        first.reject(requeue=late == "hand-back")
    # Then the second delivery's entry is untouched, and nothing was pushed back onto the queue (no duplicate).
    assert broker.entry() == (1, {tag.encode(): holder.encode()})
    assert broker.client.llen(broker.name) == 0
    assert LEFT_TO_HOLDER[late] == before + 1
    # And when the second delivery is handed back, the message is on the queue again: nothing lost.
    second.reject(requeue=True)
    assert broker.entry() == (0, {})
    assert broker.client.llen(broker.name) == 1


def test_a_worker_restarted_under_the_same_name_is_another_holder(broker: Broker) -> None:
    # Given A's delivery expired and taken by a new life of A (restarted under the same name, e.g. after a Redis
    # rollback brought back the previous life's entries).
    _old, _new, first, second = _taken_over(broker, taker="a")
    # When the previous life's delivery is settled (its process still ran, or its ack was queued).
    first.ack()
    # Then the new life's entry stays; only its own ack settles it.
    assert broker.entry()[0] == 1
    second.ack()
    assert broker.entry() == (0, {})


def test_the_taker_dying_after_a_late_ack_leaves_its_entry_to_the_visibility_sweep(broker: Broker) -> None:
    a, _b, first, second = _taken_over(broker)
    first.ack()
    # When B dies without a word (its entry is no longer renewed), the sweep restores the message.
    broker.expire(a)
    assert broker.entry() == (0, {}), "the sweep drops the holder record with the entry"
    assert (
        json.loads(broker.client.lindex(broker.name, 0))["properties"]["delivery_tag"]
        == split_delivery_tag(second.delivery_tag)[0]
    )


def test_a_closing_channel_restores_only_its_own_deliveries(broker: Broker) -> None:
    a, b, _first, _second = _taken_over(broker)
    # When A's channel closes with its (superseded) delivery unsettled: kombu restores what it delivered.
    a.close()
    assert broker.entry()[0] == 1 and broker.client.llen(broker.name) == 0, "B's entry is not A's to restore"
    # B's close restores B's own delivery.
    b.close()
    assert broker.entry() == (0, {}) and broker.client.llen(broker.name) == 1


def test_a_second_delivery_of_one_message_to_the_same_worker_is_settled_only_by_itself(broker: Broker) -> None:
    a = broker.worker("a")
    broker.publish(a)
    first = broker.get(a)
    broker.expire(a)
    second = broker.get(a)  # the same worker takes its own restored message again
    first.ack()
    assert broker.entry()[0] == 1, "the first run's ack is not the second delivery's"
    second.ack()
    assert broker.entry() == (0, {}) and broker.client.llen(broker.name) == 0


def test_the_lease_renews_only_the_entries_its_deliveries_still_hold(broker: Broker, redis_url: str) -> None:
    _a, _b, first, second = _taken_over(broker)
    tag = split_delivery_tag(second.delivery_tag)[0]
    broker.client.zadd(broker.keys.unacked_index, {tag: 5})  # B's last renewal, long ago
    held = HeldMessages()
    held.add("task", str(first.delivery_tag))  # A still holds its (superseded) delivery

    async def beat(delivery: Any) -> None:
        held.add("task", str(delivery.delivery_tag))
        client = aioredis.Redis.from_url(redis_url)
        keeper = LeaseKeeper(client, Keys(broker.prefix), "a", 60, broker.keys.unacked_index, held, {})
        await keeper.beat()
        await client.aclose()

    # When A's lease keeper beats: B's entry is not A's to keep alive (B may be dead).
    asyncio.run(beat(first))
    assert broker.client.zscore(broker.keys.unacked_index, tag) == 5
    # B's own renewal does renew it.
    asyncio.run(beat(second))
    assert broker.client.zscore(broker.keys.unacked_index, tag) > 5


def test_a_holder_record_left_by_kombus_stock_sweep_is_pruned_by_ours(broker: Broker) -> None:
    # Given our delivery restored by a stock-kombu consumer's sweep (Flower's): it removes the entry, not its holder.
    a = broker.worker("a")
    broker.publish(a)
    broker.get(a)
    stock = Connection(broker.url, transport_options=kombu_transport_options(broker.prefix, 60))
    broker.connections.append(stock)
    broker.expire(stock.channel())
    assert broker.client.hlen(broker.keys.unacked) == 0 and broker.client.hlen(broker.keys.unacked_holder) == 1
    broker.client.delete(broker.name)  # (the restored message is taken care of elsewhere: not popped again here)
    # And another delivery live in B.
    b = broker.worker("b")
    broker.publish(b)
    live = split_delivery_tag(broker.get(b).delivery_tag)
    # When a worker's sweep runs: the record whose entry is gone goes too; the live entry's stays.
    b.qos.restore_visible(num=100, interval=1)
    assert broker.entry() == (1, {live[0].encode(): str(live[1]).encode()})
