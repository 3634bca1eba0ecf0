"""A private ``redis-server`` subprocess its owner may flush, restart, kill or roll back: one class for the
tests (:class:`testing.services.RedisServer`, which fails or skips a test when redis-server is missing) and the
benchmarks (``bench/``, which stop with a message). No pytest here: benchmarks run without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from testing.fleet import free_port, wait_for_port

REDIS_SERVER = shutil.which("redis-server")


class RedisProcess:
    """``redis-server`` on a free port (or ``port``), no RDB snapshots (``--save ""``: a test takes its own with
    BGSAVE), AOF with ``appendfsync always`` when ``appendonly``."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        appendonly: bool = False,
        databases: int = 64,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.databases = databases
        self.extra = extra  # more redis-server options (``--replicaof``, ``--min-replicas-to-write``, …)
        self.proc: subprocess.Popen[bytes] | None = None

    def missing(self) -> None:
        """redis-server is not installed: what the owner does about it (here: stop, saying so)."""
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")

    def start(self) -> RedisProcess:
        if REDIS_SERVER is None:
            self.missing()
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--dir", str(self.workdir), "--databases", str(self.databases)]
        args += ["--logfile", str(self.workdir / "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)
        return self

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (a clean shutdown), or SIGKILL with ``kill`` (a crash: what AOF or a snapshot holds survives)."""
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis.from_url(self.url(db))
