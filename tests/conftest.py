"""Shared fixtures: a private redis-server per test session. Helpers live in the one test-support package,
:mod:`testing` (services, fleet processes, the worker harness, tokenizers, rows, datasets).

Tests never touch the shared Redis at 127.0.0.1:6379: each session starts its own redis-server on a
free port (so parallel runs and a developer's data stay apart) and each test gets a fresh DB.

A service a test needs (redis-server) that is missing skips the test on a developer's
machine but **fails** it under CI (``CI`` set, as CI runners do): CI must never pass by skipping.
Use ``testing.services.service_missing`` inside a test or fixture, or mark a module with
``needs_service``.

With ``THINKFLEET_RELIABILITY_RESULTS`` set, a failed or skipped reliability test leaves an honest
result row (``testing/harness.py`` ``record_failure``/``record_skip``), even when it failed
before it could record one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.services import RedisServer, service_missing

RESULTS_ENV = "THINKFLEET_RELIABILITY_RESULTS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "thinkfleet_service(available, reason): needs a service (see needs_service)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("thinkfleet_service"):
        if not mark.kwargs.get("available", True):
            service_missing(mark.kwargs.get("reason", "a service this test needs is missing"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Reliability tests leave a result row whatever happens: FAIL when they fail (even before they
    recorded anything), SKIP when skipped. Only with ``THINKFLEET_RELIABILITY_RESULTS`` set."""
    outcome = yield
    report = outcome.get_result()
    if not os.environ.get(RESULTS_ENV):
        return
    from bench.reliability_report import is_scenario_file

    if not is_scenario_file(item.path.name):
        return
    if not (report.failed or (report.skipped and not hasattr(report, "wasxfail"))):
        return
    from testing import record

    ci = item.get_closest_marker("slow") is None
    if report.failed:
        error = call.excinfo.exconly() if call.excinfo is not None else str(report.longrepr)
        error = error.strip().splitlines()[0] if error.strip() else "failed"
        tb = call.excinfo.tb if call.excinfo is not None else None
        record.record_failure(item.nodeid, f"{report.when}: {error}", ci=ci, tb=tb)
    else:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        record.record_skip(item.nodeid, str(reason), ci=ci)


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


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatorProcess]:
    """One fast simulator per module (400× time scale): its output depends only on the prompt and sampling params,
    so the module's scenarios share it. A module that needs another one defines its own ``sim``."""
    proc = SimulatorProcess("--time-scale", "400")
    proc.log_path = str(tmp_path_factory.mktemp("sim") / "sim.log")
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
