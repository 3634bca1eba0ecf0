"""kombu's restore sweep on a promoted replica whose clock is 120 s ahead restores no live delivery.

Real parts, no workers: a primary and its replica (testing.sentinel.ShiftedClockRedis: the replica's wall clock,
its ``TIME``, runs 120 s ahead), and the worker's own broker channel (thinkfleet.broker.transit: QoS.append scores
each delivery, QoS.restore_visible is the sweep every worker's consumer runs). Deliveries are recorded on the
primary; the primary dies, the replica is promoted, and a fresh channel on it — as a worker's consumer reconnects
after a failover — sweeps before any renewal. On Redis's clock alone every delivery is then 120 s old, past its
30 s lease, and the sweep put them all back on the queue (what issue 43 found by review); the visibility clock
(thinkfleet/broker/visibility.py) re-bases the jump, and nothing is restored. The whole fleet over a Sentinel head:
tests/test_reliability_failover_clock.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kombu import Connection, Exchange, Producer, Queue

from testing.fleet import wait_until
from testing.redis_process import RedisProcess
from testing.sentinel import CC, ShiftedClockRedis
from testing.services import RedisServer
from thinkfleet.broker.keys import KombuKeys, kombu_transport_options
from thinkfleet.broker.transit import TRANSPORT
from thinkfleet.broker.visibility import clock_key

AHEAD_S = 120
LEASE_S = 30
PREFIX = "tfahead"
QUEUE = "ahead-q"
DELIVERIES = 4

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler for the clock-shifting preload (apt-get install gcc)")


def _channel(port: int) -> tuple[Connection, object]:
    options = {**kombu_transport_options(PREFIX, LEASE_S), "unacked_restore_throttle": 1}
    conn = Connection(f"redis://127.0.0.1:{port}/0", transport=TRANSPORT, transport_options=options)
    return conn, conn.channel()


def test_a_sweep_on_a_replica_promoted_120_s_ahead_restores_no_live_delivery(tmp_path: Path) -> None:
    RedisServer(tmp_path / "probe")  # fails (CI) or skips the test when redis-server is missing
    primary = RedisProcess(tmp_path / "primary").start()
    replica = ShiftedClockRedis(
        tmp_path / "replica", AHEAD_S, extra=("--replicaof", "127.0.0.1", str(primary.port))
    ).start()
    try:
        # Given deliveries recorded on the primary by the worker's channel (QoS.append, via basic_get)
        conn, channel = _channel(primary.port)
        queue = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
        queue(channel).declare()
        producer = Producer(channel, exchange=queue.exchange, routing_key=QUEUE)
        for n in range(DELIVERIES):
            producer.publish({"n": n})
        held = [channel.basic_get(QUEUE, no_ack=False) for _ in range(DELIVERIES)]  # type: ignore[attr-defined]
        assert all(held)
        kombu = KombuKeys(PREFIX)
        source = primary.client()
        assert source.zcard(kombu.unacked_index) == DELIVERIES
        # the replica has them (WAIT a second at a time, within the client's socket timeout: a replica's first sync on
        # a loaded box can take longer than one WAIT)
        wait_until(lambda: source.wait(1, 1_000) == 1, 120, what="the replica has the deliveries")
        # When the primary dies (the channel with it: closed only after, so its own restore finds no primary) and the
        # replica whose clock runs 120 s ahead is promoted
        primary.stop(kill=True)
        conn.release()
        promoted = replica.client()
        promoted.replicaof("NO", "ONE")
        wait_until(lambda: promoted.info("replication")["role"] == "master", 30, what="the replica promoted")
        assert promoted.time()[0] > time.time() + AHEAD_S - 30, "the replica's clock is not ahead"
        # and a reconnected consumer's restore sweep runs before any renewal
        conn, channel = _channel(replica.port)
        channel.qos.restore_visible(num=100, interval=1)  # type: ignore[attr-defined]
        # Then no delivery went back to the queue: each is still held, scored within a lease of the new clock
        assert promoted.llen(QUEUE) == 0, "live deliveries were restored by the clock jump"
        assert promoted.zcard(kombu.unacked_index) == DELIVERIES
        seconds, micros = promoted.time()
        oldest = min(score for _, score in promoted.zrange(kombu.unacked_index, 0, -1, withscores=True))
        assert seconds + micros / 1e6 - oldest < LEASE_S
        assert int(promoted.hget(clock_key(kombu.unacked_index), "jumps")) == 1
        conn.release()
    finally:
        replica.stop(kill=True)
        primary.stop(kill=True)
