"""The house lints with ruff (pyproject.toml [tool.ruff]): the suite fails on a lint finding or an unformatted file,
so a change that breaks either never lands (they went unnoticed when only a person ran ruff)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing() -> None:
    out = _ruff("check", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_every_file_is_formatted() -> None:
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
