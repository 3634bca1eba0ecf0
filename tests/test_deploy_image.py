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
                (stage / source).parent.mkdir(parents=True, exist_ok=True)
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


# -- reproducible builds ---------------------------------------------------------------------------

CONSTRAINTS = REPO / "deploy" / "constraints.txt"


def pins() -> dict[str, str]:
    """Canonical name → version of every ``name==version`` line of deploy/constraints.txt."""
    from packaging.utils import canonicalize_name

    found = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and re.fullmatch(r"[A-Za-z0-9._-]+", name), f"not an exact pin: {line!r}"
        found[canonicalize_name(name)] = version
    return found


def test_image_installs_the_pinned_versions() -> None:
    steps = instructions()
    runs = [rest for word, rest in steps if word == "RUN"]
    # The pins are installed first (a cached layer), and `pip install .` is held to them.
    assert any("pip install --requirement deploy/constraints.txt" in run for run in runs)
    install = next(run for run in runs if re.search(r"pip install .*\s\.(\s|$)", run))
    assert "--constraint deploy/constraints.txt" in install
    copied = [i for i, (word, rest) in enumerate(steps) if word == "COPY" and "deploy/constraints.txt" in rest]
    first_pip = next(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "pip install" in rest)
    assert copied and copied[0] < first_pip


def test_constraints_pin_every_runtime_dependency_within_pyproject() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from deploy.constraints import closure, pyproject

    pinned = pins()
    project = pyproject()["project"]
    for text in project["dependencies"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} (pyproject) is not pinned in deploy/constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} violates {req}"
    # Everything they pull in is pinned too (a new dependency: rerun deploy/constraints.py)…
    missing = set(closure(project["dependencies"])) - set(pinned)
    assert not missing, f"not pinned (run: .venv/bin/python deploy/constraints.py > deploy/constraints.txt): {missing}"
    # …and nothing dev-only or the project itself.
    for extra in ("dev", "demo"):
        for text in project["optional-dependencies"][extra]:
            name = canonicalize_name(Requirement(text).name)
            assert name not in pinned or name in closure(project["dependencies"]), f"dev-only {name} is pinned"
    assert canonicalize_name(project["name"]) not in pinned


def test_image_carries_the_healthcheck_the_compose_files_run() -> None:
    assert (["deploy/healthcheck.py"], "deploy/healthcheck.py") in copies()
    workdir = next(rest for word, rest in instructions() if word == "WORKDIR")
    worker = load_compose("node")["services"]["worker"]
    assert f"{workdir}/deploy/healthcheck.py" in worker["healthcheck"]["test"]


# -- the build context -----------------------------------------------------------------------------


def dockerignore() -> list[tuple[bool, str]]:
    """(negated, pattern) of every .dockerignore rule, in order."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").strip("/")))
    return rules


def ignored(path: str) -> bool:
    """Whether Docker leaves ``path`` (relative to the context) out: the last matching rule wins, and a
    rule matching a parent directory covers everything below it (``**`` matches any depth)."""
    from fnmatch import fnmatchcase

    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negated, pattern in dockerignore():
        regex = pattern.replace("**/", "(.*/)?")
        for prefix in prefixes:
            if fnmatchcase(prefix, pattern) or re.fullmatch(_glob_regex(regex), prefix):
                result = not negated
                break
    return result


def _glob_regex(pattern: str) -> str:
    out = ""
    for token in re.split(r"(\(\.\*/\)\?|\*|\?)", pattern):
        out += {"(.*/)?": "(.*/)?", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
    return out


def test_dockerignore_keeps_secrets_and_local_state_out_of_the_build_context() -> None:
    for path in (
        *(".env", ".git/config", ".venv/bin/python", "secrets/redis_worker_password", "deploy/head/secrets/x"),
        *("thinkfleet-output/job/part.parquet", ".demo/redis.log", "tests/test_deploy_image.py"),
        *("workers/__pycache__/app.cpython-311.pyc", "thinkfleet.egg-info/PKG-INFO"),
    ):
        assert ignored(path), f"{path} would be sent to the Docker daemon"
    # …but everything the Dockerfile copies is there.
    for sources, _ in copies():
        for source in sources:
            assert not ignored(source), f"COPY {source} is excluded by .dockerignore"
            origin = REPO / source
            for child in origin.rglob("*.py") if origin.is_dir() else []:
                if "__pycache__" not in child.parts:
                    rel = str(child.relative_to(REPO))
                    assert not ignored(rel), f"{rel} is excluded by .dockerignore"
