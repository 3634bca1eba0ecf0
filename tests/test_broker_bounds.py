"""Every connection kombu opens has the state clients' bounds, and TLS follows a sentinel:// URL (issue 43).

Without a socket timeout, a health check and keepalive, a primary that stops answering without closing its sockets
(SIGSTOP, a frozen VM, a partition) held a worker's consumer thread for ever; ``sentinel://…?ssl=true`` gave the
state clients TLS and the broker plaintext. The real-process checks are tests/test_reliability_failover_frozen.py
and tests/test_broker_sentinel_tls.py; these read the configuration every process builds.
"""

from __future__ import annotations

import ssl

import pytest
from redis.sentinel import SentinelConnectionPool

from testing.services import RedisServer
from thinkfleet.broker.celery_app import PUBLISHER_SENTINEL_TRANSPORT, make_app
from thinkfleet.broker.transit import SENTINEL_TRANSPORT, enable_transit
from thinkfleet.broker.transit_sentinel import PublisherTransport, SentinelChannel, rechecked
from thinkfleet.redis_client import (
    MIN_SOCKET_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    RecheckedSentinelPool,
    SentinelConnection,
    SentinelSSLConnection,
    command_timeout_s,
    parse_sentinel,
    sync_client,
)
from thinkfleet.settings import Settings

HEAD = "sentinel://a:26379,b:26379/0?master=tf"


@pytest.mark.parametrize("lease_s", [4.0, 15.0, 60.0, 600.0])
def test_every_kombu_connection_times_out_well_within_the_lease(lease_s: float) -> None:
    app = make_app(Settings(redis_url="redis://127.0.0.1:6379/0", lease_s=lease_s))
    options = app.conf.broker_transport_options
    timeout = options["socket_timeout"]
    # A third of the lease (never below the floor a loaded Redis and the 1 s blocking pop need, nor above 20 s).
    assert timeout == max(MIN_SOCKET_TIMEOUT_S, min(SOCKET_TIMEOUT_S, lease_s / 3))
    assert timeout <= lease_s / 3 or timeout == MIN_SOCKET_TIMEOUT_S
    assert 0 < options["socket_connect_timeout"] <= timeout
    assert options["socket_keepalive"] is True and options["tcp_keepalive"]  # the probes, as text (Flower's stats)
    assert 1 <= options["health_check_interval"] <= timeout
    # The result backend's options are the same object Celery reads for the broker.
    assert app.conf.result_backend_transport_options["socket_timeout"] == timeout


def test_redis_timeout_s_overrides_the_derived_timeout_everywhere() -> None:
    settings = Settings(redis_url=HEAD, lease_s=60, redis_timeout_s=7)
    assert command_timeout_s(settings.lease_s, settings.redis_timeout_s) == 7
    assert make_app(settings).conf.broker_transport_options["socket_timeout"] == 7


def test_the_worker_s_sentinel_channel_takes_the_bounds_for_its_connections() -> None:
    # Given a worker's app on a Sentinel head (the transit transport over kombu's Sentinel pool),
    settings = Settings(redis_url=HEAD, lease_s=30)
    app = make_app(settings)
    enable_transit(app, settings, "w1")
    options = app.conf.broker_transport_options
    # Then its channel reads every bound from the transport options (kombu copies only the names its channel
    # lists into the connection parameters of the pop's and the commands' connections),
    assert app.conf.broker_transport == SENTINEL_TRANSPORT
    bounds = ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "tcp_keepalive")
    for name in (*bounds, "health_check_interval"):
        assert name in SentinelChannel.from_transport_options, name
    # with the values derived from the lease (30 s: 10 s, health checks every 5 s).
    bound = (options["socket_timeout"], options["socket_connect_timeout"], options["health_check_interval"])
    assert bound == (10, 5, 5)


def test_kombu_s_sentinel_pool_is_the_one_that_rechecks_the_primary() -> None:
    pool = SentinelConnectionPool("tf", sentinel_manager=None)
    assert isinstance(rechecked(pool), RecheckedSentinelPool)


def test_a_tls_sentinel_url_gives_the_broker_tls_with_its_ca() -> None:
    url = f"{HEAD}&ssl=true&ssl_ca_certs=/run/secrets/redis_tls_ca.crt"
    use_ssl = make_app(Settings(redis_url=url)).conf.broker_use_ssl
    assert use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/run/secrets/redis_tls_ca.crt"}
    relaxed = make_app(Settings(redis_url=f"{HEAD}&ssl=true&ssl_cert_reqs=none")).conf.broker_use_ssl
    assert relaxed == {"ssl_cert_reqs": ssl.CERT_NONE}
    assert make_app(Settings(redis_url=HEAD)).conf.broker_use_ssl is None


def test_sentinel_ssl_speaks_tls_to_the_sentinels_with_the_same_files() -> None:
    url = f"{HEAD}&ssl=true&sentinel_ssl=true&ssl_ca_certs=/ca.crt"
    kwargs = parse_sentinel(url).sentinel_kwargs()
    assert kwargs["ssl"] is True and kwargs["ssl_ca_certs"] == "/ca.crt"
    assert "ssl" not in parse_sentinel(f"{HEAD}&ssl=true").sentinel_kwargs()  # the Sentinels stay plaintext
    options = make_app(Settings(redis_url=url)).conf.broker_transport_options
    assert options["sentinel_kwargs"]["ssl"] is True


def test_a_unix_socket_url_opens_with_the_timeouts_and_no_tcp_keepalive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    socket_path = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "redis", extra=("--unixsocket", str(socket_path))).start()
    try:
        client = sync_client(f"unix://{socket_path}")
        assert client.ping()
        assert client.connection_pool.connection_kwargs["socket_timeout"] == SOCKET_TIMEOUT_S
    finally:
        server.stop()


def test_every_other_process_on_a_sentinel_head_gets_connections_that_ask_again() -> None:
    # The producer's publisher, Flower and `celery inspect` keep kombu's stock channel (no transit pop), with the
    # worker's Sentinel connections: a reconnect asks the Sentinels, and the pool is the rechecking one.
    app = make_app(Settings(redis_url=HEAD))
    assert app.conf.broker_transport == PUBLISHER_SENTINEL_TRANSPORT
    transport = app.connection_for_write().transport
    assert isinstance(transport, PublisherTransport)
    assert transport.Channel.connection_class is SentinelConnection
    assert transport.Channel.connection_class_ssl is SentinelSSLConnection
    assert make_app(Settings(redis_url="redis://127.0.0.1:6379/0")).conf.broker_transport is None
