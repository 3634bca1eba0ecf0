"""Reliability when the SGLang server fails: killed and restarted, and a mix of faults with an outage.

Given real workers driving the simulator over loopback, when the server dies, answers 503, drops
connections, hangs or goes away for a while, then every prompt is stored exactly once, byte-exact,
and no transient fault ends in the dead letter.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import RecoveryWatch, WorkerProcess, dead_letters, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, post_json, sim_stats, simulator, submit_ids
from testing.invariant_watch import InvariantWatch
from testing.record import check_job, record_result

#: The issue's fault mix: 5 % 503, 1 % dropped connections, 0.5 % hangs.
FAULT_MIX = ("--fault-503-rate", "0.05", "--fault-drop-rate", "0.01", "--fault-hang-rate", "0.005")


def test_simulator_killed_and_restarted_on_the_same_port_loses_nothing(redis_url: str, tmp_path: Path) -> None:
    # Given a worker busy with a server that will be SIGKILLed mid-job.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    sim = SimulatorProcess("--time-scale", "40")
    sim.log_path = str(tmp_path / "sim.log")
    started = time.monotonic()
    sim.start()
    worker = WorkerProcess("w1", fast_env(settings, sim.url, max_inflight=8), tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "simkill", make_prompts(50))
        wait_until(lambda: job_progress(client, keys, "simkill")["done"] >= 15, 120, what="15 rows")
        wait_until(lambda: in_flight(client, keys, "simkill"), 30, what="work in flight")
        # When the server is killed with requests in flight and comes back on the same port.
        watch = RecoveryWatch(redis_url, keys, "simkill", "sim-sigkill").start()
        sim.kill()
        time.sleep(2.0)
        sim.start()
        wait_until(lambda: job_progress(client, keys, "simkill")["done"] == 50, 180, what="50 rows")
    finally:
        worker.terminate()
        sim.kill()
    # Then nothing is lost, duplicated, altered — or dead-lettered for a transient failure.
    outcome = check_job(settings, "simkill", job.prompts, job.sampling_params)
    record_result(
        "SGLang server SIGKILL + restart on the same port",
        outcome,
        "server down ≈ 3 s with 8 requests in flight",
        [watch.stop()],
        time.monotonic() - started,
    )
    outcome.assert_clean()
    assert dead_letters(client, keys, "simkill") == {}


@pytest.mark.parametrize("outage_s", [3.0])
def test_fault_mix_and_an_outage_lose_nothing(redis_url: str, tmp_path: Path, outage_s: float) -> None:
    run_fault_mix(redis_url, tmp_path, prompts=120, outage_s=outage_s, ci=True)


def run_fault_mix(redis_url: str, tmp_path: Path, prompts: int, outage_s: float, ci: bool) -> None:
    """Two workers on one server with the fault mix; an outage of ``outage_s`` wall seconds mid-job."""
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    started = time.monotonic()
    invariant = InvariantWatch(settings, "faults")
    with simulator(tmp_path, "--time-scale", "100", *FAULT_MIX, "--fault-seed", "11") as sim:
        env = fast_env(settings, sim, max_inflight=8)
        workers = [WorkerProcess(f"w{i}", env, tmp_path).start() for i in (1, 2)]
        try:
            for w in workers:
                w.wait_ready(client, keys)
            job = submit_ids(settings, "faults", make_prompts(prompts))
            invariant.start()  # every prompt stays somewhere through the faults and the outage
            wait_until(lambda: job_progress(client, keys, "faults")["done"] >= prompts // 3, 180, what="a third")
            # When the server goes down for outage_s (503 everywhere, in-flight calls dropped).
            watch = RecoveryWatch(redis_url, keys, "faults", "outage").start()
            post_json(f"{sim}/control/outage", {"duration_s": outage_s})
            wait_until(lambda: job_progress(client, keys, "faults")["done"] == prompts, 600, what="all rows")
            injected = sim_stats(sim)["faults"]
        finally:
            invariant.stop()
            for w in workers:
                w.terminate()
    outcome = check_job(settings, "faults", job.prompts, job.sampling_params)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(dict(injected).items()))  # type: ignore[call-overload]
    record_result(
        f"SGLang faults 5 % 503 / 1 % drop / 0.5 % hang + {outage_s:.0f} s outage",
        outcome,
        f"injected: {counts}",
        [watch.stop()],
        time.monotonic() - started,
        workers=2,
        ci=ci,
    )
    outcome.assert_clean()
    invariant.assert_held()
    assert dead_letters(client, keys, "faults") == {}, "transient faults never end in the dead letter"
    assert dict(injected).get("503", 0) > 0 and dict(injected).get("outage") == 1  # type: ignore[call-overload]
