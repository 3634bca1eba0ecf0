"""Shared fixtures: a private redis-server per test session, and helpers to find free ports.

Tests never touch the shared Redis at 127.0.0.1:6379: each session starts its own redis-server on a
free port (so parallel runs and a developer's data stay apart) and each test gets a fresh DB.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from thinkfleet.testing.fleet import free_port, wait_for_port

__all__ = ["RedisServer", "free_port", "wait_for_port"]

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    """A redis-server subprocess we own (so we may flush it, restart it, or kill it)."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.workdir),
            "--databases",
            "64",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


_db_counter = iter(range(1, 64))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A fresh DB on the private server for one test (DBs are handed out round-robin and flushed)."""
    db = next(_db_counter, None)
    if db is None:
        db = 1
    client = redis.Redis.from_url(redis_server.url(db))
    client.flushdb()
    yield redis_server.url(db)
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
