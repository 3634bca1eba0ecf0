"""A message's outcome that reaches a channel Celery already closed (the broker connection was lost — Redis
restarted — while the prompt ran) must neither stop the worker nor lose the message: kombu's own ack there raised
``AttributeError`` out of the event loop ("Unrecoverable error": the worker process exited). Real Redis, the
worker's own transport (thinkfleet/broker/transit.py)."""

from __future__ import annotations

import uuid

import pytest
import redis
from kombu import Connection, Producer, Queue

from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.broker.transit import Transport


def _delivered(redis_url: str, prefix: str, name: str) -> tuple[Connection, object]:
    options = kombu_transport_options(prefix, 60)
    conn = Connection(redis_url, transport=Transport, transport_options=options)
    channel = conn.channel()
    queue = Queue(name, routing_key=name)
    Producer(channel).publish({"prompt": 1}, routing_key=name, declare=[queue])
    message = queue(channel).get(no_ack=False)
    assert message is not None
    return conn, message


def _lose_connection(conn: Connection) -> object:
    """As Celery's reconnect leaves the old channel: its connection has no client to build a pool from any more."""
    channel = next(iter(conn.transport.channels))
    channel.connection.client = None
    channel._disconnect_pools()
    return channel


@pytest.mark.parametrize("outcome", ["ack", "hand-back"])
def test_an_outcome_after_the_channel_closed_is_skipped_and_the_message_is_kept(redis_url: str, outcome: str) -> None:
    prefix, name = f"cc{uuid.uuid4().hex[:6]}", f"q{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(redis_url)
    options = kombu_transport_options(prefix, 60)
    conn, message = _delivered(redis_url, prefix, name)
    assert client.hlen(str(options["unacked_key"])) == 1, "delivered: recorded as unacked"
    # When the broker connection is lost and closed while the prompt runs, and its outcome arrives afterwards.
    _lose_connection(conn).close()
    if outcome == "ack":
        message.ack()  # raised AttributeError ('NoneType' … 'client') out of kombu's event loop
    else:
        message.reject(requeue=True)
    # Then nothing raised, and the message is still in the unacked hash: the sweep redelivers it (nothing lost).
    assert client.hlen(str(options["unacked_key"])) == 1
    client.delete(name, str(options["unacked_key"]), str(options["unacked_index_key"]))


def test_a_restore_that_finds_no_connection_at_close_leaves_the_message_to_the_sweep(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefix, name = f"cc{uuid.uuid4().hex[:6]}", f"q{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(redis_url)
    unacked = str(kombu_transport_options(prefix, 60)["unacked_key"])
    conn, _message = _delivered(redis_url, prefix, name)
    _lose_connection(conn).close()  # kombu's restore raised "'NoneType' object has no attribute 'hostname'" here
    # The message stays in the unacked hash: the visibility sweep redelivers it after the lease.
    assert client.hlen(unacked) == 1
    assert "could not restore 1 delivered message" in caplog.text
    client.delete(name, unacked, str(kombu_transport_options(prefix, 60)["unacked_index_key"]))


def test_a_delivery_whose_unacked_record_fails_stays_in_transit(redis_url: str) -> None:
    # Given a worker's channel popping through its transit list (thinkfleet/broker/transit.py).
    prefix, name = f"cc{uuid.uuid4().hex[:6]}", f"q{uuid.uuid4().hex[:6]}"
    transit = f"{prefix}:transit:w1"
    client = redis.Redis.from_url(redis_url)
    options = {**kombu_transport_options(prefix, 60), "transit_key": transit, "transit_queue": name}
    queue = Queue(name, routing_key=name)
    with Connection(redis_url, transport=Transport, transport_options=options) as conn:
        Producer(conn.channel()).publish({"prompt": 1}, routing_key=name, declare=[queue])
        channel = conn.channel()
        received: list[object] = []
        consumer = conn.Consumer(queue, channel=channel, callbacks=[lambda body, message: received.append(body)])
        consumer.consume()

        # When Redis fails the write that records the delivery as unacked (kombu's QoS.append).
        def fail(message: object, delivery_tag: object) -> None:
            raise redis.exceptions.ConnectionError("Redis went away while recording the delivery")

        channel.qos.append = fail  # type: ignore[method-assign]
        with pytest.raises(redis.exceptions.ConnectionError):
            conn.drain_events(timeout=10)
        # Then the message was never handed to the consumer and is still in the transit list (the sweep returns
        # it to the queue), not only in this process's memory: it used to be removed from transit regardless.
        assert received == []
        assert client.llen(transit) == 1 and not client.llen(name)
        assert not client.hlen(str(options["unacked_key"]))
    client.delete(name, transit, str(options["unacked_key"]), str(options["unacked_index_key"]))
