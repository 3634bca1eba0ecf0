"""deploy/Dockerfile: what the image is built from, who it runs as, and that it installs the project.

No Docker daemon is needed: the build context the Dockerfile copies is staged in a scratch directory
and the project is built from exactly that (an sdist through setuptools' PEP 517 backend), so a package
missing from the COPY lines, or a missing README.md the metadata points to, fails here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from tests.test_deploy_compose import REPO, load_compose

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY."""
    result = []
    for word, rest in instructions():
        if word == "COPY":
            *sources, dest = [a for a in rest.split() if not a.startswith("--")]
            result.append((sources, dest))
    return result


def test_image_is_python_311_slim_running_the_worker_as_a_non_root_user() -> None:
    steps = instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    assert json.loads(next(rest for word, rest in steps if word == "ENTRYPOINT")) == ["worker"]
    assert ("EXPOSE", load_compose("node")["services"]["worker"]["environment"]["THINKFLEET_METRICS_PORT"]) in steps


def test_image_bakes_in_no_secrets() -> None:
    for word, rest in instructions():
        if word in ("ARG", "ENV"):
            assert not re.search(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY|REDIS_URL", rest, re.IGNORECASE), rest
        if word == "COPY":
            assert ".env" not in rest.split() and "." not in rest.split()[:-1], f"COPY {rest} could carry .env"


def test_image_copies_every_package_the_project_installs() -> None:
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    top_level = {p.rstrip("*").rstrip(".") for p in patterns}
    copied = {source.rstrip("/") for sources, _ in copies() for source in sources}
    assert {pkg for pkg in top_level if (REPO / pkg).is_dir()} <= copied
    assert {"pyproject.toml", "README.md"} <= copied


def test_project_builds_from_exactly_what_the_image_copies(tmp_path: Path) -> None:
    # Given a build context holding only what the Dockerfile copies
    stage = tmp_path / "context"
    stage.mkdir()
    # (every COPY keeps the repository layout: files into WORKDIR, directories under their own name)
    for sources, dest in copies():
        for source in sources:
            origin = REPO / source
            assert dest in ("./", source), f"COPY {source} {dest} changes the layout; update this test"
            if origin.is_dir():
                shutil.copytree(origin, stage / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(origin, stage / source)
    # When the project is built there (`pip install .` runs the same PEP 517 backend)
    out = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
        cwd=stage,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Then it builds, and carries every console script's package
    assert build.returncode == 0, build.stderr[-3000:]
    sdist = out / build.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    for module in ("workers/cli.py", "producer/cli.py", "sglang_sim/cli.py", "thinkfleet/settings.py"):
        assert any(name.endswith(module) for name in names), module
