"""End to end with real parts: a real redis-server, real `worker` (celery) subprocesses, the SGLang
simulator over loopback, real Parquet. Each test proves one promise of the worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from sglang_sim.content import expected_generation
from storage.reader import raw_duplicates, read_committed
from testing.fleet import dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, post_json, sim_stats, submit_ids
from testing.module_fleet import Fleet, FleetPool, fleet
from testing.services import RedisServer
from thinkfleet.sglang_version import SGLANG_VERSION

FAST = ("--time-scale", "1000")
#: The SGLang releases the simulator imitates: the deployed one (compose pin) and the current one.
PROFILES = ("0.5.9", "0.5.23")
#: The shared simulator's context: the overflow test's long prompt exceeds it, every other prompt fits with its
#: 2,048 new tokens.
CONTEXT = ("--context-length", "4096")


def _assert_byte_exact(settings, job) -> None:
    table = read_committed(settings.output_uri, job.name)
    rows = {r["prompt_id"]: r for r in table.to_pylist()}
    assert set(rows) == set(job.prompts), "every submitted prompt is stored"
    for pid, ids in job.prompts.items():
        want = expected_generation(ids, job.sampling_params)
        assert rows[pid]["input_ids"] == ids
        assert rows[pid]["output_ids"] == want.output_ids, pid
        assert rows[pid]["completion_tokens"] == len(want.output_ids)
    assert raw_duplicates(settings.output_uri, job.name).num_rows == 0, "no prompt stored twice"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path


@pytest.fixture(scope="module")
def fleets(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPool]:
    """Fleets of one simulator and one worker, one per SGLang release, shared by the tests that neither kill nor
    reconfigure them (each submits its own job); the others start their own (:func:`fleet`)."""
    pool = FleetPool(redis_server.url(0), tmp_path_factory.mktemp("worker-e2e"))
    yield pool
    pool.close()


def _shared(fleets: FleetPool, version: str = SGLANG_VERSION) -> Fleet:
    return fleets.get(version, (*FAST, *CONTEXT, "--sglang-version", version), max_inflight=8)


def test_faults_and_an_outage_lose_nothing_and_dead_letter_nothing(redis_url: str, workdir: Path) -> None:
    faults = ("--fault-503-rate", "0.1", "--fault-drop-rate", "0.05", "--fault-hang-rate", "0.03", "--fault-seed", "3")
    # its own fleet: the outage is the server's for everyone
    with fleet(redis_url, workdir, (*FAST, *faults), max_inflight=8) as f:
        settings, client = f.settings, f.client
        job = submit_ids(settings, "faults", make_prompts(40))
        wait_until(lambda: job_progress(client, settings.keys, "faults")["done"] >= 10, 120, what="10 rows")
        post_json(f"{f.sim}/control/outage", {"duration_s": 3})  # 503 everywhere, health included
        wait_until(lambda: job_progress(client, settings.keys, "faults")["done"] == 40, 240, what="40 rows")
        assert dead_letters(client, settings.keys, "faults") == {}
    _assert_byte_exact(settings, job)


def test_killed_worker_loses_no_prompt_and_duplicates_none(redis_url: str, workdir: Path) -> None:
    # its own fleet (a worker is killed), on a slower simulator: the kill lands with prompts in flight
    with fleet(redis_url, workdir, ("--time-scale", "60"), workers=("victim", "survivor"), max_inflight=6) as f:
        settings, client, victim = f.settings, f.client, f.workers[0]
        job = submit_ids(settings, "kill", make_prompts(40))
        wait_until(lambda: job_progress(client, settings.keys, "kill")["done"] >= 5, 120, what="5 rows")
        victim.kill()
        wait_until(lambda: job_progress(client, settings.keys, "kill")["done"] == 40, 240, what="40 rows")
    _assert_byte_exact(settings, job)


def test_reasoning_alarm_fires_when_no_row_has_think_end(redis_url: str, workdir: Path) -> None:
    with fleet(redis_url, workdir, (*FAST, "--no-think-end"), alarm_min_rows=20) as f:
        settings, client, worker = f.settings, f.client, f.workers[0]
        submit_ids(settings, "seedbug", make_prompts(25))
        wait_until(lambda: job_progress(client, settings.keys, "seedbug")["done"] == 25, 120, what="25 rows")
        alarm = json.loads(client.get(settings.keys.alarm("seedbug")))
    assert alarm["rows"] == 20 and alarm["missing_think_end"] == 20
    assert "REASONING ALARM" in worker.log_path.read_text()


# -- on the shared fleets (the tests above start their own, and run first: no shared fleet idles meanwhile) ----
def test_context_overflow_is_dead_lettered_with_its_reason_before_any_server_call(fleets: FleetPool) -> None:
    f = _shared(fleets)
    settings, client = f.settings, f.client
    prompts = make_prompts(6)
    prompts["too-long"] = prompts["p00000"] * 40  # ~2,500 ids + 2,048 new > the 4,096 context
    submit_ids(settings, "poison", prompts)
    wait_until(
        lambda: sum(job_progress(client, settings.keys, "poison")[k] for k in ("done", "dead")) == 7,
        120,
        what="all resolved",
    )
    # this job's requests (a request id is "job/prompt/r…/a…"; the shared simulator saw other jobs' too)
    sent = {rid.split("/")[1] for rid in sim_stats(f.sim, rids=True)["rids"] if rid.split("/")[0] == "poison"}
    dead = dead_letters(client, settings.keys, "poison")
    assert set(dead) == {"too-long"}
    assert dead["too-long"]["error_class"] == "context_overflow"
    assert "context length" in dead["too-long"]["message"]
    assert f"+ max_new_tokens 2048 = {len(prompts['too-long']) + 2048} tokens" in dead["too-long"]["message"]
    assert dead["too-long"]["attempts"] == 0, "refused before it was sent, never retried"
    assert "too-long" not in sent and len(sent) == 6, "the server never saw it"


def test_redelivered_stored_prompt_makes_no_server_call(fleets: FleetPool) -> None:
    f = _shared(fleets)
    settings, client = f.settings, f.client
    prompts = make_prompts(3)
    submit_ids(settings, "redeliver", prompts)
    wait_until(lambda: job_progress(client, settings.keys, "redeliver")["done"] == 3, 60, what="3 rows")
    before = sim_stats(f.sim)
    submit_ids(settings, "redeliver", {"p00001": prompts["p00001"]})  # the same message again
    wait_until(
        lambda: client.llen(settings.queue) == 0 and not client.hlen(f"{settings.key_prefix}:kombu:unacked"),
        60,
        what="the copy consumed",
    )
    after = sim_stats(f.sim)
    assert after["generate_calls"] == before["generate_calls"], "a stored prompt costs no server call"
    assert len(read_committed(settings.output_uri, "redeliver")) == 3


def test_plain_celery_command_runs_the_same_worker(redis_url: str, workdir: Path, fleets: FleetPool) -> None:
    import socket
    import subprocess
    import sys

    # the shared simulator; its own key prefix and queue, so the shared fleet's worker takes none of its messages
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    sim = _shared(fleets).sim
    env = fast_env(settings, sim, max_inflight=4)
    log = open(workdir / "logs" / "celery.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-n", "plain@%h", "-l", "INFO"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        identity = f"plain-{socket.gethostname()}"
        # Its entry in the workers hash is written with its first heartbeat once its runtime is built (the
        # heartbeat itself exists earlier: the name is held before anything else is touched).
        wait_until(lambda: client.hexists(settings.keys.workers, identity), 60, what="celery worker ready")
        info = json.loads(client.hget(settings.keys.workers, identity))
        assert info["max_inflight"] == 4
        job = submit_ids(settings, "plain", make_prompts(8))
        wait_until(lambda: job_progress(client, settings.keys, "plain")["done"] == 8, 120, what="8 rows")
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    _assert_byte_exact(settings, job)


@pytest.mark.parametrize("version", PROFILES)
def test_happy_path_stores_byte_exact_output_ids(fleets: FleetPool, version: str) -> None:
    f = _shared(fleets, version)
    settings, client = f.settings, f.client
    job = submit_ids(settings, "happy", make_prompts(30))
    wait_until(lambda: job_progress(client, settings.keys, "happy")["done"] == 30, 120, what="30 rows")
    _assert_byte_exact(settings, job)
    assert not client.exists(settings.keys.alarm("happy")), "the reasoning alarm stays quiet on normal output"
    assert job_progress(client, settings.keys, "happy")["dead"] == 0
    meta = read_committed(settings.output_uri, "happy", columns=["reasoning_tokens", "num_retractions"]).to_pylist()
    assert all(r["num_retractions"] is not None for r in meta), "either retraction key is read"
    if version == "0.5.9":  # no reasoning_tokens before 0.5.10: null, never 0 or a guess
        assert all(r["reasoning_tokens"] is None for r in meta)
    else:
        assert all(r["reasoning_tokens"] for r in meta)
