"""The ``worker`` script hands its flags to Celery as a Settings object, not through the environment."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

import workers.app
from thinkfleet.settings import Settings
from workers import cli


def test_worker_flags_reach_the_app_as_a_settings_object(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: the app the script builds is recorded instead of started
    seen: dict[str, Any] = {}

    def use_settings(settings: Settings) -> Any:
        seen["settings"] = settings
        return SimpleNamespace(
            conf=SimpleNamespace(worker_concurrency=7), worker_main=lambda argv: seen.setdefault("argv", argv) and 0
        )

    monkeypatch.setattr(workers.app, "use_settings", use_settings)
    before = dict(os.environ)
    # When: the script runs with flags
    flags = ["--queue", "q-cli", "--name", "w-cli", "--lease-s", "12", "--max-inflight", "5", "--redis-url"]
    result = CliRunner().invoke(cli.main, [*flags, "redis://localhost:6399/3"])
    # Then: the settings carry them, the environment is untouched, and celery's argv follows the settings
    assert result.exit_code == 0, result.output
    settings = seen["settings"]
    assert (settings.queue, settings.worker_name, settings.lease_s, settings.max_inflight) == ("q-cli", "w-cli", 12, 5)
    assert settings.broker_url == "redis://localhost:6399/3"  # the broker follows --redis-url, as from env
    assert dict(os.environ) == before
    argv = seen["argv"]
    assert argv[argv.index("--queues") + 1] == "q-cli" and argv[argv.index("--concurrency") + 1] == "7"
    assert argv[argv.index("--hostname") + 1] == "w-cli@%h"
