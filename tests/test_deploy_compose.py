"""The compose files: valid Compose, and the deployment invariants thinkfleet relies on.

Every file is checked against the Compose Specification schema (vendored as deploy/compose-spec.json,
so nothing is downloaded) after the same ``${VAR…}`` interpolation docker compose applies, using
.env.example as the .env; and with Debian's ``docker-compose`` when it is installed. The helpers here
(``load_compose``, ``dotenv``…) are shared by the other tests/test_deploy_*.py files.
"""

from __future__ import annotations

import copy
import json
import os
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
#: Opt-in override files (TLS) and the base file each goes on top of.
OVERRIDES = {
    "head-tls": (REPO / "deploy" / "head" / "docker-compose.tls.yml", "head"),
    "node-tls": (REPO / "deploy" / "docker-compose.tls.yml", "node"),
    "head-sentinel": (REPO / "deploy" / "head" / "docker-compose.sentinel.yml", "head"),
}
ACL_TEMPLATE = REPO / "deploy" / "head" / "redis" / "users.acl.template"
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
    path = COMPOSE[name] if name in COMPOSE else OVERRIDES[name][0]
    return yaml.safe_load(path.read_text())


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


@pytest.mark.parametrize("name", sorted(COMPOSE) + sorted(OVERRIDES))
def test_compose_file_matches_the_compose_spec_before_and_after_interpolation(name: str) -> None:
    assert schema_errors(load_raw(name)) == []
    env = {**dotenv(), "REDIS_TLS_CA_FILE": "/srv/secrets/redis_tls_ca.crt"}
    assert schema_errors(load_compose(name, env)) == []


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


def docker_compose_config(
    project: Path, name: str, env_file: str = ".env", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` of a base file, or of an override on top of its base file."""
    files = [COMPOSE[OVERRIDES[name][1]], OVERRIDES[name][0]] if name in OVERRIDES else [COMPOSE[name]]
    args = [a for path in files for a in ("-f", str(path.relative_to(REPO)))]
    return subprocess.run(
        [DOCKER_COMPOSE or "docker-compose", "--env-file", env_file, *args, "config"],
        env=None if env is None else {**os.environ, **env},
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
    config = yaml.safe_load(result.stdout)
    assert config["services"]
    # Log rotation, secrets and ACL entrypoint survive compose's own parsing (anchors resolved).
    for service in config["services"].values():
        assert service["logging"]["driver"] == "json-file"
    if name == "head":
        assert {"redis_worker_password", "redis_flower_password"} <= set(config["secrets"])


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose)")
@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_docker_compose_merges_each_override_onto_its_base_file(compose_project: Path, name: str) -> None:
    result = docker_compose_config(compose_project, name, env={"REDIS_TLS_CA_FILE": "/srv/secrets/ca.crt"})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    if name == "head-tls":
        redis = services["redis"]
        assert redis["environment"]["REDIS_TLS_CERT_FILE"] == "/run/secrets/redis_tls_server_cert"
        # The override adds secrets; the ACL passwords of the base file stay mounted.
        sources = {s["source"] if isinstance(s, dict) else s for s in redis["secrets"]}
        assert {"redis_tls_server_key", "redis_tls_ca", "redis_worker_password"} <= sources
        assert services["flower"]["environment"]["THINKFLEET_REDIS_URL"].startswith("rediss://flower@redis:6379/")
        assert services["redis-exporter"]["environment"]["REDIS_ADDR"] == "rediss://redis:6379"
    elif name == "head-sentinel":
        # The head that fails over: each Redis replicates as `replica` and is watched by a Sentinel logged in as
        # `sentinel` (passwords from files); Flower follows the primary through the Sentinels.
        redis = services["redis"]
        assert redis["environment"]["REDIS_HA"] == "yes"
        sources = {s["source"] if isinstance(s, dict) else s for s in redis["secrets"]}
        assert {"redis_replica_password", "redis_sentinel_password", "redis_worker_password"} <= sources
        sentinel = services["sentinel"]
        assert sentinel["entrypoint"] == ["/bin/sh", "/usr/local/etc/thinkfleet-sentinel/entrypoint.sh"]
        assert not str(sentinel["ports"][0]).startswith("0.0.0.0")  # on REDIS_BIND, loopback by default
        assert services["flower"]["environment"]["THINKFLEET_REDIS_URL"].startswith("sentinel://flower@")
    else:
        sources = {s["source"] if isinstance(s, dict) else s for s in services["worker"]["secrets"]}
        assert sources == {"redis_worker_password", "redis_tls_ca", "signing_key"}  # the producer's signing key


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose)")
def test_node_tls_override_needs_the_ca_certificate(compose_project: Path) -> None:
    result = docker_compose_config(compose_project, "node-tls", env={"REDIS_TLS_CA_FILE": ""})
    assert result.returncode != 0
    assert "REDIS_TLS_CA_FILE" in result.stderr


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
    # The server bounds its batch (the worker's auto in-flight bound starts from it) and its own queue; a cap set
    # in .env must not be below the batch bound.
    assert int(flag(args, "--max-running-requests")) > 0
    if "THINKFLEET_MAX_INFLIGHT" in env:
        assert int(flag(args, "--max-running-requests")) <= int(env["THINKFLEET_MAX_INFLIGHT"])
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


def test_worker_metrics_port_is_published_for_prometheus_on_the_private_address_only() -> None:
    env = dotenv()
    worker = load_compose("node")["services"]["worker"]
    assert worker["environment"]["THINKFLEET_METRICS_PORT"] == WORKER_METRICS_PORT
    assert f"{env['WORKER_METRICS_BIND']}:{env['WORKER_METRICS_PORT']}:{WORKER_METRICS_PORT}" in worker["ports"]
    private = load_compose("node", WORKER_METRICS_BIND="10.0.0.11")["services"]["worker"]
    assert f"10.0.0.11:{env['WORKER_METRICS_PORT']}:{WORKER_METRICS_PORT}" in private["ports"]


@pytest.mark.parametrize("name", ["node", "sim"])
def test_worker_reads_its_redis_password_from_a_compose_secret(name: str) -> None:
    document = load_compose(name)
    worker = document["services"]["worker"]
    path = worker["environment"]["THINKFLEET_REDIS_PASSWORD_FILE"]
    assert path == "/run/secrets/redis_worker_password"
    assert worker["secrets"] == ["redis_worker_password", "signing_key"]
    source = Path(document["secrets"]["redis_worker_password"]["file"])
    assert (COMPOSE[name].parent / source).resolve() == REPO / "secrets" / "redis_worker_password"
    assert load_compose(name, SECRETS_DIR="/srv/s")["secrets"]["redis_worker_password"]["file"] == (
        "/srv/s/redis_worker_password"
    )
    # The signing key (thinkfleet/signing.py) is a secret of its own, made by make-secrets.sh beside the passwords.
    assert worker["environment"]["THINKFLEET_SIGNING_KEY_FILE"] == "/run/secrets/signing_key"
    key_file = COMPOSE[name].parent / document["secrets"]["signing_key"]["file"]
    assert key_file.resolve() == REPO / "secrets" / "signing_key"
    assert "signing_key" in (REPO / "deploy" / "make-secrets.sh").read_text()
    # The URL names the ACL user; the password is not in .env at all.
    url = dotenv()["THINKFLEET_REDIS_URL"]
    assert url.startswith("redis://worker@") and ":" not in url.split("//")[1].split("@")[0]


# -- the head node ---------------------------------------------------------------------------------


def acl_users() -> list[str]:
    """Users of the ACL template (the rendered file has one line per user; see entrypoint.sh)."""
    return re.findall(r"^user (\S+)", ACL_TEMPLATE.read_text(), flags=re.MULTILINE)


def test_redis_is_durable_never_evicts_and_runs_with_the_acl_file() -> None:
    redis = load_compose("head")["services"]["redis"]
    args = command_args(redis["command"])
    assert flag(args, "--appendonly") == "yes"
    assert flag(args, "--appendfsync") == "everysec"
    assert flag(args, "--maxmemory-policy") == "noeviction"
    assert flag(args, "--dir") == "/data"
    assert "--requirepass" not in args, "one shared password on argv is what the ACL replaces"
    volume = next(v for v in redis["volumes"] if v.endswith(":/data"))
    assert volume.split(":")[0] in load_raw("head")["volumes"], "Redis data must live on a named volume"
    # The entrypoint renders the ACL from the template mounted next to it, onto a tmpfs.
    assert redis["entrypoint"] == ["/bin/sh", "/usr/local/etc/thinkfleet/entrypoint.sh"]
    assert "./redis:/usr/local/etc/thinkfleet:ro" in redis["volumes"]
    assert "/run/thinkfleet-redis" in redis["tmpfs"]
    # Every user of the template but the (disabled) default one gets its password file as a secret,
    # and the prefix, queue and database the patterns are written for match the clients'.
    users = acl_users()
    assert {"default", "producer", "worker", "flower", "exporter"} <= set(users)
    assert set(redis["secrets"]) == {f"redis_{u}_password" for u in users if u != "default"}
    env = dotenv()
    assert redis["environment"]["THINKFLEET_KEY_PREFIX"] == env["THINKFLEET_KEY_PREFIX"]
    assert redis["environment"]["THINKFLEET_QUEUE"] == env["THINKFLEET_QUEUE"]
    assert redis["environment"]["REDIS_DB"] == env["REDIS_DB"]
    assert "healthcheck.sh" in " ".join(redis["healthcheck"]["test"])


ADMIN_COMMANDS = {
    *("flushall", "flushdb", "keys", "config", "debug", "shutdown", "acl", "module", "monitor"),
    *("function", "migrate", "restore", "swapdb", "save", "bgsave", "replicaof", "slaveof"),
}


def test_default_user_is_off_and_no_role_gets_admin_commands() -> None:
    rules = {}
    for block in re.split(
        r"\n(?=user )", "\n".join(line for line in ACL_TEMPLATE.read_text().splitlines() if not line.startswith("#"))
    ):
        words = block.split()
        if words and words[0] == "user":
            rules[words[1]] = words[2:]
    assert rules["default"][0] == "off" and "-@all" in rules["default"]
    for role in ("producer", "worker", "flower", "exporter"):
        words = rules[role]
        assert words.index("-@all") < words.index("+@connection"), role
        assert "-@dangerous" in words and "-@admin" in words, role
        granted = {w[1:].split("|")[0] for w in words if w.startswith("+") and not w.startswith("+@")}
        assert not granted & ADMIN_COMMANDS, role
        assert "~*" not in words and "allkeys" not in words and "&*" not in words, role


@pytest.mark.parametrize("name", sorted(COMPOSE))
def test_published_ports_never_default_to_all_interfaces(name: str) -> None:
    # Docker publishes "PORT:PORT" on 0.0.0.0, past ufw/firewalld: every port names its address.
    for env in (dotenv(), {"MODEL_PATH": "/m", "NODE_NAME": "n", **_required_placeholders()}):
        for service_name, service in load_compose(name, env).get("services", {}).items():
            for mapping in service.get("ports", []):
                host_ip = str(mapping).split(":")[0]
                assert str(mapping).count(":") == 2, f"{service_name}: {mapping} has no host address"
                assert host_ip not in ("0.0.0.0", "", "::"), f"{service_name}: {mapping}"
    head = load_compose("head", REDIS_BIND="10.0.0.10")["services"]["redis"]
    assert f"10.0.0.10:{dotenv()['REDIS_PORT']}:6379" in head["ports"]


def _required_placeholders() -> dict[str, str]:
    return {"FLOWER_BASIC_AUTH": "a:b", "GRAFANA_ADMIN_PASSWORD": "x"}


@pytest.mark.parametrize("name", sorted(COMPOSE))
def test_every_service_rotates_its_logs(name: str) -> None:
    env = dotenv()
    for service_name, service in load_compose(name)["services"].items():
        logging = service.get("logging")
        assert logging, f"{service_name} in {name} keeps one log file that grows forever"
        assert logging["driver"] == "json-file"
        assert logging["options"] == {"max-size": env["LOG_MAX_SIZE"], "max-file": env["LOG_MAX_FILE"]}
    # compose's defaults, too
    defaults = load_compose(name, {"MODEL_PATH": "/m", "NODE_NAME": "n", **_required_placeholders()})
    for service in defaults["services"].values():
        assert duration_or_size(service["logging"]["options"]["max-size"]) > 0
        assert int(service["logging"]["options"]["max-file"]) >= 2


def duration_or_size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", text).groups()  # type: ignore[union-attr]
    return int(number) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit]


@pytest.mark.parametrize("name", sorted(COMPOSE))
def test_no_shm_size_beside_ipc_host(name: str) -> None:
    # With ipc: host the container uses the host's /dev/shm; shm_size would silently do nothing.
    for service_name, service in load_compose(name)["services"].items():
        assert not ("shm_size" in service and service.get("ipc") == "host"), service_name


def test_sglang_keeps_its_jit_kernel_caches_on_a_volume() -> None:
    document = load_compose("node")
    sglang = document["services"]["sglang"]
    assert "sglang-cache:/root/.cache" in sglang["volumes"] and "sglang-cache" in document["volumes"]
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert sglang["environment"][variable].startswith("/root/.cache/")


@pytest.mark.parametrize(("name", "service_name"), [("node", "sglang"), ("node", "worker"), ("sim", "sglang")])
def test_an_unhealthy_container_is_restarted(name: str, service_name: str) -> None:
    # Docker only marks it unhealthy; the healthcheck itself makes the container exit, then the
    # restart policy starts it again (tests/test_deploy_services.py runs the script).
    service = load_compose(name)["services"][service_name]
    kind, *argv = service["healthcheck"]["test"]
    assert kind == "CMD" and argv[1] == "/opt/thinkfleet/deploy/healthcheck.py"
    assert int(flag(argv, "--restart-after")) > 0
    assert service["init"] is True, "PID 1 must be tini for the SIGTERM to reach the service"
    assert service["restart"] == "unless-stopped"
    if name == "node" and service_name == "sglang":
        assert "./deploy/healthcheck.py:/opt/thinkfleet/deploy/healthcheck.py:ro" in service["volumes"]


def test_flower_and_the_exporter_log_in_as_their_own_redis_users() -> None:
    head = load_compose("head")
    flower, exporter = head["services"]["flower"], head["services"]["redis-exporter"]
    assert flower["environment"]["THINKFLEET_REDIS_URL"] == f"redis://flower@redis:6379/{dotenv()['REDIS_DB']}"
    assert flower["environment"]["THINKFLEET_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_flower_password"
    assert flower["secrets"] == ["redis_flower_password"]
    assert exporter["environment"]["REDIS_USER"] == "exporter"
    assert exporter["environment"]["REDIS_PASSWORD_FILE"] == "/run/secrets/redis_exporter_passwords"
    assert exporter["environment"]["REDIS_EXPORTER_CONFIG_COMMAND"] == "-"
    assert exporter["secrets"] == ["redis_exporter_passwords"]
    assert head["secrets"]["redis_exporter_passwords"]["file"].endswith("/redis_exporter_passwords.json")


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
    paths = [*COMPOSE.values(), *(path for path, _ in OVERRIDES.values())]
    for path in paths:
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            assert "--requirepass" not in line and "REDIS_PASSWORD:" not in line, line
            # Redis URLs name a user, never a password.
            assert not re.search(r"rediss?://[^@\s/]*:[^@\s/]*@", line), line
            if re.search(r"(PASSWORD|BASIC_AUTH|SECRET)\w*:\s*\S", line) and "_FILE:" not in line:
                assert "${" in line, line


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
    assert settings.inflight_interval_s == float(env["THINKFLEET_INFLIGHT_INTERVAL_S"])
    # The example leaves the in-flight bound to the server (auto) under the default cap, not a guessed number.
    assert settings.inflight_mode == env["THINKFLEET_INFLIGHT_MODE"] == "auto" and "THINKFLEET_MAX_INFLIGHT" not in env
    assert settings.max_inflight == Settings.model_fields["max_inflight"].default


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
