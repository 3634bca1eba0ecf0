"""The head node's Redis hardening, against real redis-server processes started the way the head node
starts them: deploy/head/redis/entrypoint.sh renders the per-role ACL (users.acl.template + the password
files deploy/make-secrets.sh writes) and runs redis-server with it, optionally over TLS
(deploy/make-tls-certs.sh).

- the entrypoint refuses weak passwords and writes hashes only;
- each role is denied what it must not do (FLUSHALL, CONFIG, KEYS, other keys, forged control
  broadcasts, reading prompts…) and the default user is off;
- real workers (user ``worker``, one SIGKILLed mid-job) run a job submitted as ``producer`` and Redis
  denies none of their commands (ACL LOG stays empty); Flower's own user restores an expired message;
- ``rediss://``: a real worker keeps the transit-list pop (no pop→unacked gap) over TLS, a SIGKILL mid-run
  loses nothing, and Flower works over TLS with its own user;
- every Redis command the code sends is one the ACL grants its role (a static check, so a new command
  fails here rather than as NOPERM in production);
- the producer CLI and the worker refuse a placeholder or short password for a remote Redis.

Flower's pages and API as user ``flower`` beside a real worker, and ``producer submit`` as ``producer``,
run in tests/test_deploy_services.py (the compose commands, under the same ACL).
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from testing.fleet import WorkerProcess, in_flight, job_progress, wait_until
from testing.harness import IdJob, fast_env, make_prompts, simulator, submit_ids
from testing.record import check_job, record_result
from testing.services import REDIS_SERVER, free_port, needs_service, wait_for_port
from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINT = REPO / "deploy" / "head" / "redis" / "entrypoint.sh"
TEMPLATE = REPO / "deploy" / "head" / "redis" / "users.acl.template"
ROLES = ("producer", "worker", "flower", "exporter")

pytestmark = needs_service(REDIS_SERVER is not None, "redis-server is not installed")


def _tls_build() -> bool:
    """Whether this redis-server was built with TLS (Debian's is; a plain `make` build refuses the
    directive): with no port at all it reads the flags and exits."""
    if REDIS_SERVER is None:
        return False
    probe = subprocess.run(
        [REDIS_SERVER, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True, timeout=30
    )
    return "not listen anywhere" in probe.stdout + probe.stderr


def make_secrets(directory: Path) -> dict[str, str]:
    result = subprocess.run(["sh", str(REPO / "deploy" / "make-secrets.sh"), str(directory)], capture_output=True)
    assert result.returncode == 0, result.stderr
    return {u: (directory / f"redis_{u}_password").read_text().strip() for u in ("admin", *ROLES)}


@dataclass
class AclRedis:
    """A redis-server started by the head node's entrypoint for one key prefix / queue / db."""

    workdir: Path
    prefix: str
    queue: str
    db: int = 0
    tls: bool = False
    port: int = 0
    passwords: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def secrets(self) -> Path:
        return self.workdir / "secrets"

    @property
    def ca(self) -> Path:
        return self.secrets / "redis_tls_ca.crt"

    def environment(self) -> dict[str, str]:
        env = {
            **os.environ,
            "THINKFLEET_KEY_PREFIX": self.prefix,
            "THINKFLEET_QUEUE": self.queue,
            "REDIS_DB": str(self.db),
            "REDIS_SECRETS_DIR": str(self.secrets),
            "REDIS_ACL_FILE": str(self.workdir / "acl" / "users.acl"),
        }
        if self.tls:
            env.update(
                REDIS_TLS_CERT_FILE=str(self.secrets / "redis_tls_server.crt"),
                REDIS_TLS_KEY_FILE=str(self.secrets / "redis_tls_server.key"),
                REDIS_TLS_CA_FILE=str(self.ca),
                REDIS_LISTEN_PORT=str(self.port),
            )
        return env

    def argv(self) -> list[str]:
        args = ["sh", str(ENTRYPOINT), REDIS_SERVER or "redis-server", "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        return [*args, "--databases", "16"] + ([] if self.tls else ["--port", str(self.port)])

    def start(self) -> AclRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.passwords:
            self.passwords = make_secrets(self.secrets)
        if self.tls and not self.ca.exists():
            made = subprocess.run(
                ["sh", str(REPO / "deploy" / "make-tls-certs.sh"), str(self.secrets), "127.0.0.1"], capture_output=True
            )
            assert made.returncode == 0, made.stderr
        self.port = self.port or free_port()
        self.proc = subprocess.Popen(self.argv(), env=self.environment(), stderr=subprocess.PIPE)
        try:
            wait_for_port(self.port)
        except TimeoutError:
            self.proc.kill()
            raise AssertionError((self.proc.stderr.read() if self.proc.stderr else b"").decode()) from None
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def url(self, user: str, with_password: bool = True) -> str:
        scheme = "rediss" if self.tls else "redis"
        secret = f":{self.passwords[user]}" if with_password else ""
        query = f"?ssl_ca_certs={self.ca}" if self.tls else ""
        return f"{scheme}://{user}{secret}@127.0.0.1:{self.port}/{self.db}{query}"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), retry=None)

    def settings(self, user: str, output_uri: str, **overrides: object) -> Settings:
        """Settings of a process running as ``user``: the URL names the user, the file holds the password."""
        return Settings(
            redis_url=self.url(user, with_password=False),
            redis_password_file=str(self.secrets / f"redis_{user}_password"),
            output_uri=output_uri,
            key_prefix=self.prefix,
            queue=self.queue,
            **overrides,
        )

    def denials(self, user: str | None = None) -> list[tuple[str, str, str]]:
        log = self.client("admin").acl_log(count=128)
        return [(e["username"], e["reason"], e["object"]) for e in log if user is None or e["username"] == user]


@pytest.fixture
def acl_redis(tmp_path: Path):
    tag = os.urandom(4).hex()
    server = AclRedis(tmp_path / "redis", prefix=f"t{tag}", queue=f"q{tag}").start()
    try:
        yield server
    finally:
        server.stop()


def noperm(client: redis.Redis, *command: str | bytes) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as exc:
        return "NOPERM" in str(exc)
    return False


# -- the entrypoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("change-me-to-a-long-random-hex\n", "placeholder"),
        ("0123456789abcde\n", "15 characters"),
        ("", "empty"),
        ("0123456789abcdef 0123\n", "whitespace"),
        (None, "missing"),
    ],
    ids=["placeholder", "short", "empty", "whitespace", "missing"],
)
def test_redis_refuses_to_start_with_a_weak_or_missing_password(
    tmp_path: Path, content: str | None, reason: str
) -> None:
    server = AclRedis(tmp_path, prefix="tf", queue="thinkfleet", port=free_port())
    server.passwords = make_secrets(server.secrets)
    worker_file = server.secrets / "redis_worker_password"
    if content is None:
        worker_file.unlink()
    else:
        worker_file.write_text(content)
    result = subprocess.run(server.argv(), env=server.environment(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert reason in result.stderr and str(worker_file) in result.stderr
    assert "openssl rand -hex 24" in result.stderr
    assert not (tmp_path / "acl" / "users.acl").exists(), "no half-written ACL is left for redis-server"


def test_redis_refuses_names_that_would_widen_the_key_patterns(tmp_path: Path) -> None:
    server = AclRedis(tmp_path, prefix="tf*", queue="thinkfleet", port=free_port())
    server.passwords = make_secrets(server.secrets)
    result = subprocess.run(server.argv(), env=server.environment(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "THINKFLEET_KEY_PREFIX" in result.stderr


def test_rendered_acl_holds_password_hashes_and_the_configured_names(acl_redis: AclRedis) -> None:
    import hashlib

    rendered = (acl_redis.workdir / "acl" / "users.acl").read_text()
    for password in acl_redis.passwords.values():
        assert password not in rendered
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in rendered
    assert f"~{acl_redis.prefix}:*" in rendered and f"~{acl_redis.queue}*" in rendered
    assert "@PREFIX@" not in rendered and "@QUEUE@" not in rendered and "@DB@" not in rendered
    assert all(line.startswith("user ") for line in rendered.splitlines()), "an ACL file holds rules only"
    assert oct((acl_redis.workdir / "acl" / "users.acl").stat().st_mode & 0o777) == "0o600"
    # The process list shows no password (the old --requirepass put it on argv).
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not any(password in ps for password in acl_redis.passwords.values())


# -- least privilege --------------------------------------------------------------------------------


def test_the_default_user_is_off(acl_redis: AclRedis) -> None:
    plain = redis.Redis(port=acl_redis.port, retry=None)
    with pytest.raises(redis.exceptions.AuthenticationError):
        plain.ping()
    for password in acl_redis.passwords.values():  # no password of any role opens the default user
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=acl_redis.port, password=password, retry=None).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis.port, username="worker", password=acl_redis.passwords["producer"]).ping()


ADMIN_ONLY = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "GET", "maxmemory"),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("KEYS", "*"),
    ("DEBUG", "SLEEP", "0"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", "x", "on", "+@all"),
    ("MODULE", "LIST"),
    ("CLIENT", "KILL", "ID", "999999"),
    ("CLIENT", "LIST"),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"),
    ("SAVE",),
    ("BGREWRITEAOF",),
    ("REPLICAOF", "NO", "ONE"),
    ("SWAPDB", "0", "1"),
    ("SORT", "x"),
]


@pytest.mark.parametrize("role", ROLES)
def test_no_role_can_flush_reconfigure_or_administer_redis(acl_redis: AclRedis, role: str) -> None:
    # ACL DRYRUN asks Redis's own ACL check whether the user may run the command (without running it:
    # an allowed SHUTDOWN would stop the test's server; DEBUG is also off by configuration).
    admin = acl_redis.client("admin")
    allowed = [command for command in ADMIN_ONLY if admin.execute_command("ACL", "DRYRUN", role, *command) == b"OK"]
    assert allowed == [], f"{role} may run {allowed}"
    # And for real: the first few are refused with NOPERM.
    client = acl_redis.client(role)
    assert all(noperm(client, *command) for command in ADMIN_ONLY[:5])
    assert client.ping()


def test_worker_user_stays_inside_the_thinkfleet_keys_and_cannot_command_other_workers(acl_redis: AclRedis) -> None:
    admin, worker = acl_redis.client("admin"), acl_redis.client("worker")
    admin.set("other-app:secret", "x")
    p, q = acl_redis.prefix, acl_redis.queue
    # Given its own keys it works…
    worker.set(f"{p}:hb:w1", "1")
    worker.rpush(q, "m")
    assert worker.lrange(q, 0, -1) == [b"m"]
    # …but keys of anything else are out of reach, read or write
    assert noperm(worker, "GET", "other-app:secret")
    assert noperm(worker, "SET", "other-app:x", "1")
    assert noperm(worker, "DEL", "other-app:secret")
    assert noperm(worker, "HGETALL", "tf-other:job:x")
    assert noperm(worker, "RENAME", f"{p}:hb:w1", "elsewhere")
    # It publishes events and may subscribe to the control broadcast, but not send one (a stolen worker
    # password cannot shut the fleet down through Celery's remote control).
    assert worker.publish(f"/{acl_redis.db}.celeryev/worker.heartbeat", "{}") == 0
    assert noperm(worker, "PUBLISH", f"/{acl_redis.db}.celery.pidbox", "{}")
    assert noperm(worker, "PUBLISH", "anything", "{}")
    assert noperm(worker, "PSUBSCRIBE", "*")
    assert admin.get("other-app:secret") == b"x"


def test_producer_cannot_touch_the_workers_bookkeeping(acl_redis: AclRedis) -> None:
    admin, producer = acl_redis.client("admin"), acl_redis.client("producer")
    p, q = acl_redis.prefix, acl_redis.queue
    admin.hset(f"{p}:kombu:unacked", "tag", "m")
    admin.set(f"{p}:hb:w1", "1")
    # Reads everything status needs…
    assert producer.hgetall(f"{p}:kombu:unacked") == {b"tag": b"m"} and producer.exists(f"{p}:hb:w1")
    producer.hset(f"{p}:job:j", "name", "j")
    producer.rpush(q, "m")
    # …but cannot make a worker's held message vanish, fake a heartbeat, or subscribe to anything.
    assert noperm(producer, "HDEL", f"{p}:kombu:unacked", "tag")
    assert noperm(producer, "SET", f"{p}:hb:w1", "2")
    assert noperm(producer, "DEL", f"{p}:workers")
    assert noperm(producer, "PUBLISH", f"/{acl_redis.db}.celery.pidbox", "{}")
    assert noperm(producer, "GET", "other-app:secret")


def test_flower_sees_sizes_and_events_but_never_prompts_or_job_data(acl_redis: AclRedis) -> None:
    admin, flower = acl_redis.client("admin"), acl_redis.client("flower")
    p, q, db = acl_redis.prefix, acl_redis.queue, acl_redis.db
    admin.rpush(q, "prompt")
    admin.hset(f"{p}:job:j", "tokenizer", "x")
    assert flower.llen(q) == 1  # the broker page
    assert noperm(flower, "LRANGE", q, "0", "-1")
    assert noperm(flower, "RPOP", q)
    assert noperm(flower, "BRPOP", q, "1")
    assert noperm(flower, "HGETALL", f"{p}:job:j")
    assert flower.publish(f"/{db}.celery.pidbox", "{}") == 0  # inspect / control broadcasts
    assert noperm(flower, "PUBLISH", f"/{db}.celeryev/task-succeeded", "{}")  # it cannot forge events
    assert admin.llen(q) == 1


def test_exporter_runs_its_scrape_read_only(acl_redis: AclRedis) -> None:
    admin, exporter = acl_redis.client("admin"), acl_redis.client("exporter")
    p, q, db = acl_redis.prefix, acl_redis.queue, acl_redis.db
    admin.rpush(q, "m")
    admin.hset(f"{p}:kombu:unacked", "t", "m")
    admin.hset(f"{p}:job:j:prompts", "a", "h")
    admin.sadd(f"{p}:job:j:done", "a")
    # The commands redis_exporter v1.67.0 sends with the head node's settings (exporter.go, keys.go,
    # latency.go, slowlog.go; CONFIG skipped by REDIS_EXPORTER_CONFIG_COMMAND=-)
    exporter.execute_command("CLIENT", "SETNAME", "redis_exporter")
    info = exporter.execute_command("INFO", "ALL")
    assert b"maxmemory:" in info if isinstance(info, bytes) else "maxmemory" in info
    exporter.execute_command("LATENCY", "LATEST")
    exporter.execute_command("LATENCY", "HISTOGRAM")
    exporter.execute_command("SLOWLOG", "GET", "1")
    exporter.execute_command("SLOWLOG", "LEN")
    exporter.execute_command("SELECT", str(db))
    for pattern in (f"{p}:job:*:prompts", f"{p}:job:*:done", f"{p}:job:*:dead"):
        for key in exporter.scan_iter(match=pattern, count=1000):
            kind = exporter.type(key)
            assert {b"hash": exporter.hlen, b"set": exporter.scard}[kind](key) == 1
    assert exporter.type(q) == b"list" and exporter.llen(q) == 1
    assert exporter.type(f"{p}:kombu:unacked") == b"hash" and exporter.hlen(f"{p}:kombu:unacked") == 1
    assert acl_redis.denials("exporter") == []
    # Read-only: sizes and types, no values, no writes, no CONFIG.
    assert noperm(exporter, "HGETALL", f"{p}:kombu:unacked")
    assert noperm(exporter, "LRANGE", q, "0", "-1")
    assert noperm(exporter, "SET", f"{p}:x", "1")
    assert noperm(exporter, "CONFIG", "GET", "*")
    assert noperm(exporter, "SLOWLOG", "RESET")


# -- real processes under the ACL -------------------------------------------------------------------


def test_workers_and_producer_run_a_job_under_their_own_users_and_nothing_is_denied(
    acl_redis: AclRedis, tmp_path: Path
) -> None:
    # Given two workers logged in as `worker` (password from THINKFLEET_REDIS_PASSWORD_FILE) and a job
    # submitted as `producer`
    out = str(tmp_path / "out")
    producer = acl_redis.settings("producer", out)
    worker_settings = acl_redis.settings("worker", out)
    admin = acl_redis.client("admin")
    keys = producer.keys
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "20") as sim:
        env = worker_env_with_password_file(worker_settings, sim)
        victim = WorkerProcess("victim", env, tmp_path).start()
        survivor = WorkerProcess("survivor", env, tmp_path).start()
        try:
            victim.wait_ready(admin, keys)
            survivor.wait_ready(admin, keys)
            job = submit_ids(producer, "acl", make_prompts(40))
            # When one worker is SIGKILLed mid-job (the other returns its transit list and kombu's
            # unacked messages, all as `worker`)
            wait_until(lambda: job_progress(admin, keys, "acl")["done"] >= 8, 120, what="progress")
            wait_until(lambda: in_flight(admin, keys, "acl", "victim"), 60, what="the victim busy")
            victim.kill()
            wait_until(lambda: job_progress(admin, keys, "acl")["done"] == 40, 240, what="40 rows")
        finally:
            victim.kill()
            survivor.terminate()
    # Then the job is whole (verify and status run as `producer`) and Redis denied nothing.
    outcome = check_job(producer, "acl", job.prompts, job.sampling_params)
    denied = acl_redis.denials()
    if denied:
        outcome.problems.append(f"ACL denied: {denied}")
    record_result(
        "Redis ACL users (worker, producer), worker SIGKILL mid-job",
        outcome,
        "per-role ACL users, default user off; 1 × SIGKILL of 1 of 2 workers",
        [],
        time.monotonic() - started,
        workers=2,
        notes="ACL LOG empty: no command of producer, workers or recovery was denied",
    )
    outcome.assert_clean()
    assert denied == []
    for log in (victim.log_path, survivor.log_path):
        text = log.read_text(errors="replace")
        assert acl_redis.passwords["worker"] not in text and "NOPERM" not in text


def worker_env_with_password_file(settings: Settings, sim_url: str, **extra: object) -> dict[str, str]:
    """A worker subprocess environment whose URL names the user and whose password comes from the file
    (as compose runs it), not from the URL fast_env would put it in."""
    env = fast_env(settings, sim_url, max_inflight=4, **extra)
    password = Path(str(settings.redis_password_file)).read_text().strip()
    env["THINKFLEET_REDIS_URL"] = settings.redis_url.replace(f":{password}@", "@")
    env["THINKFLEET_REDIS_PASSWORD_FILE"] = str(settings.redis_password_file)
    env.pop("THINKFLEET_BROKER_URL", None)
    return env


def test_flower_user_can_run_kombus_restore_of_an_expired_message(acl_redis: AclRedis, tmp_path: Path) -> None:
    """Every Celery consumer, Flower included, sweeps kombu's unacked hash and pushes expired messages
    back onto the queue; Flower's user must be allowed exactly that (and it cannot read the queue)."""
    from workers.app import make_app

    out = str(tmp_path / "out")
    producer = acl_redis.settings("producer", out)
    admin = acl_redis.client("admin")
    keys, q = producer.keys, acl_redis.queue
    # Given a message a dead consumer held past its visibility timeout (kombu's own layout)
    submit_ids(producer, "restore", make_prompts(1))
    raw = admin.lpop(q)
    message = json.loads(raw)
    tag = message["properties"]["delivery_tag"]
    info = message["properties"]["delivery_info"]
    admin.hset(f"{keys.prefix}:kombu:unacked", tag, json.dumps([message, info["exchange"], info["routing_key"]]))
    admin.zadd(f"{keys.prefix}:kombu:unacked_index", {tag: time.time() - 3600})
    # When Flower's Celery app (user `flower`) runs kombu's periodic restore
    flower = acl_redis.settings("flower", out)
    app = make_app(flower, register=False)
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        channel.qos.restore_visible(num=10, interval=1)
    # Then the message is back on the queue, the bookkeeping is clean, and nothing was denied.
    assert admin.llen(q) == 1 and json.loads(admin.lindex(q, 0))["properties"]["delivery_tag"] == tag
    assert admin.hlen(f"{keys.prefix}:kombu:unacked") == 0
    assert acl_redis.denials() == []


# -- TLS --------------------------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Records the commands Redis executes (MONITOR as admin), to prove which pop the worker used.

    MONITOR replays nothing, so a reconnect would silently drop whatever ran in between: the stream must be
    one unbroken connection from `start` to `stop`. Its connection therefore has no socket timeout (redis-py
    8's clients carry 5 s, and a quiet stretch of a loaded box is longer than that); any failure of the stream
    is kept and raised by `stop` (never swallowed); and `stop` sends a marker through the server and waits
    until the thread has read it, so every command Redis ran before the marker has been recorded.
    """

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="redis-monitor")
        self.client = redis.Redis.from_url(url, retry=None, socket_timeout=None, socket_connect_timeout=60)
        self.commands: list[str] = []
        self.marker = f"monitor-stop-{os.urandom(6).hex()}"
        self.listening = threading.Event()
        self.error: BaseException | None = None
        self.saw_marker = False

    def run(self) -> None:
        try:
            with self.client.monitor() as monitor:
                self.listening.set()  # MONITOR answered OK: from here on, every command is streamed to us
                for command in monitor.listen():
                    self.commands.append(command["command"])
                    if self.marker in command["command"]:
                        self.saw_marker = True
                        return
        except BaseException as exc:  # kept and raised by stop(): the stream must not die quietly
            self.error = exc
        finally:
            self.listening.set()

    def start(self) -> None:
        super().start()
        assert self.listening.wait(60), "MONITOR did not start within 60 s"
        if self.error is not None:
            raise AssertionError(f"MONITOR failed to start: {self.error!r}") from self.error

    def stop(self, admin: redis.Redis) -> list[str]:
        """Ends the recording at a marker and returns every command Redis ran between start and stop."""
        if self.is_alive():
            admin.echo(self.marker)
            self.join(120)
        assert not self.is_alive(), "the MONITOR thread did not read its stop marker within 120 s"
        if self.error is not None:
            raise AssertionError(f"the MONITOR stream broke, commands may be missing: {self.error!r}") from self.error
        assert self.saw_marker, "the MONITOR stream ended before its stop marker"
        return self.commands


TLS = needs_service(_tls_build(), "redis-server has no TLS support (Debian's redis-server has it)")


@TLS
def test_transit_transport_serves_rediss_with_the_url_ca(tmp_path: Path) -> None:
    from thinkfleet.broker.transit import TRANSPORT, Transport, enable_transit
    from workers.app import make_app

    ca = tmp_path / "ca.crt"
    settings = Settings(redis_url=f"rediss://worker:{'x' * 24}@127.0.0.1:6380/0?ssl_ca_certs={ca}")
    app = make_app(settings, register=False)
    enable_transit(app, settings, "w1")
    assert app.conf.broker_transport == TRANSPORT
    connection = app.connection_for_write()
    assert isinstance(connection.transport, Transport)
    # (kombu takes the URL's ssl_* options over broker_use_ssl; without ssl_cert_reqs, redis-py's
    # SSLConnection requires a verified certificate — the TLS test below connects with a wrong CA)
    assert connection.ssl["ssl_ca_certs"] == str(ca)
    assert connection.ssl.get("ssl_cert_reqs", ssl.CERT_REQUIRED) in (ssl.CERT_REQUIRED, "required")
    # Flower's broker page reads broker_use_ssl only: it carries the CA too.
    assert app.conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(ca)}


@TLS
def test_worker_over_tls_keeps_the_transit_pop_and_a_sigkill_loses_nothing(tmp_path: Path) -> None:
    # Given the head node's Redis serving TLS only (deploy/make-tls-certs.sh, entrypoint REDIS_TLS_*),
    # and workers connecting with rediss://worker@…?ssl_ca_certs=CA
    tag = os.urandom(4).hex()
    server = AclRedis(tmp_path / "redis", prefix=f"t{tag}", queue=f"q{tag}", tls=True).start()
    out = str(tmp_path / "out")
    producer = server.settings("producer", out)
    worker_settings = server.settings("worker", out)
    admin = server.client("admin")
    keys = producer.keys
    # Plain TCP is off, and the server is verified: a client with another CA is refused.
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(port=server.port, username="worker", password=server.passwords["worker"], retry=None).ping()
    other_ca = tmp_path / "other"
    subprocess.run(["sh", str(REPO / "deploy" / "make-tls-certs.sh"), str(other_ca), "127.0.0.1"], check=True)
    # The head node's healthcheck speaks TLS too.
    health = subprocess.run(
        ["sh", str(ENTRYPOINT.parent / "healthcheck.sh")], env=server.environment(), capture_output=True, timeout=30
    )
    assert health.returncode == 0, health.stderr
    wrong_ca = server.url("worker").replace(str(server.ca), str(other_ca / "redis_tls_ca.crt"))
    with pytest.raises(redis.exceptions.ConnectionError, match=r"(?i)certificate"):
        redis.Redis.from_url(wrong_ca).ping()
    from thinkfleet.broker.transit import enable_transit
    from workers.app import make_app

    wrong = Settings(redis_url=wrong_ca, key_prefix=server.prefix, queue=server.queue)
    kombu_app = make_app(wrong, register=False)
    enable_transit(kombu_app, wrong, "wrong-ca")  # the worker's own transport refuses the server too
    with kombu_app.connection_for_write() as connection, pytest.raises(Exception, match=r"(?i)certificate"):
        connection.ensure_connection(max_retries=1)
    monitor = Monitor(server.url("admin"))
    monitor.start()  # returns once MONITOR streams: the workers below start after it
    started = time.monotonic()
    job: IdJob | None = None
    flower = None
    try:
        with simulator(tmp_path, "--time-scale", "20") as sim:
            env = worker_env_with_password_file(worker_settings, sim)
            victim = WorkerProcess("tls-victim", env, tmp_path).start()
            survivor = WorkerProcess("tls-survivor", env, tmp_path).start()
            flower = start_flower(server, tmp_path)
            try:
                victim.wait_ready(admin, keys)
                survivor.wait_ready(admin, keys)
                job = submit_ids(producer, "tls", make_prompts(40))
                # When one of them is SIGKILLed mid-run
                wait_until(lambda: job_progress(admin, keys, "tls")["done"] >= 8, 120, what="progress")
                wait_until(lambda: in_flight(admin, keys, "tls", "tls-victim"), 60, what="the victim busy")
                victim.kill()
                wait_until(lambda: job_progress(admin, keys, "tls")["done"] == 40, 240, what="40 rows")
                # Flower, as user `flower` over TLS, shows the survivor and the queue (its broker page
                # connects with broker_use_ssl, which carries the URL's CA)
                flower_workers = flower.workers()
                broker_status, broker_page = http_get(flower.url + "/broker", auth=FLOWER_AUTH)
            finally:
                victim.kill()
                survivor.terminate()
                flower.stop()
        commands = monitor.stop(admin)  # raises if the stream broke: no pop can go unrecorded
        # Then both popped through their transit lists (BLMOVE), never kombu's BRPOP of the queue…
        transit = [c for c in commands if c.startswith("BLMOVE") and keys.transit("") in c]
        pops = [c for c in commands if c.startswith("BRPOP") and f" {producer.queue} " in f" {c} "]
        for name in ("tls-victim", "tls-survivor"):
            assert any(keys.transit(name) in c for c in transit), f"{name} did not pop into its transit list"
        assert pops == [], f"kombu's stock pop was used: {pops[:3]}"
        assert any(name.startswith("tls-survivor@") for name in flower_workers), flower_workers
        assert broker_status == 200 and producer.queue.encode() in broker_page
        # …nothing was lost, duplicated or altered, and Redis denied nothing.
        assert job is not None
        outcome = check_job(producer, "tls", job.prompts, job.sampling_params)
        denied = server.denials()
        if denied:
            outcome.problems.append(f"ACL denied: {denied}")
        record_result(
            "rediss:// (TLS) with the transit pop, worker SIGKILL mid-run",
            outcome,
            "TLS-only Redis, ACL users; 1 × SIGKILL of 1 of 2 workers",
            [],
            time.monotonic() - started,
            workers=2,
            notes=f"{len(transit)} BLMOVE pops into transit lists over TLS, 0 BRPOP of the queue; Flower over TLS",
        )
        outcome.assert_clean()
    finally:
        server.stop()  # (ends a monitor still streaming: its connection closes)


FLOWER_AUTH = "ops:flower-test-login"


@dataclass
class FlowerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def workers(self) -> dict[str, object]:
        deadline = time.monotonic() + 60
        while True:
            status, body = http_get(self.url + "/api/workers?refresh=1", auth=FLOWER_AUTH, timeout_s=30)
            workers = json.loads(body) if status == 200 else {}
            if workers or time.monotonic() > deadline:
                assert status == 200, body[:500]
                return workers
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_flower(server: AclRedis, workdir: Path) -> FlowerProcess:
    """``celery -A workers.app flower`` as user ``flower`` (its password from THINKFLEET_REDIS_PASSWORD_FILE)."""
    port = free_port()
    env = {
        **os.environ,
        "THINKFLEET_REDIS_URL": server.url("flower", with_password=False),
        "THINKFLEET_REDIS_PASSWORD_FILE": str(server.secrets / "redis_flower_password"),
        "THINKFLEET_KEY_PREFIX": server.prefix,
        "THINKFLEET_QUEUE": server.queue,
        "FLOWER_BASIC_AUTH": FLOWER_AUTH,
    }
    log = workdir / "flower.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "celery"), "-A", "workers.app", "flower", f"--port={port}",
             "--address=127.0.0.1", "--persistent=False"],
            env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    wait_for_port(port, 60)
    return FlowerProcess(proc, f"http://127.0.0.1:{port}", log)


# -- every command the code sends is granted ------------------------------------------------------

#: Method names that are also Python's own (list.append, dict.keys, Path.unlink, time.time…): a call of
#: one of them says nothing about Redis.
AMBIGUOUS = {
    *("append", "close", "command", "copy", "echo", "info", "keys", "sort", "time", "wait", "unlink"),
    *("select", "save", "reset", "type", "move", "discard", "publish", "monitor", "lock", "object", "lastsave"),
    *("shutdown",),  # ThreadPoolExecutor.shutdown (workers/pool.py), not SHUTDOWN
    *("get", "set", "exists", "delete", "execute", "update", "role", "from_url", "parse_response"),
    *("from_pool", "dump", "json"),  # Redis.from_pool builds a client; pickle.dump, not DUMP; aiohttp's .json()
    *("digest",),  # hashlib's .digest() (producer/inputs.py's duplicate-id hash), not Redis 8's DIGEST
}
#: redis-py helpers → the commands they send.
HELPERS = {
    "pipeline": ["MULTI", "EXEC"],
    "transaction": ["WATCH", "MULTI", "EXEC"],  # Redis.transaction: a WATCHed MULTI (transit.py's hand-back)
    "register_script": ["EVALSHA", "SCRIPT|LOAD"],
    "scan_iter": ["SCAN"],
    "hscan_iter": ["HSCAN"],
    "sscan_iter": ["SSCAN"],
    "zscan_iter": ["ZSCAN"],
    "delete": ["DEL"],
    "xinfo_stream": ["XINFO|STREAM"],  # a subcommand (storage/feed.py: where the commit log stands)
}
LUA_CALL = re.compile(r"""redis\.p?call\(\s*['"]([A-Za-z]+)['"]""")
ROLE_SOURCES = {
    "producer": ["producer/**/*.py"],
    "worker": ["workers/**/*.py"],
    # Shared code (the ledger and its Lua scripts, job records, storage) runs in either.
    "producer|worker": ["thinkfleet/**/*.py", "thinkfleet/**/*.lua", "storage/**/*.py"],
}


def granted_commands(role: str) -> set[str]:
    """Commands the rendered ACL grants ``role`` (root rules and selectors), as Redis names them."""
    rules = " ".join(
        line.strip() for line in _rule_block(role).splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    return {
        word.strip("()")[1:].upper() for word in rules.split() if word.strip("(").startswith("+") and "@" not in word
    }


def _rule_block(role: str) -> str:
    text = TEMPLATE.read_text()
    match = re.search(rf"^user {role}\b.*?(?=^\S|\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, role
    return match.group(0)


def redis_py_commands() -> set[str]:
    names = set()
    for klass in (redis.Redis,):
        names |= {name for name in dir(klass) if not name.startswith("_")}
    return names


def commands_in(paths: list[Path]) -> dict[str, set[str]]:
    """Redis command → files, from Lua ``redis.call('X'`` and redis-py method calls ``.x(`` in ``paths``."""
    methods = redis_py_commands()
    found: dict[str, set[str]] = {}
    for path in paths:
        text = path.read_text()
        for name in LUA_CALL.findall(text):
            found.setdefault(name.upper(), set()).add(str(path.relative_to(REPO)))
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name in HELPERS:
                    commands = HELPERS[name]
                elif name in methods and name not in AMBIGUOUS and not name.startswith(("acl_", "config_", "client_")):
                    commands = [name.upper()]
                else:
                    continue
                for command in commands:
                    found.setdefault(command, set()).add(str(path.relative_to(REPO)))
    return found


#: Connection-level commands every role has through +@connection. WAITAOF (the ledger's, after finalize) too: Redis
#: 7.2+ files it under @connection, and an ACL naming it would not load on the 7.0 the tests run.
CONNECTION = {"PING", "ECHO", "SELECT", "HELLO", "AUTH", "CLIENT|SETNAME", "WAIT", "WAITAOF"}


@pytest.mark.parametrize("sources", sorted(ROLE_SOURCES), ids=lambda s: s.replace("|", "-or-"))
def test_every_redis_command_the_code_sends_is_granted_to_its_role(sources: str) -> None:
    paths = [p for pattern in ROLE_SOURCES[sources] for p in REPO.glob(pattern) if "testing" not in p.parts]
    assert paths
    roles = sources.split("|")
    allowed = set.union(*(granted_commands(role) for role in roles)) | CONNECTION
    found = commands_in(paths)
    assert found, "the scan found no Redis command at all"
    missing = {command: sorted(files) for command, files in found.items() if command not in allowed}
    assert not missing, (
        f"Redis commands the ACL does not grant to {sources} (add them to deploy/head/redis/users.acl.template "
        f"if they belong there): {missing}"
    )


# -- clients refuse weak passwords --------------------------------------------------------------------


def test_password_file_goes_into_the_url_of_its_user(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    settings = Settings(redis_url="redis://worker@head.example:6379/0", redis_password_file=str(secret))
    assert settings.redis_url == "redis://worker:0123456789abcdef0123456789abcdef@head.example:6379/0"
    assert settings.broker_url == settings.redis_url
    settings.require_safe_redis_password()
    tls = settings.with_overrides(redis_url="rediss://worker@head.example:6380/0?ssl_ca_certs=/ca.crt")
    assert tls.redis_url.startswith("rediss://worker:0123456789abcdef0123456789abcdef@head.example:6380/0?")
    secret.write_text("")
    with pytest.raises(ValueError, match="empty"):
        Settings(redis_url="redis://worker@h/0", redis_password_file=str(secret))
    with pytest.raises(ValueError, match="cannot read"):
        Settings(redis_url="redis://worker@h/0", redis_password_file=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("redis://worker:change-me-to-a-long-random-hex@head.example:6379/0", "placeholder"),
        ("redis://worker:short@10.0.0.10:6379/0", "only 5 characters"),
        ("redis://head.example:6379/0", "missing"),
        ("redis://127.0.0.1:6379/0", None),
        ("redis://:x@localhost:6379/0", None),
        ("redis://worker:0123456789abcdef@head.example:6379/0", None),
    ],
)
def test_placeholder_or_short_passwords_are_refused_for_remote_redis(url: str, refused: str | None) -> None:
    settings = Settings(redis_url=url)
    if refused is None:
        settings.require_safe_redis_password()
        return
    with pytest.raises(ValueError, match=refused) as caught:
        settings.require_safe_redis_password()
    assert "openssl rand -hex 24" in str(caught.value)
    password = url.split("//")[1].split("@")[0].partition(":")[2]
    assert not password or password not in str(caught.value), "the message must not repeat the password"


def test_producer_cli_refuses_the_placeholder_password(tmp_path: Path) -> None:
    env = {**os.environ, "THINKFLEET_REDIS_URL": "redis://producer:change-me-to-a-long-random-hex@head.example:6379/0"}
    result = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", "anyjob"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "placeholder" in result.stderr and "openssl rand -hex 24" in result.stderr
    assert "Traceback" not in result.stderr


def test_worker_refuses_to_start_with_a_short_password(tmp_path: Path) -> None:
    env = fast_env(Settings(redis_url="redis://worker:tooshort@head.example:6379/0"), "http://127.0.0.1:9")
    worker = WorkerProcess("weak", env, tmp_path).start()
    assert worker.proc is not None
    assert worker.proc.wait(60) == 78  # sysexits EX_CONFIG: workers/tasks.py fail_start
    log = worker.log_path.read_text(errors="replace")
    assert "only 8 characters" in log and "openssl rand -hex 24" in log and "tooshort" not in log


# -- helpers for other modules ----------------------------------------------------------------------


def http_get(url: str, auth: str | None = None, timeout_s: float = 10.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
