"""The head that fails over, as deploy/ runs it (docker-compose.sentinel.yml), outside containers: each Redis started
by deploy/head/redis/entrypoint.sh with REDIS_HA=yes (the ACL users of users.ha.acl.template, masteruser/masterauth
from the password file, REDIS_REPLICAOF), each Sentinel by deploy/head/sentinel/entrypoint.sh — every password from
deploy/make-secrets.sh's files, none on a command line. The primary is then killed: the Sentinels (logged in as the
`sentinel` user) must promote the replica, and a worker-user client on the sentinel:// URL must write to it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import redis

from testing.fleet import free_port, wait_for_port
from testing.services import RedisServer
from thinkfleet.redis_client import sync_client

REPO = Path(__file__).resolve().parent.parent
REDIS_ENTRYPOINT = REPO / "deploy" / "head" / "redis" / "entrypoint.sh"
SENTINEL_ENTRYPOINT = REPO / "deploy" / "head" / "sentinel" / "entrypoint.sh"


def _secrets(directory: Path) -> dict[str, str]:
    subprocess.run(["sh", str(REPO / "deploy" / "make-secrets.sh"), str(directory)], check=True, capture_output=True)
    return {f.name: f.read_text().strip() for f in directory.glob("redis_*_password")}


def _redis(workdir: Path, secrets: Path, port: int, replica_of: int | None) -> subprocess.Popen[bytes]:
    workdir.mkdir(parents=True)
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
    argv = ["sh", str(REDIS_ENTRYPOINT), "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--dir", str(workdir), "--repl-diskless-sync-delay", "0"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=(workdir / "stderr").open("w"))
    wait_for_port(port)
    return proc


def _sentinel(workdir: Path, secrets: Path, primary: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {
        **os.environ,
        "REDIS_SECRETS_DIR": str(secrets),
        "SENTINEL_DIR": str(workdir),
        "SENTINEL_PORT": str(port),
        "SENTINEL_PRIMARY_HOST": "127.0.0.1",
        "SENTINEL_PRIMARY_PORT": str(primary),
        "SENTINEL_QUORUM": "1",
        "SENTINEL_DOWN_AFTER_MS": "1000",
        "SENTINEL_FAILOVER_TIMEOUT_MS": "4000",
    }
    proc = subprocess.Popen(
        ["sh", str(SENTINEL_ENTRYPOINT)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port)
    return proc, port


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
    passwords = _secrets(tmp_path / "secrets")
    assert {"redis_replica_password", "redis_sentinel_password"} <= set(passwords)
    ports = [free_port() for _ in range(3)]
    procs = [_redis(tmp_path / "r0", tmp_path / "secrets", ports[0], None)]
    procs += [_redis(tmp_path / f"r{i}", tmp_path / "secrets", ports[i], ports[0]) for i in (1, 2)]
    sentinel = None
    try:
        admin = [
            redis.Redis(port=p, username="admin", password=passwords["redis_admin_password"], socket_timeout=5)
            for p in ports
        ]
        # Given the replicas synced through the `replica` user (masterauth from the file, never on argv)…
        online = lambda: [v.get("state") for k, v in admin[0].info("replication").items() if k.startswith("slave")]  # noqa: E731
        _until(lambda: online() == ["online", "online"])
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert not any(pw in ps for pw in passwords.values())
        # …and a Sentinel that logs in as `sentinel` and finds the replicas.
        sentinel, sport = _sentinel(tmp_path / "s0", tmp_path / "secrets", ports[0])
        watcher = redis.Redis(port=sport, socket_timeout=5)
        _until(lambda: len(watcher.sentinel_slaves("thinkfleet")) == 2)
        conf = (tmp_path / "s0" / "sentinel.conf").read_text()
        assert "auth-user thinkfleet sentinel" in conf
        url = f"sentinel://worker@127.0.0.1:{sport}/0?master=thinkfleet"
        worker = sync_client(url, password=passwords["redis_worker_password"])
        worker.set("tf:probe", "1")
        # When the primary dies, Then the Sentinel promotes a replica (SLAVEOF NO ONE, CONFIG REWRITE as `sentinel`),
        # points the other at it, and the worker's client writes to it through the same URL (min-replicas-to-write
        # 1: the new primary has its replica).
        procs[0].kill()
        procs[0].wait(timeout=10)
        _until(lambda: watcher.sentinel_get_master_addr_by_name("thinkfleet")[1] in ports[1:])
        new = ports.index(watcher.sentinel_get_master_addr_by_name("thinkfleet")[1])
        _until(lambda: admin[new].info("replication")["role"] == "master")
        _until(lambda: worker.set("tf:probe", "2"))
        assert admin[new].get("tf:probe") == b"2"
        for i in (1, 2):
            assert not admin[i].acl_log(), f"a user was denied a command it needs on r{i}"
    finally:
        for proc in [*procs, *([sentinel] if sentinel else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize("missing", ["redis_replica_password", "redis_sentinel_password"])
def test_a_head_that_fails_over_refuses_to_start_without_its_passwords(tmp_path: Path, missing: str) -> None:
    RedisServer(tmp_path / "probe")
    _secrets(tmp_path / "secrets")
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
