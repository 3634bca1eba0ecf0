"""One WorkerRuntime per worker process: its lifecycle and the collaborators every message shares.

The runtime starts the event loop (workers/loop.py), Redis, the SGLang client, the writer and the group
commit, the health gate and the lease; it switches Celery's consuming on and off (server and storage
healthy, not draining), drains on SIGTERM and watches for cancelled jobs. A message is its collaborators'
work: :class:`workers.pipeline.PromptPipeline` turns it into exactly one outcome — stored, dead-lettered
or handed back (:class:`HandBack` → Celery ``Reject(requeue=True)``, never acked) — and
:class:`workers.attempts.RequestAttempts` makes its /generate attempts (the ``max_inflight`` bound,
retries). ``workers.pool.LoopPool`` starts :meth:`WorkerRuntime.ahandle` on the loop; Celery's thread
pool calls :meth:`WorkerRuntime.handle`, which waits for the same coroutine.

The runtime is built before the worker consumes anything (``worker_init``); if Redis, storage or
the settings are unusable, or another live worker holds its name (workers/identity.py), the worker exits
non-zero with the cause and the fix (:class:`RuntimeStartError`). A worker whose heartbeat is taken by another
process under its name while it runs stops consuming and hands back all it holds (:meth:`WorkerRuntime._name_lost`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage.writer import PartWriter, StorageNotWritable
from thinkfleet.broker.affinity import HostAffinity
from thinkfleet.broker.transit import TransitSweeper, uses_transit
from thinkfleet.broker.visibility import unacked_index_key
from thinkfleet.message import PromptTask
from thinkfleet.redis_client import async_client, command_timeout_s
from thinkfleet.settings import Settings, redacted_url
from thinkfleet.signing import SigningKeyError, signer_for
from thinkfleet.state.lifecycle import CANCELLED
from workers.adaptive import Move, bound_info, inflight_watcher, limits_from
from workers.attempts import HandBack, RequestAttempts
from workers.client import SGLangClient
from workers.committer import GroupCommitter
from workers.events import StartedOnSend
from workers.health import HealthGate
from workers.hooks import PostCommitHooks
from workers.identity import GuardedLedger, NameHeld
from workers.jobs import JobCache
from workers.lease import HeldMessages, LeaseKeeper
from workers.loop import EventLoopThread
from workers.metrics import WorkerMetrics
from workers.pipeline import PromptPipeline
from workers.provenance import ProvenanceRecorder
from workers.scheduler import slurm_info
from workers.stall import StallWatch
from workers.tool_steps import StepChainer
from workers.turns import TurnChaining

log = logging.getLogger("thinkfleet.worker")

#: Retries of one Redis command on a lost connection (0.05 s doubling to 2 s: ≈ 30 s in all), so a Redis
#: restart doesn't throw away finished generations; past that the prompt is handed back.
REDIS_RETRIES = 20
#: A Redis command waits this long for a free pooled connection before it fails (the pool is sized to the work).
REDIS_POOL_WAIT_S = 30.0
#: Seconds between checks for cancelled jobs among this worker's in-flight requests (producer cancel).
CANCEL_WATCH_S = 1.0


__all__ = ["HandBack", "RuntimeStartError", "WorkerRuntime", "current_runtime", "get_runtime"]


class RuntimeStartError(RuntimeError):
    """The worker cannot run (Redis, storage, metrics or settings): it must not consume anything."""


def worker_redis(settings: Settings) -> aioredis.Redis:
    """The worker's Redis client. Its pool is sized to the work (``Settings.worker_redis_connections``) and waits
    for a free connection rather than refusing one: redis-py's default pool (100, then "Too many connections",
    each a prompt handed back) is smaller than the default in-flight bound of 150."""
    return async_client(
        settings.redis_url,
        # A third of the lease at most: a renewal stuck on a silent primary is retried on the promoted one in time.
        timeout_s=command_timeout_s(settings.lease_s, settings.redis_timeout_s),
        max_connections=settings.worker_redis_connections,
        pool_wait_s=REDIS_POOL_WAIT_S,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), REDIS_RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


class WorkerRuntime:
    #: The in-flight controller (workers/adaptive.py; None when the bound is fixed). A class default: the health
    #: gate's thread may call _server_up before _astart has built it.
    adaptive: Any = None

    def __init__(self, settings: Settings, identity: str, consumer: Any = None) -> None:
        self.settings = settings
        self.identity = identity
        self.consumer = consumer  # Celery consumer, to stop/resume consuming
        self.held = HeldMessages()
        self.metrics = WorkerMetrics(identity, settings.max_inflight)
        self.draining = False
        self.storage_ok = True
        #: Who holds our name instead of us, once a heartbeat found it taken (we then write nothing under it).
        self.name_lost: str | None = None
        self._came_back_tasks: set[asyncio.Task[int]] = set()  # kept referenced until they end
        self._outcomes: dict[str, asyncio.Future[str]] = {}  # task id → outcome, for Celery's trace (workers/pool.py)
        self.loop = EventLoopThread(f"thinkfleet-{identity}").start()
        try:
            self.loop.run(self._astart())
        except BaseException:
            lease = getattr(self, "lease", None)
            if lease is not None:  # our name's heartbeat goes at once: a restart need not wait for it
                try:
                    self.loop.run(lease.stop(), timeout_s=5)
                except Exception:
                    pass
            self.loop.stop()
            raise

    # -- lifecycle ----------------------------------------------------------------------------------
    async def _astart(self) -> None:
        s = self.settings
        self.redis = worker_redis(s)
        await self._preflight_redis()
        self.client = SGLangClient(
            s.sglang_url,
            connections=s.max_inflight + 16,
            connect_timeout_s=s.connect_timeout_s,
            probe_timeout_s=s.preflight_timeout_s,
            health_probe_timeout_s=s.health_probe_timeout_s,
        )
        self.ledger = GuardedLedger(
            self.redis, s.keys, self.identity, s.max_deliveries, s.waitaof_ms, s.wait_replicas, s.feed_max_len
        )
        await self._hold_name()  # before anything under the name is touched: exit 78 if a live twin holds it
        abandoned = await self.ledger.abandon_claims()  # before this life claims anything
        if abandoned:
            log.warning("worker %s restarted: released %d claim(s) of its previous run", self.identity, abandoned)
        try:
            signer = signer_for(s)  # thinkfleet/signing.py: with a key, only signed work runs here
        except SigningKeyError as exc:
            raise RuntimeStartError(str(exc)) from exc
        self.jobs = JobCache(self.redis, s.keys, signer)
        self.writer = PartWriter(s.output_uri, self.identity, s.s3_endpoint_url)
        try:
            await asyncio.to_thread(self.writer.probe)
        except StorageNotWritable as exc:
            raise RuntimeStartError(str(exc)) from exc
        # What hangs off a stored row, in order (workers/hooks.py): the committer and the pipeline call them.
        recorder = ProvenanceRecorder(self.writer.loc, self.jobs, self.identity, s.sglang_url, s.git_revision)
        self.hooks = PostCommitHooks(
            [
                TurnChaining(chainer := StepChainer(self.redis, s.keys, s, self.writer, self.jobs)),  # --turns all
                recorder,  # what served each job, recorded before the first part of its rows (workers/provenance.py)
            ],
            on_error=lambda hook, exc: self.metrics.errors.labels("post_commit_hook").inc(),
        )
        self.committer = GroupCommitter(
            self.writer,
            self.ledger,
            s.flush_rows,
            s.flush_interval_s,
            s.alarm_min_rows,
            s.alarm_missing_share,
            on_alarm=self._alarm,
            on_flush=lambda rows, seconds: self.metrics.commit_seconds.observe(seconds),
            # Three quarters of the spare threads: bigger parts (a part costs ~2 ms of CPU whatever its
            # size), and a quarter left to refill request slots while a commit runs.
            max_pending=early_flush_rows(s),
            on_storage=self._storage_state,
            retry_max_s=s.storage_retry_max_s,
            hooks=self.hooks,
            part_target_bytes=s.part_target_bytes,
        )
        self.committer.start()
        self.gate = HealthGate(
            self.client,
            s.health_interval_s,
            s.max_inflight if s.inflight_mode == "fixed" else 0,  # auto starts within the server's slots
            on_down=self._server_down,
            on_up=self._server_up,
            metrics=self.metrics,
        )
        chainer.ledger = self.ledger  # an agentic step's executor call is fenced by the run's claim
        recorder.gate = self.gate  # what the gate read of the server is what the records say
        # A conversation's next turn is offered first to this host, which pops it before the shared queue; every
        # worker's sweep hands over what waited too long or whose host is gone (thinkfleet/broker/affinity.py).
        self.affinity = HostAffinity(self.redis, s, self.identity, self._accepting, uses_transit(s.broker_url))
        chainer.affinity = self.affinity
        chainer.served_model = lambda: self.gate.info.model_path if self.gate.info else None  # tokenizer roots
        sends = StartedOnSend(self.client)  # a delivery's first /generate marks its Celery task STARTED
        self.attempts = RequestAttempts(
            s, sends, self.gate, self.metrics, lambda: self.draining, on_idle=self.committer.flush_soon
        )
        # inflight_mode auto: the bound follows the server (reset from its limits whenever the gate opens).
        inflight = lambda: len(self.attempts.inflight)  # noqa: E731
        self.adaptive = inflight_watcher(
            s, self.client, self.attempts.semaphore, inflight, self._bound_moved, lambda: self.metrics.retractions_seen
        )
        if self.adaptive is None:
            self.metrics.bound_reason.state("fixed")
        elif self.gate.info is not None:  # the gate opened before the controller existed: start from its limits
            self.adaptive.reset(limits_from(self.gate.info))
        self.pipeline = PromptPipeline(
            s,
            self.identity,
            self.redis,
            self.ledger,
            self.jobs,
            self.writer,
            self.committer,
            self.gate,
            self.attempts,
            self.metrics,
            lambda: self.draining,
            hooks=self.hooks,
        )
        self.gate.start()
        try:
            port = self.metrics.serve(s.metrics_port) if s.metrics_port >= 0 else None
        except OSError as exc:
            raise RuntimeStartError(f"cannot serve Prometheus metrics on any port: {exc}") from exc
        info = {
            "host": socket.gethostname(),
            "sglang_url": s.sglang_url,
            "max_inflight": s.max_inflight,
            **bound_info(self.adaptive, s),
            "metrics_port": port,
            "started_at": time.time(),
            **slurm_info(),
        }
        self.lease.info = info
        # Its progress, held work and gates go with every heartbeat; a stall is shown, a stuck commit ends the worker.
        self.stall = StallWatch(
            self.committer, self.gate, lambda: len(self.held), info, self.metrics, s.flush_interval_s,
            s.stall_flush_intervals, s.commit_stuck_exit_s,
        )  # fmt: skip
        self.stall.publish()
        # An image store this host cannot read is a closed gate the heartbeat names (producer status).
        gates = self.pipeline.images.gates
        gates.on_change = lambda: info.update(image_store_gates=gates.closed())
        if s.image_store_uri:  # the fleet's store, checked now (a job's own store: on its first image prompt)
            await gates.recheck(s.image_store_uri.rstrip("/"))
        if not await self.lease.beat():
            raise RuntimeStartError(f"worker name {self.identity!r} was taken by {self.lease.lost} while it started")
        self.lease.start()
        self.stall.start()
        self.affinity.start()
        if self.adaptive is not None:
            self.adaptive.start()
        self._release_task = asyncio.get_running_loop().create_task(
            self.pipeline.claims.release_later(), name="release-later"
        )
        self._cancel_watch = asyncio.get_running_loop().create_task(self._watch_cancels(), name="watch-cancels")
        log.info(
            "worker %s: max_inflight=%d sglang=%s metrics=:%s",
            self.identity,
            s.max_inflight,
            s.sglang_url,
            port,
        )

    async def _hold_name(self) -> None:
        """Hold our name's heartbeat (workers/identity.py): a live twin's makes this worker refuse to start; a
        dead previous life's is taken over (at once when its pid is known dead, else once it expires). Also
        where this host's clock is first compared with Redis's."""
        s = self.settings
        self.lease = LeaseKeeper(
            self.redis,
            s.keys,
            self.identity,
            s.lease_s,
            unacked_index_key(s.key_prefix),
            self.held,
            {},
            TransitSweeper(self.redis, s.keys, self.identity, s.queue),
            on_lost=self._name_lost,
            clock_warn_s=s.clock_skew_warn_s,
            on_lapse=self._lapsed,
        )
        try:
            took_over = await self.lease.acquire()
        except NameHeld as exc:
            raise RuntimeStartError(str(exc)) from exc
        if took_over:
            log.warning("%s", took_over)
        offset = self.lease.clock_offset_s
        if offset is not None and abs(offset) > s.clock_skew_warn_s:
            self.metrics.errors.labels("clock_skew").inc()

    def _lapsed(self, gap_s: float) -> None:
        """Our lease lapsed while we lived (paused or cut off for ``gap_s``): claims of ours other workers took over
        meanwhile were charged a death we did not die — take those back now (their runs will be fenced)."""
        log.warning("our lease lapsed (%.1f s without a heartbeat): taking back deaths charged to our claims", gap_s)
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            task = asyncio.get_running_loop().create_task(pipeline.claims.came_back_all(), name="came-back")
            self._came_back_tasks.add(task)
            task.add_done_callback(self._came_back_tasks.discard)

    def _name_lost(self, holder: str) -> None:
        """A heartbeat found our name held by another process (a twin under the same name that started while
        we were paused past our lease, say): stop consuming, cancel what runs, hand every message back and
        write nothing more under the name (:class:`workers.identity.GuardedLedger`). On the loop thread."""
        if self.name_lost is not None:
            return
        self.name_lost = holder
        log.critical(
            "\n%s\nWORKER NAME %r IS HELD BY ANOTHER PROCESS: %s.\nTwo workers under one name take each other's "
            "claims as their own: this one stops consuming, hands back every message it holds and acks nothing "
            "more.\nGive each worker its own --name / THINKFLEET_WORKER_NAME and restart it.\n%s",
            "!" * 78,
            self.identity,
            holder,
            "!" * 78,
        )
        self.metrics.errors.labels("name_lost").inc()
        self.ledger.suspend(f"its heartbeat is held by {holder}")
        self.draining = True
        self._sync_consuming()
        self.committer.give_up()
        self.attempts.cancel_all()
        self.gate.wake_waiters()

    async def _preflight_redis(self) -> None:
        """PING before anything else: a wrong password or certificate stops the worker now, by name; an unreachable
        Redis (the head node restarting, say) is waited for up to ``redis_start_wait_s``, then stops it the same
        way — a worker started during a Redis restart must not exit for it."""
        s = self.settings
        s.require_safe_redis_password(RuntimeStartError)  # placeholder or short password for a remote Redis
        s.require_supported_broker(RuntimeStartError)  # the queue must be the job-state Redis
        probe = async_client(s.redis_url, timeout_s=10, connect_timeout_s=10)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.redis_start_wait_s
        try:
            for attempt in itertools.count():
                try:
                    await probe.ping()
                    return
                except RedisError as exc:
                    if not _may_come_up(exc) or loop.time() >= deadline:
                        raise
                    log.warning(
                        "Redis at %s not reachable yet (%s: %s): retrying, up to %.0f s more",
                        redacted_url(s.redis_url), type(exc).__name__, exc, deadline - loop.time(),
                    )  # fmt: skip
                    await asyncio.sleep(min(2.0, 0.2 * 2**attempt))
        except RedisError as exc:
            hint = (
                "check the password in THINKFLEET_REDIS_URL (redis://:PASSWORD@host:port/db)"
                if "auth" in str(exc).lower() or "NOPERM" in str(exc) or "WRONGPASS" in str(exc)
                else "check THINKFLEET_REDIS_URL and that the head node's Redis is reachable from this host"
            )
            reason = f"{type(exc).__name__}: {exc}"
            raise RuntimeStartError(f"cannot use Redis at {redacted_url(s.redis_url)}: {reason}; {hint}") from exc
        finally:
            await probe.aclose()

    def attach_consumer(self, consumer: Any) -> None:
        self.consumer = consumer
        self._sync_consuming()

    def _sync_consuming(self) -> None:
        """Consume exactly while the server and storage are healthy and we are not draining.

        Called from the gate (loop thread) and from Celery (main thread) after the state changed. The
        switch itself runs on Celery's consumer loop, and kombu's hub keeps its pending callbacks in a
        *set* (no order): so we never queue "cancel" and "add" — we queue one idempotent step that
        reads the current state when it runs. Whichever runs last sees the latest state.
        """
        consumer = self.consumer
        if consumer is not None:
            consumer.call_soon(self._apply_consuming)

    def _apply_consuming(self) -> None:
        consumer = self.consumer
        task_consumer = getattr(consumer, "task_consumer", None)
        if consumer is None or task_consumer is None:
            return
        queue = self.settings.queue
        want = self.gate.healthy and self.storage_ok and not self.draining
        consuming = bool(task_consumer.consuming_from(queue))
        if want and not consuming:
            consumer.add_task_queue(queue)
        elif not want and consuming:
            consumer.cancel_task_queue(queue)

    def _accepting(self) -> bool:
        """We take work now (what :meth:`_apply_consuming` wants): else next turns are not offered to us, and our
        host list goes to the shared queue (thinkfleet/broker/affinity.py)."""
        gate = getattr(self, "gate", None)
        return gate is not None and gate.healthy and self.storage_ok and not self.draining

    def _server_down(self) -> None:
        self.metrics.healthy.set(0)
        self._sync_consuming()

    def _server_up(self) -> None:
        self.metrics.healthy.set(1)
        if self.adaptive is not None:  # a new or restarted server: start again from its limits
            self.adaptive.reset(limits_from(self.gate.info))
        self._sync_consuming()

    def _bound_moved(self, move: Move) -> None:
        """Publish a move of the in-flight bound: Prometheus and the heartbeat's info (producer status)."""
        self.metrics.note_bound(move.new, move.kind)
        info = getattr(getattr(self, "lease", None), "info", None)
        if info is not None:
            info.update(bound_info(self.adaptive, self.settings))

    def _storage_state(self, ok: bool, exc: Exception | None) -> None:
        """The committer's verdict: a failed commit closes the consuming gate until one succeeds."""
        if not ok:
            self.metrics.storage_failures.inc()
            self.metrics.errors.labels("storage").inc()
        if ok == self.storage_ok:
            return
        self.storage_ok = ok
        self.metrics.storage_healthy.set(int(ok))
        if ok:
            log.warning("commits succeed again: resuming consuming")
        else:
            # A commit is a part write and a Redis finalize: say which one refused (a head without its replicas
            # answers NOREPLICAS to the finalize; that is no storage fault).
            what = "the job-state Redis" if isinstance(exc, RedisError) else "storage"
            log.error(
                "commit failing at %s (%s: %s): stopped consuming; finished rows are kept and their commit retried",
                what,
                type(exc).__name__,
                exc,
            )
        self._sync_consuming()

    def drain(self) -> None:
        """SIGTERM (spot preemption): stop taking work, let requests finish briefly, hand back the rest."""
        if self.draining:
            return
        log.warning(
            "worker %s draining: %d requests in flight, grace %.0fs",
            self.identity,
            len(self.attempts.inflight),
            self.settings.shutdown_grace_s,
        )
        self.draining = True
        self._sync_consuming()
        self.loop.loop.call_soon_threadsafe(self._drain_timer)

    def _drain_timer(self) -> None:
        self.committer.flush_soon()
        self.gate.wake_waiters()  # a retry waiting on the gate's verdict hands its prompt back now
        self.loop.loop.call_later(self.settings.shutdown_grace_s, self._cancel_requests)

    def _cancel_requests(self) -> None:
        self.committer.give_up()
        self.attempts.cancel_all()

    def close(self) -> None:
        async def _aclose() -> None:
            self._release_task.cancel()
            self._cancel_watch.cancel()
            await self.stall.stop()
            await self.affinity.stop()  # our host list to the shared queue, while our heartbeat still says alive
            await self.lease.stop()
            if self.adaptive is not None:
                await self.adaptive.stop()
            await self.gate.stop()
            await self.client.close()
            await self.redis.aclose()

        try:
            self.loop.run(_aclose(), timeout_s=10)
        except Exception as exc:
            log.warning("worker close: %s", exc)
        self.loop.stop()

    # -- one message --------------------------------------------------------------------------------
    def handle(self, args: Any, message_id: str | None = None) -> str:
        """Called from a pool thread with a message's args: returns an outcome (the message is acked)
        or raises :class:`HandBack` (requeued). Nothing else escapes."""
        return self.loop.run(self.ahandle(args, message_id))

    async def ahandle(self, args: Any, message_id: str | None = None) -> str:
        """:meth:`handle` on the loop (workers/pool.py starts it there straight from Celery's consumer)."""
        if self.name_lost is not None:
            raise HandBack()  # nothing runs under a name another process holds
        return await self.pipeline.handle(args, message_id)

    def process(self, task: PromptTask) -> str:
        """One decoded task (tests and benchmarks): an outcome, or raises HandBack."""
        return self.loop.run(self.pipeline.process(task))

    async def push_malformed(self, record: str) -> None:
        await self.pipeline.push_malformed(record)

    def keep_outcome(self, task_id: str, outcome: asyncio.Future[str]) -> None:
        """A prompt's outcome computed before Celery's trace runs its task function (workers/pool.py)."""
        self._outcomes[task_id] = outcome

    def take_outcome(self, task_id: str) -> asyncio.Future[str] | None:
        return self._outcomes.pop(task_id, None)

    async def _watch_cancels(self) -> None:
        """Abort this worker's in-flight requests of cancelled jobs, checked every second."""
        while True:
            await asyncio.sleep(CANCEL_WATCH_S)
            inflight = self.attempts.inflight
            jobs = sorted({job for job, _rid in inflight.values()})
            if not jobs:
                continue
            try:
                states = await self.redis.mget([self.settings.keys.job_state(j) for j in jobs])
            except RedisError:
                continue
            cancelled = {j for j, st in zip(jobs, states, strict=True) if st == CANCELLED.encode()}
            seen = self.attempts.cancelled_jobs
            seen.difference_update(jobs)
            seen.update(cancelled)
            for request, (job, rid) in list(inflight.items()):
                if job in cancelled and not request.done():
                    log.warning("job %s cancelled: aborting request %s", job, rid)
                    request.cancel()

    async def _alarm(self, job: str, seen: int, missing: int) -> None:
        evidence = {"rows": seen, "missing_think_end": missing, "worker": self.identity, "at": time.time()}
        self.metrics.alarm.set(1)
        if await self.ledger.raise_alarm(job, evidence):
            log.error(
                "\n%s\nREASONING ALARM for job %s: %d of the first %d rows have no </think> token.\n"
                "This is the seed's silent failure (reasoning lost). Check the chat template (thinking on?),\n"
                "the think-end id, and the server's model before spending more GPU hours.\n%s",
                "!" * 78,
                job,
                missing,
                seen,
                "!" * 78,
            )


def early_flush_rows(settings: Settings) -> int:
    """Rows waiting for their commit that start a flush before ``flush_interval_s`` (each holds a pool thread)."""
    return max(1, settings.commit_headroom * 3 // 4)


_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime(settings: Settings, identity: str) -> WorkerRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = WorkerRuntime(settings, identity)
        return _runtime


def current_runtime() -> WorkerRuntime | None:
    return _runtime


def _may_come_up(exc: Exception) -> bool:
    """An error an unreachable Redis gives (refused, reset, timed out, unknown host) — not a refused password,
    ACL or certificate, which waiting cannot fix."""
    if isinstance(exc, AuthenticationError) or not isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return False
    text = str(exc).lower()
    return not any(word in text for word in ("auth", "wrongpass", "noperm", "certificate", "ssl", "tls"))
