"""`producer status`, `wait`, `jobs` and `--help` start without the heavy modules submit, retry and storage use.

A status call is a few milliseconds of Redis; its cost is the interpreter and its imports (issue 24: < 0.5 s a
call). These tests run the CLI in a fresh interpreter, the way the installed ``producer`` script does
(``producer.cli:main``), and name the modules it must not load. No wall time is asserted: the figure is
bench/bench_scale.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What status and wait never use: Arrow, numpy, Celery/kombu, the tokenizers, aiohttp, the job-file parser.
HEAVY = ("pyarrow", "numpy", "celery", "kombu", "transformers", "tokenizers", "aiohttp", "yaml", "jinja2")

# Runs the console script's entry point (producer.cli:main) with ARGV, then prints the heavy modules it loaded.
_PROBE = """
import json, sys
argv, named = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
sys.argv = ["producer", *argv]
from producer.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = sorted({m.split(".")[0] for m in sys.modules} & named)
print("PROBE " + json.dumps({"code": code, "heavy": heavy}))
"""


def probe(*argv: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"no probe line: rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1].removeprefix("PROBE ")), proc.stdout


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["wait", "--help"], ["jobs", "--help"]])
def test_help_loads_no_heavy_module(argv: list[str]) -> None:
    result, out = probe(*argv)
    assert result["code"] == 0
    assert "Usage:" in out
    assert result["heavy"] == [], f"producer {' '.join(argv)} imported {result['heavy']}"


def test_status_of_a_job_loads_no_heavy_module(redis_url: str) -> None:
    # Given a Redis with no such job (status still connects, reads the record and renders its answer)
    env = {**os.environ, "THINKFLEET_REDIS_URL": redis_url, "THINKFLEET_KEY_PREFIX": "tfcliimports"}
    # When `producer status` and `producer jobs` run
    status, out = probe("status", "no-such-job", "--json", env=env)
    jobs, _ = probe("jobs", "--json", env=env)
    # Then they answered, and loaded none of the heavy modules
    assert status["code"] == 0 and '"exists": false' in out
    assert jobs["code"] == 0
    assert status["heavy"] == [] and jobs["heavy"] == []


def test_retry_loads_when_named_and_lists_its_own_help() -> None:
    from producer.cli import LAZY_COMMANDS, cli, load_lazy_command

    # The help kept for the listing is the command's own first paragraph, cut the same way at every width.
    for name, (_, _, kept) in LAZY_COMMANDS.items():
        command = load_lazy_command(name)
        stub = click.Command(name, help=kept)
        for limit in (30, 45, 60, 120):
            assert stub.get_short_help_str(limit) == command.get_short_help_str(limit), name
    assert "retry" in cli.list_commands(click.Context(cli))
    # A fresh interpreter loads retry only when it is named.
    result, out = probe("retry", "--help")
    assert result["code"] == 0 and "--truncated" in out


def test_the_console_script_is_the_probed_entry_point() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["producer"] == "producer.cli:main"
