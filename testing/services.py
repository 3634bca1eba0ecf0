"""Services the tests need: a missing one skips a test on a developer's machine and FAILS it under CI
(``CI`` set, as CI runners and ``.ci/run`` do) — CI must never pass by skipping. Also a private
``redis-server`` a test owns (to flush, restart or kill it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from testing.fleet import free_port, wait_for_port

REDIS_SERVER = shutil.which("redis-server")


def in_ci() -> bool:
    """``CI`` is set (GitHub Actions, GitLab and most runners set ``CI=true``; ``.ci/run`` does too)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def service_missing(reason: str) -> None:
    """Skip the test for a missing service — or, under CI, fail it."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: a missing service fails the run instead of skipping it)", pytrace=False)
    pytest.skip(reason)


def needs_service(available: bool, reason: str) -> pytest.MarkDecorator:
    """A mark: the test needs a service; when ``available`` is false it is skipped, or failed under CI."""
    return pytest.mark.thinkfleet_service(available=available, reason=reason)


class RedisServer:
    """A redis-server subprocess we own (so we may flush it, restart it, or kill it)."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        if REDIS_SERVER is None:
            service_missing("redis-server is not installed")
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
