"""Services the tests need: a missing one skips a test on a developer's machine and FAILS it under CI
(``CI`` set, as CI runners and ``.ci/run`` do) — CI must never pass by skipping. Also a private
``redis-server`` a test owns (to flush, restart or kill it).
"""

from __future__ import annotations

import os

import pytest

# Re-exported for the tests that start a redis-server of their own (TLS, ACLs): one place says where it is.
from testing.fleet import free_port as free_port
from testing.fleet import wait_for_port as wait_for_port
from testing.redis_process import REDIS_SERVER as REDIS_SERVER
from testing.redis_process import RedisProcess


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


class RedisServer(RedisProcess):
    """A redis-server subprocess a test owns (so it may flush it, restart it, or kill it); a missing
    redis-server skips the test, or fails it under CI."""

    def missing(self) -> None:
        service_missing("redis-server is not installed")
