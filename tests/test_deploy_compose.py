"""The compose files: valid Compose, and the deployment invariants thinkfleet relies on.

Every file is checked against the Compose Specification schema (vendored as deploy/compose-spec.json,
so nothing is downloaded) after the same ``${VAR…}`` interpolation docker compose applies, using
.env.example as the .env; and with Debian's ``docker-compose`` when it is installed. The helpers here
(``load_compose``, ``dotenv``…) are shared by the other tests/test_deploy_*.py files.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parents[1]
ENV_EXAMPLE = REPO / ".env.example"
SCHEMA = REPO / "deploy" / "compose-spec.json"
COMPOSE = {
    "node": REPO / "docker-compose.yml",
    "sim": REPO / "deploy" / "docker-compose.sim.yml",
    "head": REPO / "deploy" / "head" / "docker-compose.yml",
}
DOCKER_COMPOSE = shutil.which("docker-compose")
SGLANG_PORT = "30000"
WORKER_METRICS_PORT = "9464"
#: Time the worker needs after the grace period: the final group commit and the hand-back to Redis.
HAND_BACK_MARGIN_S = 15.0


# -- helpers (imported by the other deploy tests) -------------------------------------------------


def dotenv(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """Assigned variables of a .env file, read the way compose reads it (no quotes, no expansion)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, value = line.split("=", 1)
            values[name.strip()] = value
    return values


def documented(path: Path = ENV_EXAMPLE) -> set[str]:
    """Variables a .env file documents: assigned, or shown commented out (``# NAME=value``)."""
    return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", path.read_text(), flags=re.MULTILINE))


class MissingVariable(ValueError):
    pass


_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``, ``${VAR:?e}``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        dollar, name, op, arg, bare = m.groups()
        if dollar:
            return "$"
        name = name or bare
        current = env.get(name)
        # ":-"/":?" treat an empty value as unset; "-"/"?" only a missing one.
        unset = not current if op in (":-", ":?") else current is None
        if op and op.endswith("-") and unset:
            return arg
        if op and op.endswith("?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        return current or ""

    return _VAR.sub(substitute, value)


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _references(path: Path) -> list[re.Match[str]]:
    # From the parsed YAML, so comments (which compose never interpolates) don't count.
    return [m for text in _strings(yaml.safe_load(path.read_text())) for m in _VAR.finditer(text)]


def variables(path: Path) -> set[str]:
    """Every variable a compose file interpolates."""
    return {m.group(2) or m.group(5) for m in _references(path) if not m.group(1)}


def required_variables(path: Path) -> set[str]:
    return {m.group(2) for m in _references(path) if m.group(3) in (":?", "?")}


def load_raw(name: str) -> dict[str, Any]:
    return yaml.safe_load(COMPOSE[name].read_text())


def load_compose(name: str, env: dict[str, str] | None = None, **overrides: str) -> dict[str, Any]:
    """A compose file as docker compose would run it with .env.example as its .env (plus overrides)."""
    values = dotenv() if env is None else dict(env)
    values.update(overrides)
    return interpolate(load_raw(name), values)


def command_args(value: str | list[str] | None) -> list[str]:
    """A service's command as argv: compose splits the string form like a POSIX shell."""
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def flag(args: list[str], name: str) -> str:
    """Value of ``--name value`` or ``--name=value`` in argv."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise KeyError(f"{name} not in {args}")


def duration_s(text: str) -> float:
    """Compose durations: ``90s``, ``1m30s``, ``1h``, ``500ms``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a compose duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def compose_schema_validator() -> jsonschema.protocols.Validator:
    # The vendored schema says draft 2019-09 (with a trailing '#' jsonschema does not recognise).
    return jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))


def schema_errors(document: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_schema_validator().iter_errors(document)
    ]


def setting_env_names() -> set[str]:
    return {f"THINKFLEET_{name.upper()}" for name in Settings.model_fields}


# -- the files are valid Compose ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPOSE))
def test_compose_file_matches_the_compose_spec_before_and_after_interpolation(name: str) -> None:
    assert schema_errors(load_raw(name)) == []
    assert schema_errors(load_compose(name)) == []


def test_schema_check_rejects_a_misspelt_key() -> None:
    # Given a worker service with a typo the compose CLI would refuse
    document = load_compose("node")
    document["services"]["worker"]["depend_on"] = document["services"]["worker"].pop("depends_on")
    # Then the schema check names it
    assert any("depend_on" in error for error in schema_errors(document))


@pytest.fixture(scope="module")
def compose_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch project directory with the repo's compose files and .env.example as .env."""
    root = tmp_path_factory.mktemp("compose")
    shutil.copy(ENV_EXAMPLE, root / ".env")
    for item in ("docker-compose.yml", "deploy", "pyproject.toml"):
        (root / item).symlink_to(REPO / item)
    return root


def docker_compose_config(project: Path, name: str, env_file: str = ".env") -> subprocess.CompletedProcess[str]:
    path = COMPOSE[name].relative_to(REPO)
    return subprocess.run(
        [DOCKER_COMPOSE or "docker-compose", "--env-file", env_file, "-f", str(path), "config"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose)")
@pytest.mark.parametrize("name", sorted(COMPOSE))
def test_docker_compose_accepts_the_file_with_the_example_env(compose_project: Path, name: str) -> None:
    result = docker_compose_config(compose_project, name)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["services"]


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose)")
def test_docker_compose_refuses_to_start_without_the_required_secrets(compose_project: Path) -> None:
    # Given a .env without the Redis password
    (compose_project / "no-password.env").write_text(
        "\n".join(f"{k}={v}" for k, v in dotenv().items() if k != "REDIS_PASSWORD") + "\n"
    )
    # Then the head node does not come up with an open Redis
    result = docker_compose_config(compose_project, "head", env_file="no-password.env")
    assert result.returncode != 0
    assert "REDIS_PASSWORD" in result.stderr


def test_the_sim_node_runs_the_same_worker_as_a_gpu_node() -> None:
    def resolved_worker(name: str) -> dict[str, Any]:
        worker = copy.deepcopy(load_compose(name)["services"]["worker"])
        base = COMPOSE[name].parent
        # Relative paths resolve against the compose file's directory.
        worker["build"]["context"] = str((base / worker["build"]["context"]).resolve())
        worker["env_file"] = str((base / worker["env_file"]).resolve())
        worker["volumes"] = [
            str((base / v.split(":")[0]).resolve()) + ":" + v.split(":", 1)[1] if v.startswith(".") else v
            for v in worker["volumes"]
        ]
        return worker

    assert resolved_worker("sim") == resolved_worker("node")


# -- SGLang ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["node", "sim"])
def test_sglang_port_is_never_published_beyond_the_node(name: str) -> None:
    services = load_compose(name)["services"]
    sglang = services["sglang"]
    assert "ports" not in sglang
    assert sglang.get("network_mode") != "host"
    assert SGLANG_PORT in [str(p) for p in sglang["expose"]]
    for service in services.values():
        for mapping in service.get("ports", []):
            assert not str(mapping).split("/")[0].endswith(":" + SGLANG_PORT), mapping
    assert services["worker"]["environment"]["THINKFLEET_SGLANG_URL"] == f"http://sglang:{SGLANG_PORT}"
    # Its only networks are internal ones, shared with the worker.
    networks = load_compose(name)["networks"]
    assert sglang["networks"] and all(networks[n].get("internal") is True for n in sglang["networks"])
    assert set(sglang["networks"]) <= set(services["worker"]["networks"])


def test_sglang_image_is_pinned_at_or_above_v0_5_5() -> None:
    for env in (dotenv(), {"MODEL_PATH": "/m", "NODE_NAME": "n"}):  # .env.example, and compose's default
        image = load_compose("node", env)["services"]["sglang"]["image"]
        repository, _, tag = image.partition(":")
        assert repository == "lmsysorg/sglang"
        version = re.match(r"v(\d+)\.(\d+)\.(\d+)", tag)
        assert version, f"{image} is not pinned to a release"
        assert tuple(map(int, version.groups())) >= (0, 5, 5)


def test_sglang_serves_the_model_with_kimi_parsers_metrics_and_bounded_queues() -> None:
    env = dotenv()
    sglang = load_compose("node")["services"]["sglang"]
    args = command_args(sglang["command"])
    assert args[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(args, "--model-path") == env["MODEL_PATH"]
    assert flag(args, "--tp") == env["TP_SIZE"]
    assert "--trust-remote-code" in args and "--enable-metrics" in args
    assert flag(args, "--reasoning-parser") == "kimi_k2"
    assert flag(args, "--tool-call-parser") == "kimi_k2"
    assert flag(args, "--port") == SGLANG_PORT
    # The server must be able to run everything the worker keeps in flight, and bounds its own queue.
    assert int(flag(args, "--max-running-requests")) >= int(env["THINKFLEET_MAX_INFLIGHT"])
    assert int(flag(args, "--max-queued-requests")) > 0
    # The model directory is mounted read-only at the path the server reports.
    assert f"{env['MODEL_PATH']}:{env['MODEL_PATH']}:ro" in sglang["volumes"]
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_sglang_extra_args_become_separate_flags() -> None:
    sglang = load_compose("node", SGLANG_EXTRA_ARGS="--dp 8 --enable-dp-attention")["services"]["sglang"]
    args = command_args(sglang["command"])
    assert args[-3:] == ["--dp", "8", "--enable-dp-attention"]


@pytest.mark.parametrize("name", ["node", "sim"])
def test_sglang_healthcheck_runs_a_real_generation(name: str) -> None:
    check = load_compose(name)["services"]["sglang"]["healthcheck"]
    probe = " ".join(check["test"])
    assert f"127.0.0.1:{SGLANG_PORT}/health_generate" in probe
    assert duration_s(check["timeout"]) > duration_s(check["interval"]) / 10


def test_sim_node_runs_the_simulator_in_place_of_sglang() -> None:
    sglang = load_compose("sim")["services"]["sglang"]
    assert sglang["entrypoint"] == ["sglang-sim"]
    assert flag(command_args(sglang["command"]), "--port") == SGLANG_PORT
    assert "deploy" not in sglang, "the CPU-only node must not reserve GPUs"


# -- the worker ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["node", "sim"])
def test_worker_starts_only_once_sglang_is_healthy_and_restarts_on_failure(name: str) -> None:
    worker = load_compose(name)["services"]["worker"]
    assert worker["depends_on"] == {"sglang": {"condition": "service_healthy"}}
    assert worker["restart"] == "unless-stopped"
    assert worker["init"] is True  # tini forwards SIGTERM to the worker


@pytest.mark.parametrize("env", [dotenv(), {"MODEL_PATH": "/m", "NODE_NAME": "n"}], ids=["env-example", "defaults"])
def test_worker_stop_grace_covers_the_drain(env: dict[str, str]) -> None:
    worker = load_compose("node", env)["services"]["worker"]
    grace_s = float(env.get("THINKFLEET_SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default))
    assert duration_s(worker["stop_grace_period"]) >= grace_s + HAND_BACK_MARGIN_S


def test_worker_settings_come_from_env_and_name_real_settings() -> None:
    worker = load_compose("node")["services"]["worker"]
    assert worker["env_file"] == ".env"
    assert set(worker["environment"]) <= setting_env_names()
    assert worker["environment"]["THINKFLEET_WORKER_NAME"] == dotenv()["NODE_NAME"]
    assert worker["hostname"] == dotenv()["NODE_NAME"]


def test_worker_metrics_port_is_published_for_prometheus() -> None:
    worker = load_compose("node")["services"]["worker"]
    assert worker["environment"]["THINKFLEET_METRICS_PORT"] == WORKER_METRICS_PORT
    assert f"{dotenv()['WORKER_METRICS_PORT']}:{WORKER_METRICS_PORT}" in worker["ports"]


# -- the head node ---------------------------------------------------------------------------------


def test_redis_is_durable_never_evicts_and_needs_a_password() -> None:
    raw = load_raw("head")["services"]["redis"]
    assert flag(raw["command"], "--requirepass").startswith("${REDIS_PASSWORD:?")
    redis = load_compose("head")["services"]["redis"]
    args = command_args(redis["command"])
    assert flag(args, "--appendonly") == "yes"
    assert flag(args, "--appendfsync") == "everysec"
    assert flag(args, "--maxmemory-policy") == "noeviction"
    assert flag(args, "--requirepass") == dotenv()["REDIS_PASSWORD"]
    assert flag(args, "--dir") == "/data"
    volume = next(v for v in redis["volumes"] if v.endswith(":/data"))
    assert volume.split(":")[0] in load_raw("head")["volumes"], "Redis data must live on a named volume"


def test_flower_requires_basic_auth_and_keeps_state_for_a_whole_job() -> None:
    raw = load_raw("head")["services"]["flower"]
    assert raw["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    flower = load_compose("head")["services"]["flower"]
    args = [*flower["entrypoint"], *command_args(flower["command"])]
    assert args[:4] == ["celery", "-A", "workers.app", "flower"]
    assert flag(args, "--persistent") == "True"
    db = flag(args, "--db")
    assert any(v.endswith(":" + str(Path(db).parent)) for v in flower["volumes"])
    # 88k prompts plus retries and a second job: above Flower's 100k default.
    assert int(flag(args, "--max_tasks")) > 100_000
    assert flower["depends_on"]["redis"]["condition"] == "service_healthy"


def test_no_secret_is_written_into_a_compose_file() -> None:
    for name in COMPOSE:
        text = COMPOSE[name].read_text()
        for line in text.splitlines():
            if re.search(r"(PASSWORD|BASIC_AUTH|SECRET)\w*:\s*\S", line) or "--requirepass" in line:
                assert "${" in line or line.strip().endswith("--requirepass"), line


# -- .env.example ----------------------------------------------------------------------------------


def test_env_example_documents_every_variable_the_compose_files_use() -> None:
    used = set().union(*(variables(path) for path in COMPOSE.values()))
    assert used - documented() == set()


def test_env_example_documents_every_thinkfleet_setting_and_no_stale_one() -> None:
    documented_settings = {name for name in documented() if name.startswith("THINKFLEET_")}
    # THINKFLEET_IMAGE is the compose image name, not a setting.
    assert setting_env_names() - documented_settings == set()
    assert documented_settings - setting_env_names() - {"THINKFLEET_IMAGE"} == set()


def test_env_example_values_are_valid_settings() -> None:
    env = {k: v for k, v in dotenv().items() if k.startswith("THINKFLEET_") and k != "THINKFLEET_IMAGE"}
    settings = Settings(**{k.removeprefix("THINKFLEET_").lower(): v for k, v in env.items()})
    assert settings.max_inflight == int(env["THINKFLEET_MAX_INFLIGHT"])


def test_env_example_sets_every_required_variable() -> None:
    required = set().union(*(required_variables(path) for path in COMPOSE.values()))
    assert required - set(dotenv()) == set()
    with pytest.raises(MissingVariable, match="MODEL_PATH"):
        load_compose("node", {k: v for k, v in dotenv().items() if k != "MODEL_PATH"})


def test_screenshot_script_runs_flower_with_the_head_node_flags() -> None:
    script = (REPO / "scripts" / "flower_screenshot.sh").read_text()
    block = script[script.index("workers.app flower") : script.index('>"$WORK/flower.log"')]
    local = {"--port", "--address", "--db"}  # loopback, a free port and a scratch state file
    script_flags = {k: v for k, v in re.findall(r"(--\w+)=(\S+)", block) if k not in local}
    compose = command_args(load_compose("head")["services"]["flower"]["command"])
    compose_flags = dict(a.split("=", 1) for a in compose if a.startswith("--") and a.split("=")[0] not in local)
    assert script_flags == compose_flags
