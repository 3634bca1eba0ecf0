"""One way to open Redis, for every process: the URL decides the topology.

- ``redis://[USER[:PASSWORD]@]HOST:PORT/DB`` (``rediss://`` for TLS, ``unix://``): one Redis, as redis-py reads it.
- ``sentinel://[USER[:PASSWORD]@]HOST:PORT,HOST:PORT,HOST:PORT/DB?master=NAME`` — a head that fails over: the
  Sentinels at those addresses name the primary of ``NAME``, and every connection goes to whichever Redis is the
  primary when it connects (redis-py's ``Sentinel.master_for``; a connection that meets a demoted primary's
  ``READONLY`` reconnects to the new one). USER/PASSWORD are the primary's (the ACL user of the process); the
  Sentinels' own password, when they have one, is ``?sentinel_password=…`` (and ``?sentinel_username=…``);
  ``?ssl=true`` speaks TLS to the Redis servers (with ``ssl_ca_certs``/``ssl_certfile``/``ssl_keyfile`` as for
  ``rediss://``; the broker's connections too: :func:`kombu_broker`), ``?sentinel_ssl=true`` to the Sentinels as well
  (Sentinels serving ``tls-port`` only), with the same files.

Every client made here has socket timeouts and TCP keepalive, so a frozen primary (a SIGSTOPped process, a host gone
from the network) is noticed by a timeout instead of a read that waits forever (celery #6348), and a Sentinel URL
then finds the new primary. The broker (kombu, thinkfleet/broker/) takes the same URL, translated by
:func:`kombu_broker`, and the same bounds (thinkfleet/broker/celery_app.py: ``broker_transport_options``).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio import sentinel as asentinel
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection, SentinelManagedSSLConnection

#: A command unanswered this long is a Redis that does not answer (a frozen primary: the connection is dropped, and
#: a Sentinel URL reconnects to whichever Redis is the primary now). Longer than any stall of a loaded host (a worker
#: starved 14-17 s on a 2-core CI box): a slow answer must never be taken for a dead Redis, since a command retried
#: on a timeout may run twice. Every command of ours is short; the broker's blocking pops block for 1 s (kombu's
#: ``brpop_timeout``), and their replies are read only once the socket is readable. A process with settings uses
#: :func:`command_timeout_s` (a third of the lease at most) instead.
SOCKET_TIMEOUT_S = 20.0
#: The shortest :func:`command_timeout_s` gives, whatever the lease (the tests' 4 s lease): a Redis on a loaded 2-core
#: box (fsync on every write) must not be taken for a silent one, since a timed-out command is retried and may run
#: twice; and longer than the broker's 1 s blocking pop. A lease under 15 s gets a timeout over a third of it.
MIN_SOCKET_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
#: For the producer's bulk writes (a submit's commit, a retry's requeue: one MULTI of up to millions of entries): long
#: enough for any of them on a loaded head, and still a bound, so a frozen primary stops the command with an error.
BULK_TIMEOUT_S = 300.0
#: The Sentinels answer only "who is the primary": a short timeout, so one dead Sentinel costs little.
SENTINEL_TIMEOUT_S = 2.0
SENTINEL_SCHEME = "sentinel"
#: Query options of a sentinel:// URL that configure the connections to the Redis servers (the rest are ours).
SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


class NoReplicasError(redis.ConnectionError):
    """``NOREPLICAS``: a primary with fewer good replicas than ``min-replicas-to-write`` refused a write (it is cut off
    from its replicas, or about to be demoted). Nothing was written, and the condition is the connection's, not the
    command's: retried, reconnected, handed back — never a crash. redis-py would raise a plain ResponseError, which
    kombu's consumer takes for a fatal error (a worker whose broker timer met one stopped)."""


# redis-py maps error prefixes to exception classes in one table (its parser's extension point): NOREPLICAS joins
# LOADING and READONLY among the errors that mean "this server cannot serve the write now".
_PARSER_ERRORS: dict[str, Any] = BaseParser.EXCEPTION_CLASSES
_PARSER_ERRORS.setdefault("NOREPLICAS", NoReplicasError)


class RedisUrlError(ValueError):
    """A Redis URL this module cannot open, with the fix."""


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``sentinel://`` URL."""

    sentinels: list[tuple[str, int]]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    ssl_options: dict[str, str] = field(default_factory=dict)
    #: TLS to the Sentinels too (``?sentinel_ssl=true``: Sentinels serving ``tls-port`` only), with the same files.
    sentinel_ssl: bool = False

    def connection_kwargs(self) -> dict[str, Any]:
        """What each connection to the primary is opened with."""
        kwargs: dict[str, Any] = {"db": self.db, "username": self.username, "password": self.password}
        if self.ssl:
            kwargs["ssl"] = True
            kwargs.update(self.ssl_options)
        return kwargs

    def sentinel_kwargs(self) -> dict[str, Any]:
        """What each connection to a Sentinel is opened with."""
        kwargs: dict[str, Any] = {
            "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        }
        if self.sentinel_password:
            kwargs.update(username=self.sentinel_username, password=self.sentinel_password)
        if self.sentinel_ssl:
            kwargs["ssl"] = True
            kwargs.update(self.ssl_options)
        return kwargs


def is_sentinel(url: str | None) -> bool:
    return bool(url) and urlsplit(str(url)).scheme == SENTINEL_SCHEME


def parse_sentinel(url: str) -> SentinelUrl:
    """``sentinel://[USER[:PASSWORD]@]HOST:PORT,HOST:PORT/DB?master=NAME[&sentinel_password=…]``, checked."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise RedisUrlError(f"not a sentinel:// URL: {redacted(url)}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise RedisUrlError(
                f"sentinel URL {redacted(url)}: {item!r} is not HOST:PORT (write every Sentinel as HOST:PORT, "
                "comma-separated: sentinel://h1:26379,h2:26379,h3:26379/0?master=thinkfleet)"
            )
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise RedisUrlError(f"sentinel URL {redacted(url)} names no Sentinel (sentinel://h1:26379,h2:26379/0?master=…)")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    master = query.pop("master", "") or query.pop("master_name", "")
    if not master:
        raise RedisUrlError(
            f"sentinel URL {redacted(url)} names no primary: add ?master=NAME (the name the Sentinels monitor, "
            "`sentinel monitor NAME …` in sentinel.conf)"
        )
    path = parts.path.strip("/") or "0"
    if not path.isdigit():
        raise RedisUrlError(f"sentinel URL {redacted(url)}: the database {path!r} is not a number")
    ssl = query.pop("ssl", "false").lower() in ("1", "true", "yes")
    sentinel_ssl = query.pop("sentinel_ssl", "false").lower() in ("1", "true", "yes")
    return SentinelUrl(
        sentinels=sentinels,
        master=master,
        db=int(path),
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=query.pop("sentinel_username", None),
        sentinel_password=query.pop("sentinel_password", None),
        ssl=ssl,
        ssl_options={k: query[k] for k in SSL_OPTIONS if k in query},
        sentinel_ssl=sentinel_ssl,
    )


def command_timeout_s(lease_s: float, configured_s: float | None = None) -> float:
    """How long a Redis command of a process with this lease waits for its reply (``redis_timeout_s`` when set):
    a third of the lease, so a connection stuck on a silent primary is dropped — and a lease renewal retried on the
    promoted one — while the lease still holds; at most :data:`SOCKET_TIMEOUT_S`, at least
    :data:`MIN_SOCKET_TIMEOUT_S`."""
    if configured_s is not None:
        return float(configured_s)
    return max(MIN_SOCKET_TIMEOUT_S, min(SOCKET_TIMEOUT_S, lease_s / 3))


def keepalive_options(timeout_s: float | None) -> dict[int, int]:
    """TCP keepalive probes (Linux) that find a peer *host* gone — powered off, cut from the network — within about
    ``timeout_s`` of silence; the kernel's default is two hours. (A frozen *process* on a live host still answers
    them: only the socket timeout and the health checks notice that one.)"""
    if not timeout_s or not hasattr(socket, "TCP_KEEPIDLE"):
        return {}
    idle = max(1, int(timeout_s / 2))
    return {socket.TCP_KEEPIDLE: idle, socket.TCP_KEEPINTVL: max(1, idle // 3), socket.TCP_KEEPCNT: 3}


#: The kombu transport option carrying :func:`keepalive_options` with string keys: Celery's ``stats`` reply holds the
#: transport options, and Flower refuses a reply whose map has int keys (msgpack's strict_map_key), so the probes
#: travel as text and the channels (thinkfleet/broker/transit.py) turn them back into redis-py's option.
KOMBU_KEEPALIVE_OPTION = "tcp_keepalive"


def kombu_keepalive(timeout_s: float | None) -> dict[str, int]:
    """:func:`keepalive_options` as :data:`KOMBU_KEEPALIVE_OPTION`'s value (string keys)."""
    return {str(k): v for k, v in keepalive_options(timeout_s).items()}


def with_kombu_keepalive(params: dict[str, Any], option: dict[str, int] | None) -> dict[str, Any]:
    """A kombu channel's connection parameters with the probes of :data:`KOMBU_KEEPALIVE_OPTION` (int keys again)."""
    if option and params.get("socket_keepalive"):
        params["socket_keepalive_options"] = {int(k): int(v) for k, v in option.items()}
    return params


def _common(timeout_s: float | None, connect_timeout_s: float | None) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(timeout_s or connect_timeout_s),
        # No CLIENT SETINFO on connect: Redis < 7.2 answers it with an error that, on a reconnect cut short (a
        # worker resumed from a pause, its timeouts all due at once), was read as the next command's reply.
        "driver_info": None,
    }


def _for_url(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` less what ``url``'s connection class refuses: a ``unix://`` socket has no TCP keepalive."""
    if url.startswith("unix://"):
        return {k: v for k, v in opts.items() if not k.startswith("socket_keepalive")}
    return opts


class _AskOnReconnect:
    """A Sentinel-managed connection that asks the Sentinels who the primary is whenever it opens its socket again.
    redis-py asks only in ``connect()``; a command that fails on a timeout or a connection error is retried (the
    client's ``Retry``) through ``connect_check_health()``, which reopens the socket to the *same* address — every
    retry of a command caught on a frozen primary went back to the frozen primary (redis-py 8.2: 20 retries of the
    worker's state client, ≈ 2 minutes of a stalled commit after the Sentinels had promoted a replica)."""

    _asking = False  # inside connect_to(): the address was just asked for

    def connect_to(self, address: Any) -> Any:
        self._asking = True
        try:
            return super().connect_to(address)  # type: ignore[misc]
        finally:
            self._asking = False

    def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        pool = self.connection_pool  # type: ignore[attr-defined]
        if not self._asking and not self._sock and pool.is_master:  # type: ignore[attr-defined]
            self.host, self.port = pool.get_master_address()
        return super().connect_check_health(*args, **kwargs)  # type: ignore[misc]


class _AsyncAskOnReconnect:
    """:class:`_AskOnReconnect` for asyncio connections."""

    _asking = False

    async def connect_to(self, address: Any) -> Any:
        self._asking = True
        try:
            return await super().connect_to(address)  # type: ignore[misc]
        finally:
            self._asking = False

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        pool = self.connection_pool  # type: ignore[attr-defined]
        if not self._asking and not self.is_connected and pool.is_master:  # type: ignore[attr-defined]
            self.host, self.port = await pool.get_master_address()
        return await super().connect_check_health(*args, **kwargs)  # type: ignore[misc]


class SentinelConnection(_AskOnReconnect, SentinelManagedConnection):
    """A connection to the primary of a Sentinel head that finds the primary again on every reconnect."""


class SentinelSSLConnection(_AskOnReconnect, SentinelManagedSSLConnection):
    """The same over TLS."""


class _AsyncSentinelConnection(_AsyncAskOnReconnect, asentinel.SentinelManagedConnection):
    pass


class _AsyncSentinelSSLConnection(_AsyncAskOnReconnect, asentinel.SentinelManagedSSLConnection):
    pass


class _Recheck:
    """A Sentinel pool that asks the Sentinels who the primary is (at most every ``recheck_s``), not only when it
    opens a connection: a connection to a primary that was *demoted* (a failover it survived: a second failover
    after a stalled promotion, a frozen primary that woke up) still answers reads — stale ones, from a replica — and
    only a write would have told (READONLY). When the primary moved, idle connections are dropped (redis-py) and a
    connection handed out to the old one is reconnected to the new one."""

    recheck_s = 1.0
    _checked_at = 0.0

    def _due(self) -> bool:
        now = time.monotonic()
        if not self.is_master or now - self._checked_at < self.recheck_s:  # type: ignore[attr-defined]
            return False
        self._checked_at = now
        return True

    def _stale(self, connection: Any) -> bool:
        where = self.master_address  # type: ignore[attr-defined]
        host = getattr(connection, "host", None)
        return bool(where) and host is not None and (host, getattr(connection, "port", None)) != tuple(where)


class _SentinelPool(_Recheck, SentinelConnectionPool):
    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._due():
            try:
                self.get_master_address()
            except redis.RedisError:
                pass  # no Sentinel answers now: keep the connections we have
        connection = super().get_connection(*args, **kwargs)
        if self._stale(connection):
            connection.disconnect()
            connection.connect()  # SentinelManagedConnection: to the primary the Sentinels name now
        return connection


#: The pool above under a public name: the broker's Sentinel channel (thinkfleet/broker/transit_sentinel.py) uses it.
RecheckedSentinelPool = _SentinelPool


class _BlockingSentinelPool(_SentinelPool, redis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection (as :class:`redis.BlockingConnectionPool`)."""


class _AsyncSentinelPool(_Recheck, asentinel.SentinelConnectionPool):
    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._due():
            try:
                await self.get_master_address()
            except redis.RedisError:
                pass  # no Sentinel answers now: keep the connections we have
        connection = await super().get_connection(*args, **kwargs)
        if self._stale(connection):
            await connection.disconnect()
            await connection.connect()
        return connection


class _AsyncBlockingSentinelPool(_AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """The same, for asyncio clients (the worker's pool is sized to its work and waits rather than refuses)."""


def sync_client(
    url: str,
    *,
    timeout_s: float | None = SOCKET_TIMEOUT_S,
    connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
    max_connections: int | None = None,
    pool_wait_s: float | None = None,
    **kwargs: Any,
) -> redis.Redis:
    """A redis-py client for ``url``. ``max_connections`` with ``pool_wait_s``: a pool that waits that long for a
    free connection instead of refusing one."""
    opts = _for_url(url, {**_common(timeout_s, connect_timeout_s), **kwargs})
    if not is_sentinel(url):
        if max_connections is None:
            return redis.Redis.from_url(url, **opts)
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_wait_s, **opts)
        return redis.Redis(connection_pool=pool)
    s = parse_sentinel(url)
    manager = Sentinel(s.sentinels, sentinel_kwargs=s.sentinel_kwargs())
    conn = {**s.connection_kwargs(), **opts}
    conn["connection_class"] = SentinelSSLConnection if s.ssl else SentinelConnection
    if max_connections is None:
        return manager.master_for(s.master, connection_pool_class=_SentinelPool, **conn)
    pool_kwargs = {"max_connections": max_connections, "timeout": pool_wait_s}
    return manager.master_for(s.master, connection_pool_class=_BlockingSentinelPool, **pool_kwargs, **conn)


def async_client(
    url: str,
    *,
    timeout_s: float | None = SOCKET_TIMEOUT_S,
    connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
    max_connections: int | None = None,
    pool_wait_s: float | None = None,
    **kwargs: Any,
) -> aioredis.Redis:
    """An asyncio redis-py client for ``url`` (as :func:`sync_client`)."""
    opts = _for_url(url, {**_common(timeout_s, connect_timeout_s), **kwargs})
    if not is_sentinel(url):
        if max_connections is None:
            return aioredis.from_url(url, **opts)
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s, **opts
        )
        return aioredis.Redis.from_pool(pool)
    s = parse_sentinel(url)
    manager = asentinel.Sentinel(s.sentinels, sentinel_kwargs=s.sentinel_kwargs())
    conn = {**s.connection_kwargs(), **opts}
    conn["connection_class"] = _AsyncSentinelSSLConnection if s.ssl else _AsyncSentinelConnection
    if max_connections is None:
        return manager.master_for(s.master, connection_pool_class=_AsyncSentinelPool, **conn)
    pool_kwargs = {"max_connections": max_connections, "timeout": pool_wait_s}
    return manager.master_for(s.master, connection_pool_class=_AsyncBlockingSentinelPool, **pool_kwargs, **conn)


def kombu_broker(url: str) -> tuple[str, dict[str, Any]]:
    """The broker URL kombu reads and the transport options it needs for ``url``: a Sentinel URL becomes kombu's
    ``sentinel://…;sentinel://…`` form (the primary's credentials on each) with ``master_name``; others pass."""
    if not is_sentinel(url):
        return url, {}
    s = parse_sentinel(url)
    auth = ""
    if s.username or s.password:
        auth = f"{quote(s.username or '', safe='')}:{quote(s.password or '', safe='')}@"
    hosts = [(f"[{host}]" if ":" in host else host, port) for host, port in s.sentinels]  # IPv6 in brackets
    broker = ";".join(f"sentinel://{auth}{host}:{port}/{s.db}" for host, port in hosts)
    options: dict[str, Any] = {"master_name": s.master, "sentinel_kwargs": s.sentinel_kwargs()}
    return broker, options


def with_password(url: str, password: str) -> str:
    """``url`` with the primary's ``password``, keeping its user: redis://worker@h/0 → redis://worker:PW@h/0 (the
    same for rediss:// and sentinel://; other schemes are returned as they are)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", SENTINEL_SCHEME):
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hostport}").geturl()


def with_sentinel_password(url: str, password: str) -> str:
    """A ``sentinel://`` URL with the Sentinels' own ``password`` as its ``?sentinel_password=`` (replacing one it
    had); other URLs are returned as they are (they name no Sentinel)."""
    if not is_sentinel(url):
        return url
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "sentinel_password"]
    query.append(("sentinel_password", password))
    return parts._replace(query=urlencode(query, quote_via=quote)).geturl()


def redacted(url: str) -> str:
    """The URL without its passwords (it goes into logs and messages)."""
    parts = urlsplit(url)
    if parts.password:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@"))
    if "sentinel_password=" in parts.query:
        query = "&".join(
            "sentinel_password=***" if q.startswith("sentinel_password=") else q for q in parts.query.split("&")
        )
        parts = parts._replace(query=query)
    return parts.geturl()
