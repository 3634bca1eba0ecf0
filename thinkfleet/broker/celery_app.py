"""The one Celery configuration, from a :class:`thinkfleet.settings.Settings` object.

The producer publishes through a publisher-only app (:func:`make_app`, :func:`send_tasks`); the worker's
app (``workers/app.py``, what ``celery -A workers.app worker``, the ``worker`` script and Flower load) is
this one with the task registered. Choices, each answering a known Celery-on-Redis trap:

- msgpack (ids travel as bytes) and json only: a pickle message is refused, never executed.
- Late acks + prefetch multiplier 1 + a pool sized to the in-flight bound (Celery's thread pool here; the
  worker's app runs ``workers.pool.LoopPool``, the same bound without a thread per message): a host holds only
  messages it is working on, and a prompt is acknowledged only after its row is committed.
- The visibility timeout equals ``lease_s`` everywhere Celery reads it; live workers renew the visibility
  of what they hold (workers/lease.py → visibility.py), and kombu's own sweep — run every
  ``reaper_interval_s`` instead of the 100 s default — restores a dead worker's messages.
- No result backend: results go to Parquet.
- Every connection kombu opens has a socket and connect timeout, TCP keepalive and a health check, a third of the
  lease at most (:func:`broker_timeouts`); on a ``sentinel://`` head each reconnect asks the Sentinels
  (thinkfleet/broker/transit_sentinel.py), and ``?ssl=true`` gives the broker TLS as the state clients
  (:func:`broker_ssl`). A frozen primary costs the Sentinels' down-after plus about one timeout (issue 43).
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qs, urlsplit

from celery import Celery
from kombu import Exchange, Queue

from thinkfleet.broker.keys import PRIORITY_SEP, PRIORITY_STEPS, kombu_transport_options
from thinkfleet.message import TASK_NAME, PromptTask
from thinkfleet.redis_client import (
    CONNECT_TIMEOUT_S,
    KOMBU_KEEPALIVE_OPTION,
    command_timeout_s,
    is_sentinel,
    kombu_broker,
    kombu_keepalive,
    parse_sentinel,
)
from thinkfleet.settings import Settings, load_settings

#: The transport of every process on a ``sentinel://`` head that does not consume through transit (a worker's is
#: thinkfleet/broker/transit.py's ``SENTINEL_TRANSPORT``).
PUBLISHER_SENTINEL_TRANSPORT = "thinkfleet.broker.transit_sentinel:PublisherTransport"


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = dict(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s))
    # kombu >= 5.6.3: sweep for expired unacked messages every reaper_interval_s (default ≈100 s).
    options["unacked_restore_interval"] = max(1, int(settings.reaper_interval_s))
    options["unacked_restore_throttle"] = 1
    # Job priority on Redis (kombu's semantics: 0 is the highest, 9 the lowest): one list per level,
    # ``queue`` for 0 and ``queue`` + sep + N for N (keys.priority_list). kombu's own restore and publish,
    # Flower's queue lengths and our transit pop (transit.py) all read these.
    options["priority_steps"] = list(PRIORITY_STEPS)
    options["sep"] = PRIORITY_SEP
    options["queue_order_strategy"] = "priority"
    options.update(broker_timeouts(settings))
    return options


def broker_timeouts(settings: Settings) -> dict[str, Any]:
    """Bounds on every connection kombu opens — the consumer's blocking pop and the synchronous commands of the
    channel (the unacked record, the settle, the restore sweep, the Redis clock): without them a primary that stops
    answering without closing its sockets (a SIGSTOPped process, a frozen VM, a partition that drops packets) holds
    the consumer thread in a read for ever (issue 43). Each is the state clients' command timeout, a third of the
    lease at most (thinkfleet/redis_client.py ``command_timeout_s``), so a worker notices the silent primary, and
    reconnects to the promoted one, while its lease still holds.

    - ``socket_timeout``: a synchronous command's reply. A blocking pop blocks 1 s on the server (kombu's
      ``brpop_timeout``) and its reply is read only once the socket is readable, so the timeout never cuts one short.
    - ``health_check_interval``: half the timeout. redis-py PINGs a connection idle that long before using it, and
      kombu drops the pop's connection once its reply is that much overdue (``maybe_check_brpop_health``: the event
      loop waits on the socket, where no socket timeout applies).
    - TCP keepalive probes: a head *host* that vanished is noticed within about the timeout."""
    timeout = command_timeout_s(settings.lease_s, settings.redis_timeout_s)
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": min(CONNECT_TIMEOUT_S, timeout),
        "socket_keepalive": True,
        KOMBU_KEEPALIVE_OPTION: kombu_keepalive(timeout),  # (the channels set socket_keepalive_options from it)
        "health_check_interval": max(1, int(timeout / 2)),
    }


#: TLS file options a ``rediss://`` URL may carry (``?ssl_ca_certs=/run/secrets/redis_tls_ca``).
SSL_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def broker_ssl(broker_url: str | None) -> dict[str, Any] | None:
    """TLS options of a ``rediss://`` broker, or of a ``sentinel://…?ssl=true`` head (kombu then connects to the
    primary with its Sentinel-managed SSL connection class, as the state clients do): verify the server's
    certificate unless the URL says ``?ssl_cert_reqs=none|optional`` (kombu's own default for rediss is no
    verification at all), against the CA in ``?ssl_ca_certs=`` when given (else the system's). The file options
    are repeated here because Flower's broker page reads ``broker_use_ssl`` only, not the URL."""
    if not broker_url:
        return None
    if is_sentinel(broker_url):
        head = parse_sentinel(broker_url)
        if not head.ssl:
            return None
        query = {name: [value] for name, value in head.ssl_options.items()}
    elif broker_url.startswith("rediss://"):
        query = parse_qs(urlsplit(broker_url).query)
    else:
        return None
    wanted = (query.get("ssl_cert_reqs") or ["required"])[0].lower()
    levels = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL}
    options: dict[str, Any] = {"ssl_cert_reqs": levels.get(wanted.removeprefix("cert_"), ssl.CERT_REQUIRED)}
    options.update({name: query[name][0] for name in SSL_FILE_OPTIONS if query.get(name)})
    return options


def task_queue(settings: Settings) -> Queue:
    exchange = Exchange(settings.queue, type="direct")
    arguments = None
    if settings.broker_url and settings.broker_url.startswith(("amqp", "pyamqp")):
        # Quorum queues replicate and survive a broker node restart (RabbitMQ brokers only).
        arguments = {"x-queue-type": "quorum"}
    return Queue(settings.queue, exchange, routing_key=settings.queue, queue_arguments=arguments)


def configure(app: Celery, settings: Settings) -> Celery:
    transport = broker_transport_options(settings)
    # A sentinel:// URL (thinkfleet/redis_client.py) in kombu's own form, with the primary's name.
    broker_url, sentinel_options = kombu_broker(settings.broker_url or settings.redis_url)
    transport.update(sentinel_options)
    is_amqp = bool(settings.broker_url and settings.broker_url.startswith(("amqp", "pyamqp")))
    if sentinel_options:  # kombu's stock Sentinel transport with our connections (a worker's is transit's)
        app.conf.broker_transport = PUBLISHER_SENTINEL_TRANSPORT
    app.conf.update(
        broker_url=broker_url,
        broker_transport_options=transport,
        broker_use_ssl=broker_ssl(settings.broker_url),
        result_backend=None,
        result_backend_transport_options=transport,
        visibility_timeout=int(settings.visibility_timeout_s),
        task_ignore_result=True,
        task_serializer="msgpack",
        accept_content=["msgpack", "json"],
        event_serializer="json",
        task_acks_late=True,
        # The task never raises: it returns an outcome (stored / dead-lettered, then acked) or raises
        # Reject(requeue=True) (handed back); see workers/tasks.py. (With False here Celery would
        # reject(requeue=False) a failed task, which drops it on Redis just the same.) A worker killed
        # mid-task must not ack: its prompt is re-run (the ledger dedupes).
        task_acks_on_failure_or_timeout=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_pool="threads",
        worker_concurrency=settings.max_inflight + settings.commit_headroom,
        task_default_queue=settings.queue,
        task_default_exchange=settings.queue,
        task_default_routing_key=settings.queue,
        task_queues=[task_queue(settings)],
        task_create_missing_queues=False,
        task_routes={TASK_NAME: {"queue": settings.queue}},
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_pool_limit=None if is_amqp else 10,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # Warm shutdown waits for our own drain (WorkerRuntime.drain), which hands work back itself.
        worker_soft_shutdown_timeout=settings.shutdown_grace_s,
        worker_enable_soft_shutdown_on_idle=False,
        task_time_limit=None,
        task_soft_time_limit=None,
    )
    return app


def make_app(settings: Settings | None = None) -> Celery:
    """A configured Celery app with no task registered: the producer's publisher; ``workers.app.make_app``
    registers the worker's task on it. ``settings`` default to ``THINKFLEET_*`` from the environment."""
    settings = settings or load_settings()
    app = Celery("thinkfleet", set_as_current=False)
    configure(app, settings)
    app.thinkfleet_settings = settings  # type: ignore[attr-defined]
    return app


def send_tasks(settings: Settings, tasks: list[PromptTask]) -> None:
    """``send_task`` each task (any broker; not atomic: tests and the non-Redis-broker fallback of
    ``producer retry`` use it; ``producer submit`` stages :mod:`thinkfleet.broker.envelope` messages)."""
    from thinkfleet.signing import signer_for

    app = make_app(settings)
    signer = signer_for(settings)  # signed like the envelope's messages (thinkfleet/broker/envelope.py)
    with app.producer_or_acquire() as producer:
        for task in tasks:
            if signer is not None and not task.signature:
                task = signer.sign_task(task)
            app.send_task(
                TASK_NAME,
                args=task.to_args(),
                task_id=task.task_id,
                argsrepr=task.argsrepr,
                kwargsrepr="{}",
                queue=settings.queue,
                producer=producer,
            )
