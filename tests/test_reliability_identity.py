"""One identity per live worker: a worker name is held by one live process at a time (workers/identity.py).

Two workers under one name (``THINKFLEET_WORKER_NAME`` copied between hosts) would take each other's claims
as their own, and the second's start-up ``abandon_claims`` would orphan the first's live claims. With real
parts (redis-server, the simulator, real ``worker`` processes):

- a second worker under a live worker's name refuses to start (exit 78, naming the first's host and pid),
  consumes nothing and orphans nothing; the first finishes its job exactly once;
- a worker SIGKILLed and restarted under its name on the same host starts (its dead life's heartbeat is
  taken over at once: its pid no longer runs) and finishes the job exactly once;
- a running worker whose heartbeat is taken by another process under its name (a twin that slipped past)
  stops consuming, hands back what it holds, acks nothing more and never takes the name back; a worker
  under another name then stores every prompt exactly once.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.compute as pc
import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from storage.reader import read_committed
from testing.fleet import WorkerProcess, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, post_json, submit_ids
from testing.record import check_job, record_result
from thinkfleet.broker.keys import KombuKeys

#: A lease long enough that a loaded box never misses a live worker's heartbeat (it beats every lease/4).
LEASE_S = 8
START_FAILED_EXIT = 78


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimulatorProcess]:
    proc = SimulatorProcess("--time-scale", "100")
    proc.log_path = str(tmp_path / "sim.log")
    proc.start()
    yield proc
    proc.kill()


def _log(worker: WorkerProcess, this_run: bool = False) -> str:
    """The worker's log (``this_run``: only what its latest start wrote)."""
    data = worker.log_path.read_bytes()
    return data[worker.log_offset if this_run else 0 :].decode(errors="replace")


def test_a_second_worker_under_a_live_workers_name_refuses_to_start(
    redis_url: str, tmp_path: Path, sim: SimulatorProcess
) -> None:
    # Given a worker "twin" running a job, holding claims.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    env = fast_env(settings, sim.url, lease_s=LEASE_S, max_inflight=4)
    first = WorkerProcess("twin", env, tmp_path).start()
    second = WorkerProcess("twin", env, tmp_path, log_name="twin-second")
    started = time.monotonic()
    try:
        first.wait_consuming()
        first.wait_ready(client, keys)
        held = json.loads(client.get(keys.heartbeat("twin")))
        assert first.proc is not None
        assert held["pid"] == first.proc.pid and held["host"] == socket.gethostname() and held["nonce"]
        post_json(f"{sim.url}/control/stall", {"seconds": 120})  # its requests wait at the server
        job = submit_ids(settings, "twins", make_prompts(12))
        wait_until(lambda: len(in_flight(client, keys, "twins", "twin")) >= 4, 60, what="the first holds claims")
        claims_before = client.hgetall(keys.claims("twins"))
        # When a second worker starts under the same name (on "another host": the same pid namespace here,
        # but its pid lives, so only watching the heartbeat can tell).
        second.start()
        assert second.proc is not None
        rc = second.proc.wait(LEASE_S * 4 + 60)
        # Then it refuses to start, naming the live holder, and consumed and orphaned nothing.
        text = _log(second)
        assert rc == START_FAILED_EXIT, text[-3000:]
        assert "cannot start, nothing was consumed" in text
        assert f"pid {first.proc.pid} on host {socket.gethostname()}" in text
        assert "refreshed while this worker watched" in text
        assert "received" not in text, "the refused twin consumed nothing"
        claims_after = client.hgetall(keys.claims("twins"))
        assert all(claims_after.get(k) == v for k, v in claims_before.items()), "its start-up orphaned no claim"
        assert json.loads(client.get(keys.heartbeat("twin")))["nonce"] == held["nonce"], "the first still holds it"
        assert first.alive()
        post_json(f"{sim.url}/control/stall", {"seconds": 0})
        wait_until(lambda: job_progress(client, keys, "twins")["done"] == 12, 120, what="the first finished")
    finally:
        post_json(f"{sim.url}/control/stall", {"seconds": 0})
        second.kill()
        first.terminate()
    outcome = check_job(settings, "twins", job.prompts, job.sampling_params)
    record_result(
        "twin worker names: the second refuses to start",
        outcome,
        "a second worker started under a live worker's name (THINKFLEET_WORKER_NAME copied) while it held claims",
        [],
        time.monotonic() - started,
        workers=2,
        notes="exit 78 naming the holder's host and pid; no claim orphaned",
    )
    outcome.assert_clean()


def test_a_worker_sigkilled_and_restarted_under_its_name_starts_and_finishes(
    redis_url: str, tmp_path: Path, sim: SimulatorProcess
) -> None:
    # Given a worker running a job, SIGKILLed while it holds claims: its heartbeat outlives it (one lease — 20 s
    # here, longer than any restart on a loaded box: with 8 s the heartbeat could lapse before the new life looked,
    # and the takeover this test checks never happen).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    env = fast_env(settings, sim.url, lease_s=20, max_inflight=4)
    worker = WorkerProcess("phoenix", env, tmp_path).start()
    started = time.monotonic()
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "phoenix", make_prompts(24))
        wait_until(lambda: in_flight(client, keys, "phoenix", "phoenix"), 60, what="claims held")
        dead_pid = worker.proc.pid if worker.proc else None
        worker.kill()
        assert json.loads(client.get(keys.heartbeat("phoenix")))["pid"] == dead_pid, "the dead life's heartbeat"
        # When it is restarted under the same name on the same host.
        worker.start()
        worker.wait_ready(client, keys)
        # Then it takes the dead life's heartbeat over (its pid no longer runs) and finishes the job.
        run_log = _log(worker, this_run=True)
        assert f"its pid {dead_pid} no longer runs on this host" in run_log, run_log[-3000:]
        wait_until(lambda: job_progress(client, keys, "phoenix")["done"] == 24, 180, what="24 rows")
    finally:
        worker.terminate()
    outcome = check_job(settings, "phoenix", job.prompts, job.sampling_params)
    record_result(
        "worker SIGKILLed and restarted under its name",
        outcome,
        "SIGKILL of the only worker while it held claims; restarted at once under the same --name",
        [],
        time.monotonic() - started,
        notes="the dead life's heartbeat is taken over at once (same host, its pid gone)",
    )
    outcome.assert_clean()


def test_a_worker_whose_heartbeat_is_taken_stops_and_hands_everything_back(
    redis_url: str, tmp_path: Path, sim: SimulatorProcess
) -> None:
    # Given a worker holding 6 prompts in flight at a stalled server.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    env = fast_env(settings, sim.url, lease_s=LEASE_S, max_inflight=6)
    victim = WorkerProcess("shared", env, tmp_path).start()
    rescuer = WorkerProcess("rescuer", env, tmp_path)
    started = time.monotonic()
    try:
        victim.wait_consuming()
        victim.wait_ready(client, keys)
        post_json(f"{sim.url}/control/stall", {"seconds": 120})
        job = submit_ids(settings, "taken", make_prompts(6))
        wait_until(lambda: len(in_flight(client, keys, "taken", "shared")) == 6, 60, what="6 claims held")
        # When another process takes its name's heartbeat (a twin that slipped past: the CAS sees its nonce).
        twin = {"host": "elsewhere", "pid": 4242, "nonce": "f" * 32, "started_at": time.time(), "at": time.time()}
        client.set(keys.heartbeat("shared"), json.dumps(twin), px=LEASE_S * 1000)
        wait_until(lambda: "IS HELD BY ANOTHER PROCESS" in _log(victim), 60, what="the victim saw its name taken")
        post_json(f"{sim.url}/control/stall", {"seconds": 0})
        # Then it hands every message back (queued again, or popped into its transit list before its consumer
        # stopped: swept back once its name has no heartbeat) and finalizes nothing; its claims stay.
        unacked = KombuKeys(settings.key_prefix).unacked
        wait_until(
            lambda: not client.hlen(unacked) and client.llen(settings.queue) + client.llen(keys.transit("shared")) == 6,
            60,
            interval_s=0.05,
            what="the 6 messages handed back",
        )
        assert job_progress(client, keys, "taken")["done"] == 0
        assert len(in_flight(client, keys, "taken", "shared")) == 6, "claims that may be the twin's are left alone"
        assert "elsewhere" in _log(victim) and "4242" in _log(victim)
        # And when the twin goes away, the victim never takes the name back; another worker stores them all.
        client.delete(keys.heartbeat("shared"))
        rescuer.start()
        rescuer.wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, "taken")["done"] == 6, 120, what="the rescuer stored 6")
        assert not client.exists(keys.heartbeat("shared")), "a lost name is never taken back"
        assert victim.alive()
    finally:
        post_json(f"{sim.url}/control/stall", {"seconds": 0})
        victim.terminate()
        rescuer.terminate()
    outcome = check_job(settings, "taken", job.prompts, job.sampling_params)
    workers = read_committed(settings.output_uri, "taken", columns=["worker"])["worker"]
    record_result(
        "a worker's heartbeat taken under its name",
        outcome,
        "another process's heartbeat written under a running worker's name while it held 6 prompts in flight",
        [],
        time.monotonic() - started,
        workers=2,
        notes="the worker stops consuming, hands back all 6, acks nothing; another worker stores them",
    )
    outcome.assert_clean()
    assert pc.all(pc.equal(workers, "rescuer")).as_py(), "the worker that lost its name stored nothing"


def test_a_dead_lifes_heartbeat_brought_back_by_a_redis_rollback_is_taken_back(
    redis_url: str, tmp_path: Path, sim: SimulatorProcess
) -> None:
    # Given a running worker, whose heartbeat Redis replaces with the one an earlier life of its name wrote on
    # another host (a rollback to an older snapshot: that life began holding the name before this one did).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    worker = WorkerProcess("rolled", fast_env(settings, sim.url, lease_s=LEASE_S), tmp_path).start()
    try:
        worker.wait_consuming().wait_ready(client, keys)
        ours = json.loads(client.get(keys.heartbeat("rolled")))
        earlier = {**ours, "host": "elsewhere", "pid": 4242, "nonce": "e" * 32, "since": ours["since"] - 600}
        client.set(keys.heartbeat("rolled"), json.dumps(earlier), px=LEASE_S * 1000)
        # Then its next beat takes it back, and it keeps working.
        wait_until(
            lambda: json.loads(client.get(keys.heartbeat("rolled")) or "{}").get("nonce") == ours["nonce"],
            60,
            what="the heartbeat taken back",
        )
        assert "taking it back" in _log(worker) and "IS HELD BY ANOTHER PROCESS" not in _log(worker)
        job = submit_ids(settings, "rolled", make_prompts(8))
        wait_until(lambda: job_progress(client, keys, "rolled")["done"] == 8, 120, what="8 rows")
    finally:
        worker.terminate()
    check_job(settings, "rolled", job.prompts, job.sampling_params).assert_clean()
