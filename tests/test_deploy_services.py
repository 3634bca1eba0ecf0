"""The commands the compose files run, run for real outside containers.

Each service's argv and environment are read from the compose files (interpolated with .env.example,
as ``docker compose`` would) and from deploy/Dockerfile; only what a container would provide differently
is swapped: loopback addresses, free ports, scratch directories, and the container paths of bind mounts
and secrets (mapped back to the repository and to a secrets directory deploy/make-secrets.sh fills).
One module-wide fleet — the head node's Redis (its entrypoint renders the ACL: one user per role, AOF,
noeviction), the sim node's ``sglang-sim``, the node's worker (user ``worker``) and the head node's
Flower (user ``flower``) — runs a small job submitted with ``producer submit`` (user ``producer``); the
tests then look at it the way an operator would: Flower's API and pages, the worker's metrics, a drain
with SIGTERM — and at the end, that Redis denied none of their commands (ACL LOG is empty).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from testing.services import REDIS_SERVER, free_port, wait_for_port
from tests.test_deploy_compose import (
    REPO,
    command_args,
    dotenv,
    duration_s,
    load_compose,
)
from thinkfleet.settings import Settings

MISSING = [m for m in ("sglang_sim.cli", "producer.cli", "storage.writer") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed"),
    pytest.mark.skipif(bool(MISSING), reason=f"not landed yet: {', '.join(MISSING)}"),
]

BIN = Path(sys.executable).parent
HEAD = REPO / "deploy" / "head"
#: Lower than .env.example's 50 so that generations of the drain test are still running at SIGTERM.
SIM_TIME_SCALE = "5"
#: The drain test's grace (the production default is 20 s; the mechanism is the same).
DRAIN_GRACE_S = 2


def replace_flag(args: list[str], name: str, value: str) -> list[str]:
    """argv with ``--name``'s value swapped (both ``--name v`` and ``--name=v``); the flag must exist."""
    out, found = list(args), False
    for i, arg in enumerate(out):
        if arg == name:
            out[i + 1], found = value, True
        elif arg.startswith(name + "="):
            out[i], found = f"{name}={value}", True
    assert found, f"{name} not in {args}"
    return out


def executable(argv: list[str]) -> list[str]:
    """argv with its program resolved in this venv (the image installs the same console scripts)."""
    program = BIN / argv[0]
    return [str(program) if program.exists() else argv[0], *argv[1:]]


def dockerfile_entrypoint() -> list[str]:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    return json.loads(re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, flags=re.MULTILINE)[-1])


def head_env() -> dict[str, str]:
    return dotenv()


def make_secrets(directory: Path) -> dict[str, str]:
    """deploy/make-secrets.sh into ``directory``; returns user → password."""
    result = subprocess.run(
        ["sh", str(REPO / "deploy" / "make-secrets.sh"), str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return {
        path.name.removeprefix("redis_").removesuffix("_password"): path.read_text().strip()
        for path in directory.glob("redis_*_password")
    }


def host_path(name: str, service: str, path: str, secrets_dir: Path) -> str:
    """Where a container path of a compose service is outside containers: a bind mount's source in the
    repository, or a compose secret's file (in ``secrets_dir``)."""
    document = load_compose(name, head_env())
    if path.startswith("/run/secrets/"):
        secret = document["secrets"][path.removeprefix("/run/secrets/")]
        return str(secrets_dir / Path(secret["file"]).name)
    for volume in document["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith(".") and (path == target or path.startswith(target + "/")):
            return str((COMPOSE_DIRS[name] / source).resolve()) + path[len(target) :]
    return path


COMPOSE_DIRS = {"head": HEAD, "node": REPO, "sim": REPO / "deploy"}


def http(url: str, auth: str | None = None, timeout_s: float = 10.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached within {timeout_s}s")


@dataclass
class Fleet:
    """Processes started from the compose commands, and what the tests need to reach them."""

    workdir: Path
    redis_url: str = ""  # as the worker user
    admin_url: str = ""  # the operators' account, for looking at Redis from the tests
    sim_url: str = ""
    flower_url: str = ""
    flower_auth: str = ""
    metrics_url: str = ""
    worker_env: dict[str, str] = field(default_factory=dict)
    producer_env: dict[str, str] = field(default_factory=dict)
    flower_env: dict[str, str] = field(default_factory=dict)
    passwords: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 — the child owns it
        proc = subprocess.Popen(executable(argv), env=env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def producer(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "producer"), *args],
            env=self.producer_env,
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def redis_entrypoint_env(fleet: Fleet, name: str) -> dict[str, str]:
    """The head node's redis environment, with the secrets and the rendered ACL file in scratch places."""
    redis = load_compose("head", head_env())["services"]["redis"]
    return {
        **os.environ,
        **redis["environment"],
        "REDIS_SECRETS_DIR": str(fleet.workdir / "secrets"),
        "REDIS_ACL_FILE": str(fleet.workdir / f"{name}-acl" / "users.acl"),
    }


def start_head_redis(fleet: Fleet, name: str = "redis") -> int:
    """The head node's redis service — its entrypoint (which renders the ACL from the template and the
    password files) and command — on a free loopback port with a scratch --dir."""
    redis = load_compose("head", head_env())["services"]["redis"]
    if not fleet.passwords:
        fleet.passwords = make_secrets(fleet.workdir / "secrets")
    args = command_args(redis["command"])
    data = fleet.workdir / f"{name}-data"
    data.mkdir()
    port = free_port()
    entrypoint = [redis["entrypoint"][0], host_path("head", "redis", redis["entrypoint"][1], fleet.workdir)]
    args = [*entrypoint, REDIS_SERVER or "redis-server", *replace_flag(args[1:], "--dir", str(data))]
    fleet.start(name, [*args, "--port", str(port), "--bind", "127.0.0.1"], redis_entrypoint_env(fleet, name))
    wait_for_port(port)
    fleet.admin_url = f"redis://admin:{fleet.passwords['admin']}@127.0.0.1:{port}/0"
    return port


def user_url(fleet: Fleet, user: str, port: int) -> str:
    return f"redis://{user}:{fleet.passwords[user]}@127.0.0.1:{port}/0"


def write_dataset(path: Path, n: int, topic: str) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{i:04d}", "prompt": f"{topic} question {i}: explain step by step."}) + "\n")
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from testing.tokenizer import build_test_tokenizer

    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        _start_fleet(fleet)
        # A small job through the operator's own command, while Flower watches.
        build_test_tokenizer(fleet.workdir / "tokenizer")
        datasets = [write_dataset(fleet.workdir / f"{name}.jsonl", 6, name) for name in ("math", "code")]
        submitted = fleet.producer(
            "submit",
            *map(str, datasets),
            "--job",
            "deploy-e2e",
            "--tokenizer",
            str(fleet.workdir / "tokenizer"),
            "--max-new-tokens",
            "256",
            "--processes",
            "1",
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        waited = fleet.producer("wait", "deploy-e2e", "--timeout", "60", "--interval", "0.5")
        assert waited.returncode == 0, waited.stdout + waited.stderr + fleet.log("worker")
        yield fleet
    finally:
        fleet.stop()


def _start_fleet(fleet: Fleet) -> None:
    redis_port = start_head_redis(fleet)
    fleet.redis_url = user_url(fleet, "worker", redis_port)
    secrets = fleet.workdir / "secrets"

    # The sim node's SGLang stand-in.
    sim = load_compose("sim", SIM_TIME_SCALE=SIM_TIME_SCALE)["services"]["sglang"]
    sim_port = free_port()
    argv = replace_flag(
        replace_flag([*sim["entrypoint"], *command_args(sim["command"])], "--host", "127.0.0.1"),
        "--port",
        str(sim_port),
    )
    fleet.start("sglang", argv)
    wait_for_port(sim_port, 30)
    fleet.sim_url = f"http://127.0.0.1:{sim_port}"

    # The node's worker: the image's entrypoint + the service's command, env_file + environment.
    worker = load_compose("node")["services"]["worker"]
    metrics_port = free_port()
    # .env names the worker's ACL user without a password; the compose secret supplies it.
    env_url = dotenv()["THINKFLEET_REDIS_URL"]
    assert env_url.startswith("redis://worker@")
    fleet.worker_env = {
        **os.environ,
        **dotenv(),  # env_file: .env
        **worker["environment"],
        # What differs outside a container: addresses, ports, the output directory, the secret's path.
        "THINKFLEET_REDIS_URL": env_url.replace("@head-node.example:6379", f"@127.0.0.1:{redis_port}"),
        "THINKFLEET_REDIS_PASSWORD_FILE": host_path(
            "node", "worker", worker["environment"]["THINKFLEET_REDIS_PASSWORD_FILE"], secrets
        ),
        # The producer's signing key (deploy/make-secrets.sh): the worker runs only work signed with it.
        "THINKFLEET_SIGNING_KEY_FILE": host_path(
            "node", "worker", worker["environment"]["THINKFLEET_SIGNING_KEY_FILE"], secrets
        ),
        "THINKFLEET_SGLANG_URL": fleet.sim_url,
        "THINKFLEET_METRICS_PORT": str(metrics_port),
        "THINKFLEET_OUTPUT_URI": str(fleet.workdir / "output"),
        "THINKFLEET_SHUTDOWN_GRACE_S": str(DRAIN_GRACE_S),
    }
    # The producer host: its own ACL user and password file, otherwise the same settings.
    fleet.producer_env = {
        **fleet.worker_env,
        "THINKFLEET_REDIS_URL": f"redis://producer@127.0.0.1:{redis_port}/0",
        "THINKFLEET_REDIS_PASSWORD_FILE": str(secrets / "redis_producer_password"),
    }
    fleet.start("worker", [*dockerfile_entrypoint(), *command_args(worker["command"])], fleet.worker_env)
    wait_for_port(metrics_port, 60)
    fleet.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    # The head node's Flower.
    flower = load_compose("head", head_env())["services"]["flower"]
    flower_port = free_port()
    argv = [*flower["entrypoint"], *command_args(flower["command"])]
    argv = replace_flag(argv, "--port", str(flower_port))
    argv = replace_flag(argv, "--address", "127.0.0.1")
    argv = replace_flag(argv, "--db", str(fleet.workdir / "flower-data" / "flower.db"))
    (fleet.workdir / "flower-data").mkdir()
    compose_url = flower["environment"]["THINKFLEET_REDIS_URL"]
    assert compose_url == "redis://flower@redis:6379/0"
    env = {
        **os.environ,
        **flower["environment"],
        "THINKFLEET_REDIS_URL": compose_url.replace("@redis:6379", f"@127.0.0.1:{redis_port}"),
        "THINKFLEET_REDIS_PASSWORD_FILE": host_path(
            "head", "flower", flower["environment"]["THINKFLEET_REDIS_PASSWORD_FILE"], secrets
        ),
    }
    fleet.flower_env = env
    fleet.start("flower", argv, env)
    wait_for_port(flower_port, 30)
    fleet.flower_url = f"http://127.0.0.1:{flower_port}"
    fleet.flower_auth = flower["environment"]["FLOWER_BASIC_AUTH"]


#: Where the thinkfleet image keeps deploy/ (the Dockerfile's WORKDIR + the COPY's destination).
IMAGE_DEPLOY = "/opt/thinkfleet/deploy/"


def healthcheck_argv(service: dict, port_from: str, port_to: int) -> list[str]:  # type: ignore[type-arg]
    """A compose healthcheck's test command, pointed at the port the process really listens on (and at
    the repository's copy of the image's deploy/ files)."""
    kind, *argv = service["healthcheck"]["test"]
    assert kind == "CMD", "only exec-form healthchecks run unchanged outside the image"
    argv = [str(REPO / "deploy" / a.removeprefix(IMAGE_DEPLOY)) if a.startswith(IMAGE_DEPLOY) else a for a in argv]
    return executable([a.replace(f":{port_from}/", f":{port_to}/") for a in argv])


# -- the head node's Redis ------------------------------------------------------------------------


def test_head_redis_needs_a_user_and_appends_every_write(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        port = start_head_redis(fleet)
        # Given the head node's Redis, When a client has no user or a wrong password, Then it gets nothing
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, retry=None).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, username="worker", password=fleet.passwords["flower"], retry=None).ping()
        # (the default user is off: not even the old shared-password login works)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, password=fleet.passwords["worker"], retry=None).ping()
        for user in ("producer", "worker", "flower", "exporter"):
            assert redis.Redis.from_url(user_url(fleet, user, port)).ping()
        client = redis.Redis.from_url(fleet.admin_url)
        config = {k: v for k, v in client.config_get("*").items()}
        assert config["appendonly"] == "yes"
        assert config["appendfsync"] == "everysec"
        assert config["maxmemory-policy"] == "noeviction"
        assert int(config["maxmemory"]) == 8 * 1024**3  # REDIS_MAXMEMORY=8gb
        # And every write goes to the append-only file in the data directory (the persistent volume)
        client.set("probe", "1")
        assert not (tmp_path / "redis-acl" / "users.acl").read_text().count(fleet.passwords["worker"])
        aof = list((tmp_path / "redis-data" / "appendonlydir").glob("*.aof"))
        assert aof, "no AOF in the Redis data directory"
    finally:
        fleet.stop()


def test_head_redis_refuses_writes_at_maxmemory_instead_of_evicting_prompts(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        start_head_redis(fleet)
        client = redis.Redis.from_url(fleet.admin_url)
        # Given queued prompts and a Redis at its memory ceiling
        client.rpush("thinkfleet", *[b"x" * 1024] * 100)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 64 * 1024)
        # When more is written, Then the write fails loudly…
        with pytest.raises(redis.exceptions.OutOfMemoryError, match="maxmemory"):
            for _ in range(1000):
                client.rpush("more", b"y" * 4096)
        # …and nothing queued was evicted to make room
        assert client.llen("thinkfleet") == 100
    finally:
        fleet.stop()


# -- the node: simulator and worker ----------------------------------------------------------------


def test_sglang_healthcheck_command_passes_against_the_running_server(fleet: Fleet) -> None:
    sim = load_compose("sim")["services"]["sglang"]
    port = int(fleet.sim_url.rsplit(":", 1)[1])
    result = subprocess.run(healthcheck_argv(sim, "30000", port), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_worker_from_compose_stores_every_prompt_exactly_once(fleet: Fleet) -> None:
    verified = fleet.producer("verify", "deploy-e2e")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_worker_serves_metrics_with_the_configured_bound(fleet: Fleet) -> None:
    status, body = http(fleet.metrics_url)
    assert status == 200
    metrics = body.decode()
    # The cap is .env's THINKFLEET_MAX_INFLIGHT, else the setting's default (inflight_mode auto moves
    # thinkfleet_inflight_bound under it).
    cap = dotenv().get("THINKFLEET_MAX_INFLIGHT", Settings.model_fields["max_inflight"].default)
    bound = re.search(r"^thinkfleet_inflight_cap (\S+)$", metrics, flags=re.MULTILINE)
    assert bound and float(bound.group(1)) == float(cap)
    completed = re.findall(r'^thinkfleet_completed_total\{dataset="(\w+)"\} (\S+)$', metrics, flags=re.MULTILINE)
    assert {name: float(n) for name, n in completed} == {"math": 6.0, "code": 6.0}
    # The compose healthcheck probes exactly this endpoint.
    worker = load_compose("node")["services"]["worker"]
    port = int(fleet.metrics_url.split(":")[2].split("/")[0])
    result = subprocess.run(healthcheck_argv(worker, "9464", port), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_worker_registers_under_the_node_name(fleet: Fleet) -> None:
    workers = redis.Redis.from_url(fleet.redis_url).hgetall("tf:workers")
    node = dotenv()["NODE_NAME"]
    assert node.encode() in workers
    assert json.loads(workers[node.encode()])["metrics_port"] == int(fleet.metrics_url.split(":")[2].split("/")[0])


# -- the head node's Flower ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/tasks", "/workers", "/api/workers", "/api/tasks", "/api/queues/length"])
def test_flower_refuses_everything_but_health_and_metrics_without_the_login(fleet: Fleet, path: str) -> None:
    assert http(fleet.flower_url + path)[0] == 401
    assert http(fleet.flower_url + path, auth="admin:wrong")[0] == 401
    assert http(fleet.flower_url + path, auth=fleet.flower_auth)[0] == 200


def test_flower_health_and_metrics_stay_open_for_the_healthcheck_and_prometheus(fleet: Fleet) -> None:
    assert http(fleet.flower_url + "/healthcheck")[0] == 200
    # Task events reach Flower asynchronously: the worker buffers them and flushes on its event loop's next turn
    # (up to a poll interval after the task ended), so the count is awaited, never read once.
    body = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, body = http(fleet.flower_url + "/metrics")
        assert status == 200
        succeeded = re.findall(
            r'^flower_events_total\{[^}]*task="thinkfleet.generate"[^}]*type="task-succeeded"[^}]*\} (\S+)$',
            body.decode(),
            flags=re.MULTILINE,
        )
        if sum(map(float, succeeded)) >= 12:
            break
        time.sleep(1)
    assert sum(map(float, succeeded)) >= 12, body.decode()[:3000]


def test_flower_shows_the_worker_under_its_node_name(fleet: Fleet) -> None:
    node = dotenv()["NODE_NAME"]
    status, body = http(fleet.flower_url + "/api/workers?refresh=1", auth=fleet.flower_auth)
    assert status == 200
    workers = json.loads(body)
    name = next(w for w in workers if w.startswith(node + "@"))
    assert workers[name]["stats"]["total"]["thinkfleet.generate"] >= 12
    assert [q["name"] for q in workers[name]["active_queues"]] == [dotenv()["THINKFLEET_QUEUE"]]
    status, page = http(fleet.flower_url + "/workers", auth=fleet.flower_auth)
    assert status == 200 and name.encode() in page


def test_flower_lists_every_task_with_its_job_dataset_and_prompt_id(fleet: Fleet) -> None:
    status, body = http(fleet.flower_url + "/api/tasks?limit=1000", auth=fleet.flower_auth)
    assert status == 200
    tasks = [t for t in json.loads(body).values() if t["name"] == "thinkfleet.generate"]
    assert len(tasks) == 12 and {t["state"] for t in tasks} == {"SUCCESS"}
    assert all(t["worker"].startswith(dotenv()["NODE_NAME"] + "@") for t in tasks)
    # args is the task's argsrepr: (job, dataset, prompt id) — never the token bytes.
    seen = {t["args"] for t in tasks}
    for dataset in ("math", "code"):
        for i in range(6):
            assert f"('deploy-e2e', '{dataset}', '{dataset}/{i:04d}')" in seen
    # The tasks page is built with the args column the compose file asks for.
    status, page = http(fleet.flower_url + "/tasks", auth=fleet.flower_auth)
    assert status == 200 and b"args" in page.lower()
    uuid = tasks[0]["uuid"]
    status, page = http(fleet.flower_url + "/task/" + uuid, auth=fleet.flower_auth)
    assert status == 200 and tasks[0]["args"].split("'")[5].encode() in page


def test_flower_broker_page_knows_the_thinkfleet_queue(fleet: Fleet) -> None:
    status, body = http(fleet.flower_url + "/api/queues/length", auth=fleet.flower_auth)
    assert status == 200
    assert [q["name"] for q in json.loads(body)["active_queues"]] == [dotenv()["THINKFLEET_QUEUE"]]
    status, page = http(fleet.flower_url + "/broker", auth=fleet.flower_auth)
    assert status == 200 and dotenv()["THINKFLEET_QUEUE"].encode() in page


def test_flower_keeps_its_task_history_across_a_restart(fleet: Fleet) -> None:
    flower = fleet.procs["flower"]
    argv, env = flower.args, fleet.flower_env
    # Given Flower stopped as `docker compose stop` would (SIGTERM)
    flower.send_signal(signal.SIGTERM)
    assert flower.wait(30) == 0
    assert list((fleet.workdir / "flower-data").glob("flower.db*")), "no state file written at stop"
    # When it starts again with the same command, Then the job's tasks are there before any new event
    fleet.start("flower", list(argv), env)
    port = int(fleet.flower_url.rsplit(":", 1)[1])
    wait_for_port(port, 30)
    status, body = http(fleet.flower_url + "/api/tasks?limit=1000", auth=fleet.flower_auth)
    assert status == 200
    assert sum(t["name"] == "thinkfleet.generate" for t in json.loads(body).values()) == 12


# -- draining a node -------------------------------------------------------------------------------


def test_sigterm_drains_the_worker_within_the_stop_grace_period_and_hands_work_back(fleet: Fleet) -> None:
    client = redis.Redis.from_url(fleet.redis_url)
    n = 20
    dataset = write_dataset(fleet.workdir / "long.jsonl", n, "long")
    # Given a job whose generations take seconds each, running on the worker
    submitted = fleet.producer(
        "submit",
        str(dataset),
        "--job",
        "deploy-drain",
        "--tokenizer",
        str(fleet.workdir / "tokenizer"),
        "--max-new-tokens",
        "4096",
        "--processes",
        "1",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    def in_flight() -> float:
        found = re.search(r"^thinkfleet_inflight_requests (\S+)$", http(fleet.metrics_url)[1].decode(), re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    wait_for(lambda: in_flight() > 0, 30, "requests in flight")
    # When the node is stopped (docker compose stop: SIGTERM, then SIGKILL after stop_grace_period)
    worker = fleet.procs["worker"]
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    exit_code = worker.wait(120)
    took_s = time.monotonic() - started
    # Then it exits cleanly well within the grace compose gives it…
    stop_grace_s = duration_s(load_compose("node")["services"]["worker"]["stop_grace_period"])
    assert exit_code == 0, fleet.log("worker")
    assert took_s < stop_grace_s
    # …and every prompt of the job is stored or back on the queue: none held, none lost
    done = client.scard("tf:job:deploy-drain:done")
    queued = client.llen(dotenv()["THINKFLEET_QUEUE"])
    assert done < n, "the job finished before the drain; nothing was handed back"
    assert done + queued == n
    assert client.hlen("tf:kombu:unacked") == 0


# -- healthchecks ------------------------------------------------------------------------------------


def test_head_redis_healthcheck_pings_as_the_exporter_user(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        port = start_head_redis(fleet)
        redis_service = load_compose("head", head_env())["services"]["redis"]
        kind, *argv = redis_service["healthcheck"]["test"]
        assert kind == "CMD"
        argv = [host_path("head", "redis", a, tmp_path) for a in argv]
        env = {**redis_entrypoint_env(fleet, "redis"), "REDIS_LISTEN_PORT": str(port)}
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        # The password went through the environment, not argv; a wrong one fails the check.
        assert fleet.passwords["exporter"] not in " ".join(argv)
        (tmp_path / "secrets" / "redis_exporter_password").write_text("x" * 40 + "\n")
        assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode != 0
    finally:
        fleet.stop()


def test_a_container_that_stays_unhealthy_is_stopped_for_its_restart_policy(tmp_path: Path) -> None:
    # Given the worker's healthcheck command, a stand-in for the container's PID 1, and a metrics
    # endpoint that answers once and then stops (a wedged worker)
    worker = load_compose("node")["services"]["worker"]
    restart_after = int(worker["healthcheck"]["test"][worker["healthcheck"]["test"].index("--restart-after") + 1])
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from threading import Thread

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    port = server.server_address[1]
    Thread(target=server.handle_request, daemon=True).start()
    init = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    argv = [*healthcheck_argv(worker, "9464", port), "--pid", str(init.pid), "--state", str(tmp_path / "s.json")]
    try:
        assert subprocess.run(argv, timeout=30).returncode == 0  # healthy once
        server.server_close()
        # When it fails restart_after - 1 times, nothing happens yet…
        for _ in range(restart_after - 1):
            assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 1
            assert init.poll() is None
        # …and at restart_after failures in a row the container's init gets SIGTERM (the restart).
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert result.returncode == 1 and "SIGTERM" in result.stderr
        assert init.wait(10) == -signal.SIGTERM
    finally:
        init.kill()
        init.wait()
        server.server_close()


def test_a_service_that_never_became_healthy_is_left_loading(tmp_path: Path) -> None:
    # SGLang loading its model for an hour fails every probe: that must never count.
    sglang = load_compose("sim")["services"]["sglang"]
    init = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    argv = [*healthcheck_argv(sglang, "30000", free_port()), "--pid", str(init.pid), "--state", str(tmp_path / "s")]
    try:
        for _ in range(12):
            assert subprocess.run(argv, capture_output=True, timeout=60).returncode == 1
        assert init.poll() is None
    finally:
        init.kill()
        init.wait()


# -- last: nothing the fleet did was denied ----------------------------------------------------------


def test_redis_denied_no_command_of_the_fleet(fleet: Fleet) -> None:
    # Everything above — submit, wait, verify, the worker's job and drain, Flower's pages and API —
    # ran under the per-role ACL; a denial would be in ACL LOG (and usually a failed test above).
    log = redis.Redis.from_url(fleet.admin_url).acl_log(count=100)
    assert log == [], [(e["username"], e["reason"], e["object"]) for e in log]
