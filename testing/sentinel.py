"""A head that fails over, on one machine: one primary ``redis-server``, two replicas and three Sentinels on
loopback (quorum 2, ``down-after-milliseconds`` 1000), for the failover tests and ``bench/``.

The Sentinels decide which Redis is the primary; a test kills, stops or isolates processes and waits for the
promotion (:meth:`SentinelHead.wait_for_new_primary`). Each process keeps its own directory (AOF, logs, the
Sentinel's rewritten config), so a failed run can be read afterwards. A Redis may run with its wall clock off the
host's (:class:`ShiftedClockRedis`: ``TIME`` and key expiry, as on a host whose clock is wrong).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from testing.fleet import WorkerProcess, free_port, job_progress_or_down, wait_for_port, wait_until
from testing.harness import cli_env, fast_env, isolated_settings, simulator
from testing.redis_process import REDIS_SERVER, RedisProcess
from testing.sentinel_tls import TlsFiles
from testing.services import RedisServer
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings

MASTER = "thinkfleet"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 4000
#: A preload that shifts CLOCK_REALTIME (clock_gettime, gettimeofday, time) by THINKFLEET_CLOCK_OFFSET_S seconds and
#: nothing else (the monotonic clocks Redis times itself with stay true). libfaketime would do, but not for Debian's
#: redis-server: jemalloc calls clock_gettime while libfaketime initializes, which aborts (libfaketime #130). This
#: one calls the kernel directly, so it needs neither dlsym nor malloc.
CLOCK_SHIFT_C = r"""
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long offset_s;
static int ready;

static long offset(void) {
    if (!ready) {
        const char *v = getenv("THINKFLEET_CLOCK_OFFSET_S");
        offset_s = v ? atol(v) : 0;
        ready = 1;
    }
    return offset_s;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    int rc = (int)syscall(SYS_clock_gettime, id, ts);
    if (rc == 0 && ts && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += offset();
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    (void)tz;
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
"""
CC = shutil.which("cc") or shutil.which("gcc")


def clock_shift_library(workdir: Path) -> Path:
    """:data:`CLOCK_SHIFT_C` built into ``workdir`` (a C compiler is needed: build-essential)."""
    if CC is None:
        raise RuntimeError("no C compiler (cc): apt-get install build-essential")
    workdir.mkdir(parents=True, exist_ok=True)
    source, library = workdir / "clock_shift.c", workdir / "clock_shift.so"
    source.write_text(CLOCK_SHIFT_C)
    subprocess.run([CC, "-shared", "-fPIC", "-O2", "-o", str(library), str(source)], check=True)
    return library


class ShiftedClockRedis(RedisProcess):
    """``redis-server`` whose wall clock runs ``offset_s`` off the host's (``offset_s`` < 0: behind): its ``TIME``,
    its key expiry and its log stamps."""

    def __init__(
        self,
        workdir: Path,
        offset_s: int,
        port: int | None = None,
        appendonly: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__(workdir, port=port, appendonly=appendonly, extra=extra)
        self.offset_s = offset_s

    def start(self) -> ShiftedClockRedis:
        # RedisProcess starts redis-server with this process's environment: the preload joins it for this one start
        # (a test's own process starts nothing else meanwhile; it only waits for the port).
        shift = {
            "LD_PRELOAD": str(clock_shift_library(self.workdir / "clock")),
            "THINKFLEET_CLOCK_OFFSET_S": str(int(self.offset_s)),
        }
        saved = {name: os.environ.get(name) for name in shift}
        os.environ.update(shift)
        try:
            super().start()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return self


class SentinelProcess:
    """``redis-server --sentinel`` watching :data:`MASTER`."""

    def __init__(self, workdir: Path, primary_port: int, quorum: int = 2, tls: TlsFiles | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.primary_port = primary_port
        self.quorum = quorum
        self.tls = tls  # TLS only (testing/sentinel_tls.py)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "sentinel.conf"
        listen = self.tls.sentinel_conf(self.port) if self.tls else f"port {self.port}\n"
        conf.write_text(
            f"{listen}bind 127.0.0.1\ndir {self.workdir}\nlogfile {self.workdir / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER} 2\n"
        )
        self.proc = subprocess.Popen(
            [str(REDIS_SERVER), str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        if self.tls:
            return self.tls.client(self.port, timeout_s)
        return redis.Redis(port=self.port, socket_timeout=timeout_s)

    def primary(self) -> tuple[str, int] | None:
        try:
            found = self.client().sentinel_get_master_addr_by_name(MASTER)
        except redis.RedisError:
            return None
        if not found:
            return None
        host = found[0].decode() if isinstance(found[0], bytes) else str(found[0])
        return host, int(found[1])


class SentinelHead:
    """One primary, ``replicas`` replicas, ``sentinels`` Sentinels; :meth:`url` is the ``sentinel://`` URL."""

    def __init__(
        self,
        workdir: Path,
        replicas: int = 2,
        sentinels: int = 3,
        appendonly: bool = True,
        options: tuple[str, ...] = (),
        redis_options: dict[int, tuple[str, ...]] | None = None,
        clock_offsets_s: dict[int, int] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """``options``: more redis-server flags for every Redis of the head (``--min-replicas-to-write 1``, …);
        ``redis_options``: for Redis N only (0 the first primary: ``--replica-priority 0`` is never promoted);
        ``clock_offsets_s``: Redis N's wall clock that many seconds off the host's (:class:`ShiftedClockRedis`);
        ``tls``: every Redis and Sentinel on TLS only (testing/sentinel_tls.py; :meth:`url` then asks for TLS)."""
        self.workdir = workdir
        self.tls = tls
        primary_port = free_port()
        own, shifted = redis_options or {}, clock_offsets_s or {}
        # A replica's first sync starts at once (the default waits 5 s for more replicas to share one transfer).
        sync_now = ("--repl-diskless-sync-delay", "0", *options)
        self.redis: list[RedisProcess] = []
        for i in range(replicas + 1):
            extra = (*sync_now, *own.get(i, ()))
            if i:
                extra = ("--replicaof", "127.0.0.1", str(primary_port), *extra)
            port = primary_port if i == 0 else free_port()
            if tls is not None:
                extra = (*extra, *tls.server_args(port))
            if i in shifted:
                self.redis.append(
                    ShiftedClockRedis(workdir / f"r{i}", shifted[i], port=port, appendonly=appendonly, extra=extra)
                )
            else:
                self.redis.append(RedisProcess(workdir / f"r{i}", port=port, appendonly=appendonly, extra=extra))
        self.sentinels = [SentinelProcess(workdir / f"s{i}", primary_port, tls=tls) for i in range(sentinels)]

    def start(self) -> SentinelHead:
        for r in self.redis:
            r.start()
        self.wait_for_replicas(len(self.redis) - 1)
        for s in self.sentinels:
            s.start()
        first = ("127.0.0.1", self.redis[0].port)
        wait_until(
            lambda: all(s.primary() == first for s in self.sentinels), 60, what="every Sentinel naming the primary"
        )
        # Each Sentinel has found the replicas and the other Sentinels before any failover is asked of them.
        # Discovery runs on the Sentinels' own timers (hello every 2 s, INFO every 10 s), slower on a loaded box: the
        # bound is generous, and a miss names what each Sentinel saw and the tail of its log.
        wait_until(
            lambda: all(self._sentinel_sees_all(s) for s in self.sentinels),
            180,
            what="the Sentinels seeing all",
            explain=self._discovery_report,
        )
        return self

    def _discovery_report(self) -> str:
        lines = []
        for s in self.sentinels:
            try:
                client = s.client()
                replicas, others = client.sentinel_slaves(MASTER), client.sentinel_sentinels(MASTER)
                seen = f"replicas {len(replicas)}, sentinels {len(others)}"
            except redis.RedisError as exc:
                seen = f"unreadable ({exc!r})"
            log = s.workdir / "sentinel.log"
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else ["(no log)"]
            alive = "alive" if s.proc and s.proc.poll() is None else "exited"
            lines.append(f"Sentinel :{s.port} ({alive}): {seen}\n  " + "\n  ".join(tail))
        return "\n".join(lines)

    def _sentinel_sees_all(self, s: SentinelProcess) -> bool:
        try:
            client = s.client()
            replicas = client.sentinel_slaves(MASTER)
            others = client.sentinel_sentinels(MASTER)
        except redis.RedisError:
            return False
        return len(replicas) >= len(self.redis) - 1 and len(others) >= len(self.sentinels) - 1

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for r in self.redis:
            if r.proc and r.proc.poll() is None:
                os.kill(r.proc.pid, signal.SIGCONT)  # a stopped process cannot die
            r.stop(kill=True)

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"sentinel://{hosts}/{db}?master={MASTER}" + (self.tls.url_query() if self.tls else "")

    def client_of(self, r: RedisProcess) -> redis.Redis:
        """A client of Redis ``r`` (over TLS on a TLS head)."""
        return self.tls.client(r.port) if self.tls else r.client()

    def primary_port(self) -> int | None:
        """The primary as the Sentinels' majority names it now."""
        votes: dict[int, int] = {}
        for s in self.sentinels:
            found = s.primary()
            if found:
                votes[found[1]] = votes.get(found[1], 0) + 1
        if not votes:
            return None
        port, n = max(votes.items(), key=lambda kv: kv[1])
        return port if n * 2 > len(self.sentinels) else None

    def cut_replication(self, primary_port: int) -> list[RedisProcess]:
        """Make the replicas of ``primary_port`` stop receiving its writes (and unable to resync): from here on what
        the primary takes, a promoted replica will not have. (A SIGSTOPped replica would not do: the stream already
        sent sits in its socket buffer and is read when it resumes.) Returns the replicas."""
        replicas = [r for r in self.redis if r.port != primary_port and r.proc and r.proc.poll() is None]
        for r in replicas:
            self.client_of(r).config_set("masterauth", "not-the-password")  # its next sync is refused
        self.client_of(self.process_on(primary_port)).client_kill_filter(_type="replica")
        return replicas

    def restore_replication(self, replicas: list[RedisProcess]) -> None:
        for r in replicas:
            self.client_of(r).config_set("masterauth", "")

    def stable_primary(self, for_s: float = 3.0, timeout_s: float = 120) -> int:
        """Wait until every Sentinel names the same primary, and has for ``for_s`` (a loaded machine may fail over
        twice: a just-promoted replica that stalls past ``down-after`` is failed over in turn)."""
        since: list[float | None] = [None]
        seen: list[int | None] = [None]

        def stable() -> bool:
            named = {s.primary() for s in self.sentinels}
            port = next(iter(named))[1] if len(named) == 1 and None not in named else None  # type: ignore[index]
            if port is None or port != seen[0]:
                seen[0], since[0] = port, time.monotonic()
                return False
            return time.monotonic() - (since[0] or 0) >= for_s

        wait_until(stable, timeout_s, what="one primary named by every Sentinel for a while")
        assert seen[0] is not None
        return seen[0]

    def freeze(self) -> None:
        """No more failovers (the checks after a scenario must read the Redis the scenario ended on)."""
        for s in self.sentinels:
            s.client(5).sentinel_set(MASTER, "down-after-milliseconds", 600_000)

    def process_on(self, port: int) -> RedisProcess:
        return next(r for r in self.redis if r.port == port)

    def wait_for_replicas(self, n: int, timeout_s: float = 30) -> None:
        """Until ``n`` replicas are *online* (synced and streaming; ``connected_slaves`` counts one still waiting for
        its first transfer, which holds nothing)."""
        primary = self.client_of(self.redis[0])

        def online() -> bool:
            info = primary.info("replication")
            return sum(1 for k, v in info.items() if k.startswith("slave") and v.get("state") == "online") >= n

        wait_until(online, timeout_s, what=f"{n} replicas online")

    def wait_for_new_primary(self, old_port: int, timeout_s: float = 60) -> int:
        """Wait until the Sentinels name a primary other than ``old_port`` and it answers as a primary."""

        def promoted() -> bool:
            port = self.primary_port()
            if port is None or port == old_port:
                return False
            try:
                return self.client_of(self.process_on(port)).info("replication")["role"] == "master"
            except redis.RedisError:
                return False

        wait_until(promoted, timeout_s, what=f"a primary other than port {old_port}")
        port = self.primary_port()
        assert port is not None
        return port


@dataclass
class SentinelFleet:
    """A Sentinel head with workers on it (:func:`sentinel_fleet`): the failover scenarios' common ground."""

    head: SentinelHead
    settings: Settings
    client: redis.Redis
    workers: list[WorkerProcess]
    tmp_path: Path
    #: The simulator's base URL (its ``/control/stats`` counts every request: re-runs show there).
    sim_url: str = ""

    def done(self, job: str) -> int:
        """Rows done in Redis now (-1 while no primary answers)."""
        return job_progress_or_down(self.client, self.settings.keys, job)["done"]

    def wait_done(self, job: str, at_least: int, what: str, timeout_s: float = 240) -> None:
        wait_until(lambda: self.done(job) >= at_least, timeout_s, what=what)

    def settle(self, job: str, total: int) -> None:
        """The job finished on a head that stays put: a loaded machine may fail over twice (a promoted replica that
        stalls past down-after is failed over in turn: one more rollback, which the running workers recover too),
        so once the Sentinels agree for a while, no more failovers, and the job is finished on the Redis it ends
        on."""
        self.wait_done(job, total, f"{total} rows")
        self.head.stable_primary()
        self.head.freeze()
        self.wait_done(job, total, f"{total} rows, settled")

    def start_wait(self, job: str) -> tuple[subprocess.Popen[bytes], Path]:
        """``producer wait JOB`` polling all along (it must ride through the failover): the process and its stderr."""
        err = self.tmp_path / f"wait-{job}.err"
        argv = [sys.executable, "-m", "producer.cli", "wait", job, "--interval", "0.2", "--timeout", "600"]
        proc = subprocess.Popen(argv, env=cli_env(self.settings), stdout=subprocess.DEVNULL, stderr=err.open("w"))
        return proc, err

    def stop_workers(self) -> None:
        for w in self.workers:
            w.terminate()


@contextmanager
def sentinel_fleet(
    tmp_path: Path,
    sim_args: tuple[str, ...] = (),
    head_options: tuple[str, ...] = (),
    redis_options: dict[int, tuple[str, ...]] | None = None,
    clock_offsets_s: dict[int, int] | None = None,
    worker_options: dict[str, object] | None = None,
    tls: bool = False,
) -> Iterator[SentinelFleet]:
    """A :class:`SentinelHead`, the simulator and two workers on the head's ``sentinel://`` URL, all stopped after
    (``redis_options``, ``clock_offsets_s``: as :class:`SentinelHead` takes them; ``worker_options``: settings of
    the workers over testing.harness.FAST_WORKER's, e.g. ``{"lease_s": 20}``; ``tls``: the head on TLS only, its URL
    ``?ssl=true&sentinel_ssl=true&ssl_ca_certs=…``, testing/sentinel_tls.py)."""
    RedisServer(tmp_path / "probe")  # fails (CI) or skips the test when redis-server is missing
    head = SentinelHead(
        tmp_path / "head",
        options=head_options,
        redis_options=redis_options,
        clock_offsets_s=clock_offsets_s,
        tls=TlsFiles.make(tmp_path / "tls") if tls else None,
    ).start()
    try:
        settings = isolated_settings(head.url(), str(tmp_path / "out"))
        client = sync_client(head.url())
        with simulator(tmp_path, "--time-scale", "60", *sim_args) as sim:
            env = fast_env(settings, sim, **{"max_inflight": 6, **(worker_options or {})})
            workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
            try:
                for w in workers:
                    w.wait_ready(client, settings.keys)
                yield SentinelFleet(head, settings, client, workers, tmp_path, sim)
            finally:
                for w in workers:
                    w.terminate()
    finally:
        head.stop()
