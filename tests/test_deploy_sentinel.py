"""The head that fails over, as deploy/ runs it (docker-compose.sentinel.yml, k8s/components/sentinel-head), outside
containers: each Redis started by deploy/head/redis/entrypoint.sh with REDIS_HA=yes (the ACL users of
users.ha.acl.template, masteruser/masterauth from the password file, REDIS_REPLICAOF), three Sentinels (quorum 2) by
deploy/head/sentinel/entrypoint.sh — every password from deploy/make-secrets.sh's files, none on a command line. The
Sentinels require their own password of clients, who may only ask who the primary is. The primary is then killed: the
Sentinels (logging in to the Redis servers and to each other as `sentinel`) must agree and promote a replica, and a
worker on the sentinel:// URL — both passwords from files, as the settings read them — must write to it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import redis

from testing.fleet import free_ports, wait_for_port
from testing.services import RedisServer
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parent.parent
REDIS_ENTRYPOINT = REPO / "deploy" / "head" / "redis" / "entrypoint.sh"
SENTINEL_ENTRYPOINT = REPO / "deploy" / "head" / "sentinel" / "entrypoint.sh"
#: How a Redis of the Kubernetes head starts: it asks the Sentinels whether it is the primary or whose replica.
REDIS_ROLE = REPO / "deploy" / "k8s" / "components" / "sentinel-head" / "redis-role.sh"


def _secrets(directory: Path) -> dict[str, str]:
    subprocess.run(["sh", str(REPO / "deploy" / "make-secrets.sh"), str(directory)], check=True, capture_output=True)
    client = directory / "sentinel_client_password"
    if not client.exists():  # as deploy/README.md tells an operator whose secrets predate it
        client.write_text(os.urandom(24).hex() + "\n")
    return {f.name: f.read_text().strip() for f in directory.glob("*_password")}


def _redis(
    workdir: Path, secrets: Path, port: int, replica_of: int | None, k8s: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """One Redis of the head as compose starts it (REDIS_HA, REDIS_REPLICAOF given) — or, with ``k8s`` (the role
    script's environment), as a Kubernetes pod does: redis-role.sh decides, then runs the same entrypoint."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "REDIS_HA": "yes",
        "REDIS_SECRETS_DIR": str(secrets),
        "REDIS_ACL_FILE": str(workdir / "run" / "users.acl"),
        "REDIS_ANNOUNCE_IP": "127.0.0.1",
        "THINKFLEET_KEY_PREFIX": "tf",
        "THINKFLEET_QUEUE": "thinkfleet",
    }
    if replica_of:
        env["REDIS_REPLICAOF"] = f"127.0.0.1 {replica_of}"
    script = REDIS_ENTRYPOINT
    if k8s is not None:
        script = REDIS_ROLE
        env.update(REDIS_ENTRYPOINT=str(REDIS_ENTRYPOINT), REDIS_PORT=str(port), **k8s)
    argv = ["sh", str(script), "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--dir", str(workdir), "--repl-diskless-sync-delay", "0"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=(workdir / "stderr").open("a"))
    wait_for_port(port)
    return proc


def _sentinel(
    workdir: Path, secrets: Path, primary: int, port: int, peers: list[int], host: str = "127.0.0.1"
) -> subprocess.Popen[bytes]:
    """A Sentinel as the entrypoint starts it; ``host`` a name (not an address): announced and resolved as names,
    as on Kubernetes."""
    env = {
        **os.environ,
        "REDIS_SECRETS_DIR": str(secrets),
        "SENTINEL_DIR": str(workdir),
        "SENTINEL_PORT": str(port),
        "SENTINEL_PRIMARY_HOST": host,
        "SENTINEL_PRIMARY_PORT": str(primary),
        "SENTINEL_ANNOUNCE_IP": host,
        "SENTINEL_PEERS": " ".join(f"{host}:{p}" for p in peers),
        "SENTINEL_DOWN_AFTER_MS": "1000",
        "SENTINEL_FAILOVER_TIMEOUT_MS": "4000",
    }
    if host != "127.0.0.1":
        env["SENTINEL_ANNOUNCE_HOSTNAMES"] = "yes"
    proc = subprocess.Popen(
        ["sh", str(SENTINEL_ENTRYPOINT)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port)
    return proc


def _primary(sentinel: redis.Redis) -> tuple[str, int]:
    host, port = sentinel.sentinel_get_master_addr_by_name("thinkfleet")
    return host.decode(), port


def _until(check, timeout_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s")


def test_the_deployed_head_replicates_and_fails_over_with_its_own_users(tmp_path: Path) -> None:
    RedisServer(tmp_path / "probe")  # fails (CI) or skips without redis-server
    secrets = tmp_path / "secrets"
    passwords = _secrets(secrets)
    assert {"redis_replica_password", "redis_sentinel_password"} <= set(passwords)
    # (six distinct ports: two free_port() calls can name the same one, and a Sentinel given a Redis's never ran)
    picked = free_ports(6)
    ports, sports = picked[:3], picked[3:]
    procs = [_redis(tmp_path / "r0", secrets, ports[0], None)]
    procs += [_redis(tmp_path / f"r{i}", secrets, ports[i], ports[0]) for i in (1, 2)]
    try:
        admin = [
            redis.Redis(port=p, username="admin", password=passwords["redis_admin_password"], socket_timeout=5)
            for p in ports
        ]
        # Given the replicas synced through the `replica` user (masterauth from the file, never on argv)…
        online = lambda: [v.get("state") for k, v in admin[0].info("replication").items() if k.startswith("slave")]  # noqa: E731
        _until(lambda: online() == ["online", "online"])
        # …and three Sentinels that log in as `sentinel` and find the replicas and each other.
        for i, sport in enumerate(sports):
            procs.append(_sentinel(tmp_path / f"s{i}", secrets, ports[0], sport, [p for p in sports if p != sport]))
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert not any(pw in ps for pw in passwords.values())
        client_pw = passwords["sentinel_client_password"]
        watchers = [redis.Redis(port=p, password=client_pw, socket_timeout=5) for p in sports]
        _until(lambda: all(len(w.sentinel_slaves("thinkfleet")) == 2 for w in watchers))
        _until(lambda: all(len(w.sentinel_sentinels("thinkfleet")) == 2 for w in watchers))
        conf = (tmp_path / "s0" / "sentinel.conf").read_text()
        assert "auth-user thinkfleet sentinel" in conf and f"127.0.0.1 {ports[0]} 2" in conf  # quorum 2
        # The Sentinels answer a client only with their password, and only who the primary is.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=sports[0], socket_timeout=5).sentinel_get_master_addr_by_name("thinkfleet")
        for command in ("FAILOVER thinkfleet", "SET thinkfleet quorum 1", "REMOVE thinkfleet", "CONFIG GET *"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                watchers[0].execute_command("SENTINEL", *command.split())
        # A worker as the settings open it: the primary's password and the Sentinels' from their files.
        url = "sentinel://worker@" + ",".join(f"127.0.0.1:{p}" for p in sports) + "/0?master=thinkfleet"
        settings = Settings(
            redis_url=url,
            redis_password_file=str(secrets / "redis_worker_password"),
            redis_sentinel_password_file=str(secrets / "sentinel_client_password"),
        )
        worker = sync_client(settings.redis_url)
        worker.set("tf:probe", "1")
        # When the primary dies, Then two Sentinels agree (they vote logged in to each other), promote a replica
        # (SLAVEOF NO ONE, CONFIG REWRITE as `sentinel`), point the other at it, and the worker's client writes to it
        # through the same URL (min-replicas-to-write 1: the new primary has its replica).
        procs[0].kill()
        procs[0].wait(timeout=10)
        _until(lambda: all(w.sentinel_get_master_addr_by_name("thinkfleet")[1] in ports[1:] for w in watchers))
        new = ports.index(watchers[0].sentinel_get_master_addr_by_name("thinkfleet")[1])
        _until(lambda: admin[new].info("replication")["role"] == "master")
        _until(lambda: worker.set("tf:probe", "2"))
        assert admin[new].get("tf:probe") == b"2"
        for i in (1, 2):
            assert not admin[i].acl_log(), f"a user was denied a command it needs on r{i}"
        # And a Sentinel started afresh (a new volume) asks the others and monitors the new primary, not the first.
        procs[3].kill()
        procs[3].wait(timeout=10)
        (tmp_path / "s0" / "sentinel.conf").unlink()
        procs[3] = _sentinel(tmp_path / "s0", secrets, ports[0], sports[0], sports[1:])
        assert f"127.0.0.1 {ports[new]} 2" in (tmp_path / "s0" / "sentinel.conf").read_text()
        _until(lambda: watchers[0].sentinel_get_master_addr_by_name("thinkfleet")[1] == ports[new])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_a_kubernetes_head_s_old_primary_restarts_as_a_replica_of_the_promoted_one(tmp_path: Path) -> None:
    # The Kubernetes head (components/sentinel-head) on loopback, named as pods are (one name for all here,
    # "localhost", told apart by port): every Redis started by redis-role.sh, every Sentinel announcing names.
    RedisServer(tmp_path / "probe")
    secrets = tmp_path / "secrets"
    passwords = _secrets(secrets)
    picked = free_ports(6)  # distinct: a Sentinel once got a replica's port and never ran
    ports, sports = picked[:3], picked[3:]
    k8s = {
        "REDIS_FIRST_PRIMARY": f"localhost:{ports[0]}",
        "HEAD_SENTINELS": ",".join(f"localhost:{p}" for p in sports),
        "REDIS_SELF": "localhost",
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # Given the head's first start: no Sentinel answers yet, so the first Redis is the primary.
        procs += [_redis(tmp_path / f"r{i}", secrets, port, None, k8s) for i, port in enumerate(ports)]
        admin = [
            redis.Redis(port=p, username="admin", password=passwords["redis_admin_password"], socket_timeout=5)
            for p in ports
        ]
        _until(lambda: admin[0].info("replication")["connected_slaves"] == 2)
        for i, sport in enumerate(sports):
            procs.append(_sentinel(tmp_path / f"s{i}", secrets, ports[0], sport, sports, host="localhost"))
        watcher = redis.Redis(port=sports[0], password=passwords["sentinel_client_password"], socket_timeout=5)
        _until(lambda: _primary(watcher) == ("localhost", ports[0]))
        _until(
            lambda: (
                len(watcher.sentinel_slaves("thinkfleet")) == 2 and len(watcher.sentinel_sentinels("thinkfleet")) == 2
            )
        )
        url = "sentinel://worker@" + ",".join(f"127.0.0.1:{p}" for p in sports) + "/0?master=thinkfleet"
        settings = Settings(
            redis_url=url,
            redis_password_file=str(secrets / "redis_worker_password"),
            redis_sentinel_password_file=str(secrets / "sentinel_client_password"),
        )
        worker = sync_client(settings.redis_url)
        worker.set("tf:probe", "1")
        # When the primary's pod dies and the Sentinels promote a replica, which takes a write…
        procs[0].kill()
        procs[0].wait(timeout=10)
        _until(lambda: _primary(watcher)[1] in ports[1:])
        new = ports.index(_primary(watcher)[1])
        _until(lambda: worker.set("tf:probe", "2"))
        # …and the old primary's pod starts again, with its AOF of before:
        procs[0] = _redis(tmp_path / "r0", secrets, ports[0], None, k8s)
        # Then it asked the Sentinels and came back as a replica of the promoted Redis, with its write: no second
        # primary, no rollback.
        assert f"replica of localhost:{ports[new]}" in (tmp_path / "r0" / "stderr").read_text()
        _until(lambda: admin[0].info("replication")["role"] == "slave")
        assert admin[0].info("replication")["master_port"] == ports[new]
        _until(lambda: admin[0].get("tf:probe") == b"2")
        assert _primary(watcher) == ("localhost", ports[new])
        assert worker.get("tf:probe") == b"2"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize("missing", ["redis_replica_password", "redis_sentinel_password", "sentinel_client_password"])
def test_a_head_that_fails_over_refuses_to_start_without_its_passwords(tmp_path: Path, missing: str) -> None:
    RedisServer(tmp_path / "probe")
    _secrets(tmp_path / "secrets")
    if missing == "sentinel_client_password":
        (tmp_path / "secrets" / missing).write_text("short\n")  # optional, but never weak: given, it is checked
    else:
        (tmp_path / "secrets" / missing).unlink()
    if missing == "redis_replica_password":
        env = {**os.environ, "REDIS_HA": "yes", "REDIS_SECRETS_DIR": str(tmp_path / "secrets")}
        env["REDIS_ACL_FILE"] = str(tmp_path / "run" / "users.acl")
        argv = ["sh", str(REDIS_ENTRYPOINT), "true"]
    else:
        env = {**os.environ, "REDIS_SECRETS_DIR": str(tmp_path / "secrets"), "SENTINEL_DIR": str(tmp_path / "s")}
        env["SENTINEL_PRIMARY_HOST"] = "127.0.0.1"
        argv = ["sh", str(SENTINEL_ENTRYPOINT)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and missing in result.stderr, result.stderr
