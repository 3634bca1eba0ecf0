"""One URL decides the topology (thinkfleet/redis_client.py): ``sentinel://`` URLs parse with a clear error for each
mistake, and become kombu's form for the broker; a worker's broker keeps the transit transport over Sentinel."""

from __future__ import annotations

import pytest
from celery import Celery

from thinkfleet.broker.celery_app import configure
from thinkfleet.broker.transit import SENTINEL_TRANSPORT, TRANSPORT, enable_transit
from thinkfleet.redis_client import (
    RedisUrlError,
    is_sentinel,
    kombu_broker,
    parse_sentinel,
    redacted,
    with_password,
    with_sentinel_password,
)
from thinkfleet.settings import Settings

URL = "sentinel://worker:s3cret@h1:26379,h2:26380,[::1]:26381/2?master=tf&sentinel_password=sp"


def test_a_sentinel_url_names_every_sentinel_the_primary_and_both_passwords() -> None:
    s = parse_sentinel(URL)
    assert s.sentinels == [("h1", 26379), ("h2", 26380), ("::1", 26381)]
    assert (s.master, s.db, s.username, s.password) == ("tf", 2, "worker", "s3cret")
    assert s.sentinel_kwargs()["password"] == "sp"
    assert s.connection_kwargs() == {"db": 2, "username": "worker", "password": "s3cret"}
    assert is_sentinel(URL) and not is_sentinel("redis://h:6379/0")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sentinel://h1:26379/0", "?master=NAME"),
        ("sentinel:///0?master=tf", "names no Sentinel"),
        ("sentinel://h1/0?master=tf", "is not HOST:PORT"),
        ("sentinel://h1:26379/zero?master=tf", "is not a number"),
    ],
)
def test_a_wrong_sentinel_url_says_what_to_write(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError, match=says.replace("?", r"\?")):
        parse_sentinel(url)


def test_kombu_gets_one_url_per_sentinel_with_the_primary_s_credentials_and_its_name() -> None:
    broker, options = kombu_broker(URL)
    assert (
        broker
        == "sentinel://worker:s3cret@h1:26379/2;sentinel://worker:s3cret@h2:26380/2;sentinel://worker:s3cret@[::1]:26381/2"
    )
    assert options["master_name"] == "tf" and options["sentinel_kwargs"]["password"] == "sp"
    assert kombu_broker("redis://h:6379/0") == ("redis://h:6379/0", {})


def test_passwords_are_set_and_hidden_in_sentinel_urls_too() -> None:
    assert (
        with_password("sentinel://worker@h1:1,h2:2/0?master=tf", "pw") == "sentinel://worker:pw@h1:1,h2:2/0?master=tf"
    )
    shown = redacted(URL)
    assert "s3cret" not in shown and "=sp" not in shown and "h2:26380" in shown


def test_the_sentinels_password_comes_from_its_file_into_the_url_and_the_broker(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Given the primary's and the Sentinels' passwords in files (secrets: never in the environment or the URL).
    (tmp_path / "worker").write_text("w" * 24 + "\n")
    (tmp_path / "sentinels").write_text("s&=/" + "x" * 20 + "\n")  # characters a query must escape
    monkeypatch.setenv("THINKFLEET_REDIS_URL", "sentinel://worker@h1:26379,h2:26379/0?master=tf&sentinel_password=old")
    monkeypatch.setenv("THINKFLEET_REDIS_PASSWORD_FILE", str(tmp_path / "worker"))
    monkeypatch.setenv("THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE", str(tmp_path / "sentinels"))
    settings = Settings()
    # Then each password reaches its own servers: the primary's on the connections, the Sentinels' on theirs.
    s = parse_sentinel(settings.redis_url)
    assert (s.username, s.password, s.sentinel_password) == ("worker", "w" * 24, "s&=/" + "x" * 20)
    assert s.master == "tf" and settings.broker_url == settings.redis_url
    broker, options = kombu_broker(str(settings.broker_url))
    assert options["sentinel_kwargs"]["password"] == "s&=/" + "x" * 20 and "sentinel_password" not in broker
    # And neither shows in what is logged; a CLI override keeps both; a redis:// URL is left alone.
    assert "x" * 20 not in redacted(settings.redis_url) and "w" * 24 not in redacted(settings.redis_url)
    moved = settings.with_overrides(redis_url="sentinel://worker@h3:26379/0?master=tf")
    assert parse_sentinel(moved.redis_url).sentinel_password == "s&=/" + "x" * 20
    assert parse_sentinel(moved.redis_url).password == "w" * 24
    assert with_sentinel_password("redis://h:6379/0", "pw") == "redis://h:6379/0"


def test_an_unreadable_sentinel_password_file_is_named(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("THINKFLEET_REDIS_URL", "sentinel://h1:26379/0?master=tf")
    monkeypatch.setenv("THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE: cannot read .*missing"):
        Settings()


def test_a_worker_on_a_sentinel_head_keeps_the_transit_transport_and_asks_every_sentinel() -> None:
    settings = Settings(redis_url="sentinel://127.0.0.1:26379,127.0.0.1:26380/0?master=tf")
    app = configure(Celery("t"), settings)
    assert app.conf.broker_url.count(";") == 1  # the stock transport (producer, Flower) fails over between them
    assert app.conf.broker_transport_options["master_name"] == "tf"
    enable_transit(app, settings, "w1")
    # One URL (kombu's switch to the next would take its scheme, the stock transport), every Sentinel in options.
    assert app.conf.broker_url == "sentinel://127.0.0.1:26379/0"
    assert app.conf.broker_transport == SENTINEL_TRANSPORT
    assert len(app.conf.broker_transport_options["sentinel_urls"]) == 2
    plain = configure(Celery("t"), Settings(redis_url="redis://127.0.0.1:6379/0"))
    enable_transit(plain, Settings(redis_url="redis://127.0.0.1:6379/0"), "w1")
    assert plain.conf.broker_transport == TRANSPORT


def test_clients_that_only_read_follow_a_failover(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Given sync and asyncio clients on a Sentinel head, connected to its primary. (A graceful failover also has the
    # Sentinel kill the old primary's clients; the pools' once-a-second recheck covers a connection opened to a
    # primary a lagging Sentinel still named — tests/test_reliability_failover.py's double failovers.)
    import asyncio

    import redis as redis_lib

    from testing.fleet import wait_until
    from testing.sentinel import MASTER, SentinelHead
    from testing.services import RedisServer
    from thinkfleet.redis_client import async_client, sync_client

    RedisServer(tmp_path / "probe")  # fails (CI) or skips without redis-server
    head = SentinelHead(tmp_path / "head").start()
    try:
        sync = sync_client(head.url())
        assert sync.execute_command("ROLE")[0] == b"master"

        async def role_after_failover() -> bytes:
            client = async_client(head.url(), max_connections=4, pool_wait_s=5)
            assert (await client.execute_command("ROLE"))[0] == b"master"
            # When the Sentinels fail over gracefully: the old primary stays up, a replica now, answering reads.
            old = head.primary_port()
            assert old is not None
            redis_lib.Redis(port=head.sentinels[0].port).sentinel_failover(MASTER)
            await asyncio.to_thread(head.wait_for_new_primary, old)
            # Then a client that only reads is on the new primary (it never reads a replica's stale state).
            for _ in range(100):
                if (await client.execute_command("ROLE"))[0] == b"master":
                    break
                await asyncio.sleep(0.1)
            role = (await client.execute_command("ROLE"))[0]
            await client.aclose()
            return role

        assert asyncio.run(role_after_failover()) == b"master"
        wait_until(lambda: sync.execute_command("ROLE")[0] == b"master", 30, what="the sync client on the primary")
    finally:
        head.stop()


def test_a_primary_without_its_replicas_refuses_writes_as_a_connection_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # NOREPLICAS (min-replicas-to-write unmet) is the server's state, not the command's fault: a ConnectionError, so
    # kombu's consumer reconnects and the workers retry or hand back instead of crashing on a "ResponseError".
    import redis as redis_lib

    from testing.services import RedisServer
    from thinkfleet.redis_client import NoReplicasError, sync_client

    server = RedisServer(tmp_path / "r", extra=("--min-replicas-to-write", "1")).start()
    try:
        client = sync_client(server.url())
        with pytest.raises(NoReplicasError):
            client.set("k", "v")
        with pytest.raises(redis_lib.ConnectionError):  # a script's write too
            client.eval("return redis.call('SET', KEYS[1], 'v')", 1, "k")
        assert client.get("k") is None  # reads are served; nothing was written
    finally:
        server.stop()
